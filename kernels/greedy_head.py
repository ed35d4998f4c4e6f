"""The LM head and the greedy choice in one pass: each row's token of largest logit without the
[rows, vocab] logits ever reaching memory.

A step whose sampled rows are all greedy (no grammar, no logprobs, no drafts) needs only each
row's first largest logit. ``greedy_head`` runs the head over ``vocab_slice`` rows of its weight
at a time and takes each slice's maxima while the slice is still in cache (``sample_rows``'
greedy path); a slice's logits are bitwise those of the whole product (the same dot products),
and ties keep the earlier slice's token, so the tokens are exactly the first maxima of the full
logits (``greedy_head_reference``). On the CPU a 128 x 49,152 bf16 product is 12.6 MB that a
separate argmax would read back from memory (about 1 ms of a step's host work).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from kernels.sample_cpu import sample_rows, sample_rows_reference

# A slice's logits stay in cache until their maxima are read: at most this many bytes of them
# (256 rows x 4,096 bf16 logits), between MIN_ and MAX_VOCAB_SLICE vocabulary rows (4,096: the
# slice bf16 was measured with; 512: smaller GEMMs measured no faster). Measured on a 2-core AVX2
# EPYC in float32 (the head of a 49,152-token vocabulary, 256 rows): slices of 2,048 take 103 ms a
# call, of 4,096 (8 MB of logits) 115 ms; at 128 rows both take 62 ms.
SLICE_LOGITS_BYTES = 2 * 2**20
MAX_VOCAB_SLICE = 4096
MIN_VOCAB_SLICE = 512


def vocab_slice_for(rows: int, dtype: torch.dtype) -> int:
    """The vocabulary rows ``greedy_head`` takes at a time for ``rows`` hidden rows of ``dtype``."""
    fit = SLICE_LOGITS_BYTES // (max(rows, 1) * dtype.itemsize)
    return max(MIN_VOCAB_SLICE, min(MAX_VOCAB_SLICE, fit))


def greedy_head(hidden: torch.Tensor, weight: torch.Tensor, vocab_slice: int | None = None) -> torch.Tensor:
    """hidden [rows, d], the head's weight [vocab, d] -> [rows] int64: each row's first largest
    logit of ``hidden @ weight.T`` (finite logits). ``vocab_slice``: the weight rows a product
    takes at a time (default ``vocab_slice_for`` the rows and dtype)."""
    if vocab_slice is None:
        vocab_slice = vocab_slice_for(hidden.shape[0], hidden.dtype)
    return greedy_over_slices(hidden.shape[0], ((start, F.linear(hidden, weight[start : start + vocab_slice]))
                                                for start in range(0, weight.shape[0], vocab_slice)))


def greedy_over_slices(rows: int, slices: Iterable[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """[rows] int64: each row's first largest logit over the vocabulary that ``slices`` covers in
    order, each ``(first vocabulary row, its logits [rows, slice])``, taken one at a time while
    they are in cache (``kernels.onednn_linear.PackedHead`` makes them from packed slices)."""
    zeros = torch.zeros(rows, dtype=torch.float32)
    best_value = best_token = None
    for start, scores in slices:
        token = sample_rows(scores, zeros, zeros).to(scores.device)
        value = scores.gather(1, token[:, None]).squeeze(1)
        if best_value is None:
            best_value, best_token = value, token + start
            continue
        better = value > best_value  # NOTE: strictly: a tie keeps the earlier (smaller) token
        best_value = torch.where(better, value, best_value)
        best_token = torch.where(better, token + start, best_token)
    return best_token


def greedy_head_reference(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``greedy_head`` in plain torch: the whole logits, then each row's first maximum."""
    zeros = torch.zeros(hidden.shape[0], dtype=torch.float32)
    return sample_rows_reference(F.linear(hidden, weight), zeros, zeros)
