"""Each row's next token on the CPU (``csrc/sample_cpu.cpp``, built with the other CPU kernels by
``kernels.cpu_extension``): a greedy row (temperature 0) takes its first largest value, a
sampled row draws from ``softmax(x / temperature)`` by inverse CDF with its uniform ``u``: the
first token whose running sum of probabilities exceeds ``u`` of their total.

``sample_rows`` runs the kernel, or ``sample_rows_reference`` (plain torch, the same contract)
wherever the extension is not built or the tensor is not on the CPU. The two can differ only on
tokens less likely than e^-87 times the top one (weight 0 in the kernel, never drawn) and where
``u`` falls within rounding of a boundary between two tokens.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import cpu_kernels


def sample_rows(x: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """x [rows, n] (float32, bfloat16 or float16; no NaN, -inf for a masked token), temperatures
    [rows] float32 (0: greedy, else positive with a finite inverse), uniforms [rows] float32 in
    [0, 1) -> [rows] int64 tokens. A row without a finite value gives token 0."""
    module = cpu_kernels() if x.is_cpu else None
    if module is None or x.shape[1] == 0:
        return sample_rows_reference(x, temperatures, uniforms)
    return module.sample_rows(x, temperatures, uniforms)


def sample_rows_reference(x: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """``sample_rows`` in plain torch."""
    # NOTE: max's indices, not argmax: on a CPU argmax over bf16 is a scalar loop
    tokens = x.max(dim=-1).indices
    sampled = (temperatures > 0).nonzero().squeeze(1).to(x.device)
    if len(sampled):
        scores = x.index_select(0, sampled).float() / temperatures.to(x.device)[sampled, None]
        drawn = _inverse_cdf_draw(scores.softmax(-1), uniforms.to(x.device)[sampled])
        tokens[sampled] = torch.where(torch.isfinite(scores).any(-1), drawn, 0)  # no finite value: token 0
    return tokens


def _inverse_cdf_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # [rows] int64
    """Each row's token: the first whose cumulative probability exceeds ``u`` of the row's total.
    A token of probability 0 is never chosen: its cumulative sum equals its predecessor's."""
    cdf = probs.cumsum(-1)
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
    # NOTE: u * total can round up to the total: then the last token with probability is meant
    impossible = probs.gather(1, picks[:, None]).squeeze(1) == 0
    if bool(impossible.any()):
        last_live = probs.shape[1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
        picks = torch.where(impossible, last_live, picks)
    return picks
