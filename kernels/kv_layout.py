"""How a layer's K and V pools lay out their blocks, and every access that depends on it.

- **tokens** (every device, the default): ``k, v [num_blocks, block_size, kv_heads, head_dim]``;
  the token at slot ``s = block * block_size + offset`` is row ``s`` of
  ``pool.view(-1, kv_heads, head_dim)``.
- **paired** (the CPU decode kernel in bfloat16 on CPUs with AVX-512 BF16): one slab per block
  and KV head, holding the operands of the kernel's bf16 dot-product instruction (two bf16 in
  a 32-bit lane) as they lie:
  ``k [num_blocks, kv_heads, head_dim / 2, block_size, 2]``: each pair of dimensions for every
  key of the block in a row (q . k takes 16 keys' pairs in one load);
  ``v [num_blocks, kv_heads, block_size / 2, head_dim, 2]``: each pair of keys for every
  dimension (p . v takes two keys' values in one load).
  Keys and values of the tokens layout are transposed and interleaved in registers on every
  read instead, which made up about a quarter of the decode attention's time on the fleet
  trace (``kernels/csrc/paged_decode_cpu.cpp``).

The pool's shape says its layout (4 dims: tokens, 5: paired); K and V are told apart by the
caller. Writes of a step's K/V, gathers into the tokens layout (the GEMM prefill attention and
the cascade; on a paired pool only the reference paths gather, since the kernel that reads it
takes every row of a step in place), and slot copies (copy-on-write of a partial block) go
through this module; tier copies move whole blocks (``pool[block]``) and need no layout.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import cpu_kernels

LAYOUTS = ("auto", "tokens", "paired")


def allocate_kv(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device | str, paired: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's (K, V) pools, zero-filled (a paired slab's unwritten keys are then finite)."""
    if not paired:
        shape = (num_blocks, block_size, kv_heads, head_dim)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
    if block_size % 2 or head_dim % 2:
        raise ValueError(f"the paired layout needs an even block_size and head_dim, got {block_size}, {head_dim}")
    return (torch.zeros((num_blocks, kv_heads, head_dim // 2, block_size, 2), dtype=dtype, device=device),
            torch.zeros((num_blocks, kv_heads, block_size // 2, head_dim, 2), dtype=dtype, device=device))


def is_paired(cache: torch.Tensor) -> bool:
    return cache.dim() == 5


def kv_heads_of(cache: torch.Tensor) -> int:
    return cache.shape[1] if is_paired(cache) else cache.shape[2]


def _token_order(cache: torch.Tensor, key: bool) -> torch.Tensor:
    """A paired pool as a view whose dims, read in order, are the tokens layout's (a block's
    offset split in two for V, a head's dimension split in two for K)."""
    return cache.permute(0, 3, 1, 2, 4) if key else cache.permute(0, 2, 4, 1, 3)


def _element_index(cache: torch.Tensor, key: bool, slots: torch.Tensor) -> torch.Tensor:
    """``[len(slots) * kv_heads * head_dim]`` int64: where the slots' K (``key``) or V elements
    lie in ``cache.view(-1)``, slot by slot, each in (head, dimension) order."""
    if not is_paired(cache):
        _, _, kv_heads, dim = cache.shape
        lanes = torch.arange(kv_heads * dim, device=cache.device)
        return (slots[:, None] * (kv_heads * dim) + lanes).view(-1)
    kv_heads = cache.shape[1]
    block_size, dim = (cache.shape[3], 2 * cache.shape[2]) if key else (2 * cache.shape[2], cache.shape[3])
    blocks, offsets = slots // block_size, slots % block_size
    head = torch.arange(kv_heads, device=cache.device)[:, None] * (dim * block_size)  # a (block, head) slab
    d = torch.arange(dim, device=cache.device)[None, :]
    if key:  # [.., dim / 2, block_size, 2]: pair row d // 2, key column, element d % 2
        token = offsets * 2
        lanes = head + (d // 2) * (2 * block_size) + d % 2
    else:  # [.., block_size / 2, dim, 2]: key pair, dimension, element offset % 2
        token = (offsets // 2) * (2 * dim) + offsets % 2
        lanes = head + 2 * d
    return (blocks[:, None] * (kv_heads * dim * block_size) + token[:, None] + lanes.view(1, -1)).view(-1)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store the new tokens' K/V at their slots (in place)."""
    if not is_paired(k_cache):
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)
        return
    native = _native(k_cache)
    if native is not None:
        native.paired_write_kv(k_cache, v_cache, k, v, slot_mapping)
        return
    for cache, new, key in ((k_cache, k, True), (v_cache, v, False)):  # the plain-torch twin
        cache.view(-1).index_copy_(0, _element_index(cache, key, slot_mapping), new.reshape(-1))


def copy_slots(cache: torch.Tensor, key: bool, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``cache``'s slots ``dst`` take the K (``key``) or V of slots ``src`` (in place)."""
    flat = cache.view(-1)
    flat[_element_index(cache, key, dst)] = flat[_element_index(cache, key, src)]


def gather(cache: torch.Tensor, key: bool, block_table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[..., nb] block ids -> [..., nb * block_size, kv_heads, head_dim]: the blocks' K (``key``)
    or V in the tokens layout, contiguous (``out``: where a tokens pool's blocks go; a paired
    pool's go to a new tensor)."""
    # NOTE: index_select over 2-D rows (one block each) is a parallel memcpy; over the 4-D
    # tensor it is several times slower on CPU.
    if not is_paired(cache):
        rows = torch.index_select(cache.view(cache.shape[0], -1), 0, block_table.flatten(), out=out)
        return rows.view(*block_table.shape[:-1], -1, *cache.shape[2:])
    native = _native(cache)
    if native is not None:
        tokens = native.paired_gather(cache, key, block_table.flatten())
    else:  # the plain-torch twin
        tokens = _token_order(cache.index_select(0, block_table.flatten()), key)
    head_dim = 2 * cache.shape[2] if key else cache.shape[3]
    return tokens.reshape(*block_table.shape[:-1], -1, cache.shape[1], head_dim)


def _native(cache: torch.Tensor):
    """The CPU extension, whose paired writes and gathers are a loop of stores where the torch
    twins scatter or transpose element by element (4-8x slower), or None (not built, not a CPU
    pool)."""
    return cpu_kernels() if cache.is_cpu else None
