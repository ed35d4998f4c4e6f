"""Paged attention: one function (``paged_attention``) over the paged KV pools, with the
device's kernel underneath where there is one, and plain torch as the reference twin.

KV lives in per-layer pools ``k_cache, v_cache``, ``[num_blocks, block_size, kv_heads, head_dim]``
or the CPU decode kernel's paired layout (``kernels.kv_layout``, which every access goes
through). The token at position ``p`` of a sequence sits at slot
``block_table[p // block_size] * block_size + p % block_size``.

A step's tokens are laid out flat: first one token for each *decode* sequence, then the new
tokens of each *prefill* segment (a chunk of a prompt, after any cached prefix)::

    | decode 0 | decode 1 | ... | prefill A (n_A tokens) | prefill B (n_B tokens) | ...

On a CPU where the C++ kernel builds (``kernels.paged_decode_cpu``, metadata built
``in_place``), one call per layer reads every row's blocks where they lie, prefill tokens
included: each is a row that sees its context up to itself, and a prompt's rows, which share
all their blocks but the newest, run together (``KernelRows``). On fleet-like prefill steps
(2,048 tokens in chunks of 150-200 after 400-1,000 cached) that took 0.72-0.83 of the time of
the GEMM path below, whose per-segment gathers and bf16 score matrices it does without.
Elsewhere, and as the reference, decode attention is a cascade over shared blocks. Robots of
one type share a long system prompt, a robot's requests share its scene, and a replan shares
its whole conversation; the radix cache makes all of them share *physical* blocks. The decode
rows' block tables form a trie; each trie segment that enough rows pass through is read once
for all of them (all their queries against one K/V), each row gathers only the blocks no
segment covers, and the partial softmaxes are merged by log-sum-exp (keys are
position-encoded, so their order does not matter)::

    row r:  | system prompt (128 rows) | scene (8 rows) | history (2 rows) | own blocks |

All index tensors and masks are built once per step (``AttentionMetadata``), not per layer, on
the device of the KV pools. A cascade's decode problems are two batched GEMMs each
(``grouped_query_attention``). Prefill segments, where the in-place kernel does not run, are
two GEMMs around the CPU kernel's softmax (``gemm_attention``, causal visibility as counts per
query row) on a CPU where the extension builds; torch's flash kernel on other CPUs and the
float32 `attention_with_lse` elsewhere (`_flash_with_lse` dispatches), with the segment's mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kernels.attention_metadata import AttentionMetadata, DecodeBatch, PrefillSegment
from kernels.kv_layout import gather, kv_heads_of, write_kv
from kernels.layer_math import rotated
from kernels.layer_wait import LayerWait
from kernels.paged_decode_cpu import PagedDecode, paged_decode_kernel, paged_decode_tiles_kernel
from kernels.softmax_lse_cpu import SoftmaxLse, softmax_lse_kernel


# Bound once: looking an op up in torch.ops costs microseconds per call.
_cpu_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _flash_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, logsumexp) of attention: the public SDPA does not expose the logsumexp a merge
    needs. On the CPU, torch's flash kernel; on any other device, `attention_with_lse`."""
    if q.is_cpu:
        return _cpu_flash_with_lse(q, k, v, attn_mask=attn_mask, scale=scale)
    return attention_with_lse(q, k, v, attn_mask, scale)


def attention_with_lse(
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, H, Lk, D]
    v: torch.Tensor,  # [B, H, Lk, D]
    attn_mask: torch.Tensor,  # additive float, broadcastable to [B, H, Lq, Lk]
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, H, Lq, D] in q's dtype, lse [B, H, Lq] float32
    """Plain-torch twin of the CPU flash kernel (same shapes and dtypes), computed in float32.

    Every query row must see at least one key: a fully masked row gives NaN here (the CPU
    kernel gives zeros); the metadata never builds one.
    """
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale + attn_mask
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float())
    return out.to(q.dtype), lse


def paged_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # either layout of kernels.kv_layout
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """Attention of every query over its sequence's paged context (new K/V already written)."""
    if meta.kernel_rows is not None:  # the device's kernel reads rows' blocks in place
        rows = meta.kernel_rows
        if not meta.prefills:  # every row
            return _in_place_kernel(rows.tiles)(q, k_cache, v_cache, rows.block_tables, rows.context_lens, scale,
                                                False, rows.order)[0]
    out = torch.empty_like(q)
    if meta.kernel_rows is not None:  # the decode rows; the prefills below
        n = len(rows.context_lens)
        out[:n] = _in_place_kernel(rows.tiles)(q[:n], k_cache, v_cache, rows.block_tables, rows.context_lens, scale,
                                               False, rows.order)[0]
    elif meta.num_decodes:
        out[: meta.num_decodes] = _decode_attention(q[: meta.num_decodes], k_cache, v_cache, meta, scale)
    for seg in meta.prefills:
        rows = slice(seg.start, seg.start + seg.num_new)
        out[rows] = _prefill_attention(q[rows], k_cache, v_cache, seg, scale)
    return out


