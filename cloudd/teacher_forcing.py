"""Teacher forcing: a model's next-token log-probabilities at every position of a given
continuation, all from one forward over prompt + continuation (nothing it predicts is fed back).

``cloudd.llamacpp_agreement`` reads each position's top-2 and margins off these rows to compare
them with llama.cpp's; ``cloudd.dtype_agreement`` their top-1 against a float32 reference.
"""

from __future__ import annotations

import torch

from kernels.dense_attention import DenseAttentionStep
from shared.model.llama import LlamaModel


@torch.inference_mode()
def teacher_forced_logprobs(model: LlamaModel, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """``[len(continuation), vocab]`` float32 log-softmax: row ``i`` is the model's distribution
    for ``continuation[i]`` having read ``prompt + continuation[:i]``. One forward on a dense KV
    buffer the model's dtype; the logits are taken in float32. ValueError on an empty prompt or
    continuation (there would be no row to predict from, or none to return)."""
    if not prompt or not continuation:
        raise ValueError(f"need a prompt and a continuation, got {len(prompt)} and {len(continuation)} tokens")
    ids = prompt + continuation[:-1]  # the last token predicts nothing asked for
    cfg = model.config
    dtype = model.embed_tokens.weight.dtype
    caches = [(torch.zeros(len(ids), cfg.num_kv_heads, cfg.head_dim, dtype=dtype),
               torch.zeros(len(ids), cfg.num_kv_heads, cfg.head_dim, dtype=dtype)) for _ in range(cfg.num_layers)]
    positions = torch.arange(len(ids))
    hidden = model(torch.tensor(ids), positions, caches, DenseAttentionStep(positions, end=len(ids)))
    # | prompt[:-1] | prompt[-1] -> continuation[0] | continuation[:-1] -> continuation[1:] |
    return torch.log_softmax(model.logits(hidden[len(prompt) - 1 :]), dim=-1)  # [len(continuation), vocab]
