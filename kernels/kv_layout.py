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
caller. Writes of a step's K/V, gathers into the tokens layout (prefill attention, the cascade
reference), and slot copies (copy-on-write of a partial block) go through this module; tier
copies move whole blocks (``pool[block]``) and need no layout.
"""

from __future__ import annotations

import torch

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


def _slot_index(cache: torch.Tensor, key: bool, slots: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(view, index): ``view[index]`` is ``[len(slots), kv_heads, ...]``, the slots' K or V."""
    if not is_paired(cache):
        return cache.view(-1, *cache.shape[2:]), (slots,)
    block_size = cache.shape[3] if key else 2 * cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    if key:  # [N, block_size, kv_heads, head_dim / 2, 2]
        return _token_order(cache, key), (blocks, offsets)
    return _token_order(cache, key), (blocks, offsets // 2, offsets % 2)  # [N, block_size / 2, 2, kv_heads, head_dim]


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
    for cache, new, key in ((k_cache, k, True), (v_cache, v, False)):
        view, index = _slot_index(cache, key, slot_mapping)
        view[index] = new.reshape(new.shape[0], *view.shape[len(index):])


def copy_slots(cache: torch.Tensor, key: bool, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``cache``'s slots ``dst`` take the K (``key``) or V of slots ``src`` (in place)."""
    view, to = _slot_index(cache, key, dst)
    _, of = _slot_index(cache, key, src)
    view[to] = view[of]


def gather(cache: torch.Tensor, key: bool, block_table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[..., nb] block ids -> [..., nb * block_size, kv_heads, head_dim]: the blocks' K (``key``)
    or V in the tokens layout, contiguous (``out``: where the blocks are read to; a paired pool's
    are then reordered into a new tensor)."""
    # NOTE: index_select over 2-D rows (one block each) is a parallel memcpy; over the 4-D
    # tensor it is several times slower on CPU.
    rows = torch.index_select(cache.view(cache.shape[0], -1), 0, block_table.flatten(), out=out)
    if not is_paired(cache):
        return rows.view(*block_table.shape[:-1], -1, *cache.shape[2:])
    blocks = _token_order(rows.view(-1, *cache.shape[1:]), key)
    head_dim = 2 * cache.shape[2] if key else cache.shape[3]
    return blocks.reshape(*block_table.shape[:-1], -1, cache.shape[1], head_dim)