@dataclass(frozen=True)
class PagedAttentionStep:
    """The engine's attention for one step (``shared.model.llama.AttentionStep``): K/V go to
    ``meta.slot_mapping`` in the paged pools, queries read their sequences' blocks. Before a
    layer reads anything it waits on ``fences``: KV tier loads still landing in blocks this
    step reads, one layer at a time (so layer ``l`` computes while later layers copy)."""

    meta: AttentionMetadata
    fences: tuple[LayerWait, ...] = ()  # tier loads into blocks this step reads, layer by layer

    def attend(self, layer, q, k, v, kv_cache, scale: float, rope=None) -> torch.Tensor:
        for fence in self.fences:  # the layer's loaded KV must land before it is read
            fence.wait(layer)
        q, k = rotated(q, k, rope)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, self.meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, self.meta, scale)


def _prefill_attention(
    q: torch.Tensor,  # [n, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: PrefillSegment,
    scale: float,
) -> torch.Tensor:  # [n, heads, head_dim]
    """A segment's new tokens over its whole context, all heads at once: each KV head's group
    of query heads folded into the query rows (``seg.visible``'s order)."""
    n, heads, dim = q.shape
    kvh = kv_heads_of(k_cache)
    k = gather(k_cache, True, seg.block_table)[: seg.context_len].transpose(0, 1)  # [kvh, L, D]
    v = gather(v_cache, False, seg.block_table)[: seg.context_len].transpose(0, 1)
    qg = q.view(n, kvh, heads // kvh, dim).permute(1, 2, 0, 3).reshape(kvh, -1, dim)  # rows (j, t)
    softmax_lse = softmax_lse_kernel() if q.is_cpu else None
    if softmax_lse is not None:
        o, _ = gemm_attention(qg, k.contiguous(), v.contiguous(), seg.visible, scale, softmax_lse)
    else:
        o, _ = _flash_with_lse(qg[None], k[None], v[None], attn_mask=seg.mask, scale=scale)
    return o.view(kvh, heads // kvh, n, dim).permute(2, 0, 1, 3).reshape(n, heads, dim)


def gemm_attention(
    q: torch.Tensor,  # [B, M, D]
    k: torch.Tensor,  # [B, L, D]
    v: torch.Tensor,  # [B, L, D]
    visible: torch.Tensor,  # [M] int64 in [1, L]: query row m sees keys [0, visible[m])
    scale: float,
    softmax_lse: SoftmaxLse,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, M, D] in q's dtype, lse [B, M] float32
    """Attention as two GEMMs in the model's dtype (float32 accumulation, as HF eager computes
    it) around the CPU kernel's one-pass softmax: the GEMMs run at the CPU's matmul speed, where a
    flash kernel's many small blocks and a mask tensor cost several times more on these shapes."""
    scores = torch.bmm(q, k.transpose(1, 2))  # [B, M, L]
    lse = softmax_lse(scores, visible, scale)  # scores are probabilities now
    return torch.bmm(scores, v), lse


def _decode_attention(
    q: torch.Tensor,  # [num_decodes, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_decodes, heads, head_dim]
    """One query per row, as a cascade: every row gets one partial result (output +
    log-sum-exp) from its own blocks (slot 0) and one from each shared segment it is in; a
    softmax over the slots' log-sum-exps weights them into the exact attention over the row's
    whole context.
    """
    nd, heads, dim = q.shape
    kvh = kv_heads_of(k_cache)
    g = heads // kvh
    qg = q.view(nd, kvh, g, dim)  # kv head i serves query heads i*g .. i*g+g-1
    if meta.num_decode_parts == 1:  # no shared segment: each row's one problem is its answer
        out = torch.empty_like(qg)
        for batch, batch_out, _ in _decode_batches(qg, k_cache, v_cache, meta, scale):
            out.index_copy_(0, batch.rows.flatten(), batch_out.flatten(0, 1))
        return out.view(nd, heads, dim)
    slots = meta.num_decode_parts + 1  # the last one is the scratch slot padding writes into
    parts_out = q.new_zeros(nd * slots, kvh, g, dim)  # row-major (row, slot)
    parts_lse = torch.full((nd * slots, kvh, g), float("-inf"), device=q.device)
    for batch, out, lse in _decode_batches(qg, k_cache, v_cache, meta, scale):
        flat = (batch.rows * slots + batch.parts).flatten()
        parts_out.index_copy_(0, flat, out.flatten(0, 1))
        parts_lse.index_copy_(0, flat, lse.flatten(0, 1))
    parts_out, parts_lse = parts_out.view(nd, slots, kvh, g, dim), parts_lse.view(nd, slots, kvh, g)
    weights = parts_lse[:, :-1].softmax(dim=1).to(q.dtype)[..., None]  # [nd, parts, kvh, g, 1]
    return (weights * parts_out[:, :-1]).sum(dim=1).reshape(nd, heads, dim)


def _in_place_kernel(tiles: bool = False) -> PagedDecode:
    kernel = paged_decode_tiles_kernel() if tiles else paged_decode_kernel()
    assert kernel is not None, "in-place decode metadata is only built where the kernel is available"
    return kernel


def _decode_batches(
    qg: torch.Tensor,  # [num_decodes, kvh, g, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> Iterator[tuple[DecodeBatch, torch.Tensor, torch.Tensor | None]]:
    """Each decode batch with its partial results: out [p, r, kvh, g, D], and lse [p, r, kvh, g]
    when rows have more than one part to merge (else None)."""
    nd, kvh, g, dim = qg.shape
    with_lse = meta.num_decode_parts > 1
    for batch in meta.decode_batches:
        p, r = batch.rows.shape
        k_buf, v_buf = meta.decode_gather_buffer[:, : batch.block_tables.numel()]
        k = gather(k_cache, True, batch.block_tables, out=k_buf)  # [p, S, kvh, D]
        v = gather(v_cache, False, batch.block_tables, out=v_buf)
        queries = qg.index_select(0, batch.rows.flatten()).view(p, r, kvh, g, dim)
        out, lse = grouped_query_attention(queries, k, v, batch.mask.view(p, 1, -1), scale, with_lse)
        yield batch, out, lse


def grouped_query_attention(
    q: torch.Tensor,  # [p, r, kvh, g, D]: r query rows per problem, g query heads per KV head
    k: torch.Tensor,  # [p, S, kvh, D] contiguous (as gathered from the pool)
    v: torch.Tensor,  # [p, S, kvh, D] contiguous
    mask: torch.Tensor,  # [p, 1, S] additive float32: 0 visible, -inf not
    scale: float,
    with_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # out [p, r, kvh, g, D] in q's dtype, lse [p, r, kvh, g] float32
    """Each problem's queries over its keys as two batched GEMMs, for decode rows (a few
    queries per KV head, where the flash kernel's query blocking costs several times more).

    GQA without a per-head copy of K/V: every query row is block-diagonal, its vector in its KV
    head's slot of a ``kvh * D`` row and zeros elsewhere, so one GEMM against the keys as laid
    out in the pool (``[S, kvh * D]``) scores every head; the output's diagonal blocks are the
    heads' results. The zeros cost ``kvh`` times the FLOPs of these small GEMMs and save a
    transposing copy of every gathered block. Numerics are HF eager's: GEMMs in the model's
    dtype (float32 accumulation), softmax in float32.
    """
    p, r, kvh, g, d = q.shape
    keys = k.shape[1]
    eye = torch.eye(kvh, dtype=q.dtype, device=q.device)[:, None, :, None]  # [kvh, 1, kvh', 1]
    q_block = (q[:, :, :, :, None, :] * eye).reshape(p, r * kvh * g, kvh * d)
    scores = torch.bmm(q_block, k.view(p, keys, kvh * d).transpose(1, 2)).float().mul_(scale).add_(mask)
    if with_lse:  # one exp for both the probabilities and the log-sum-exp
        top = scores.amax(dim=-1, keepdim=True)
        weights = scores.sub_(top).exp_()
        total = weights.sum(dim=-1, keepdim=True)
        probs = weights.div_(total).to(q.dtype)
        lse = (top + total.log()).view(p, r, kvh, g)
    else:
        probs, lse = torch.softmax(scores, dim=-1).to(q.dtype), None  # [p, r * kvh * g, S]
    out = torch.bmm(probs, v.view(p, keys, kvh * d)).view(p, r, kvh, g, kvh, d)
    out = torch.diagonal(out, dim1=2, dim2=4).permute(0, 1, 4, 2, 3)  # [p, r, kvh, g, D]
    return out, lse
