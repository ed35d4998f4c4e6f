"""A tiny random-weight model and a dense, cache-free reference forward for engine tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.model.llama import LlamaModel
from shared.model.model_config import ModelConfig, tiny_config


def tiny_model(seed: int = 0, **overrides) -> LlamaModel:
    """Random weights; norms perturbed so they matter; fp32, eval mode."""
    torch.manual_seed(seed)
    model = LlamaModel(tiny_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if "bias" in name:
                p.normal_(0, 0.1)
    return model.eval()


@torch.inference_mode()
def dense_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    """Plain causal attention over the whole sequence: no KV cache, no paging, no chunks."""
    cfg: ModelConfig = model.config
    x = model.embed_tokens(torch.tensor(ids))
    positions = torch.arange(len(ids))
    for layer in model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = attn.qkv_proj(h).split(attn.split, dim=-1)
        q = model.rotary(q.view(-1, cfg.num_heads, cfg.head_dim), positions).transpose(0, 1)
        k = model.rotary(k.view(-1, cfg.num_kv_heads, cfg.head_dim), positions).transpose(0, 1)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + attn.o_proj(o.transpose(0, 1).flatten(1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.logits(model.norm(x))


def greedy_reference(model: LlamaModel, prompt: list[int], max_tokens: int) -> list[int]:
    """Batch-1 greedy generation by recomputing the whole sequence every token."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(dense_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]
