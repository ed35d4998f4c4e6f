"""The Llama-family transformer in plain torch, over a paged KV pool.

Covers Llama 2/3 (llama3 RoPE scaling), SmolLM2, Qwen2/2.5 (q/k/v bias) and Mistral: RMSNorm,
rotary embeddings (rotate-half form, as HF checkpoints store Q/K), grouped-query attention,
SwiGLU MLP, optionally tied embeddings. Q/K/V and gate/up projections are fused at load time so
a layer is a handful of large matmuls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from typing import Protocol

from shared.model.model_config import ModelConfig, RopeScaling

# One layer's (K, V) cache, in whatever layout the step's AttentionStep reads: the engine's
# paged pools [num_blocks, block_size, kv_heads, head_dim], or edged's dense [max_len, kv_heads, head_dim].
KVCache = tuple[torch.Tensor, torch.Tensor]


class AttentionStep(Protocol):
    """How one forward pass stores and reads K/V, built once per step and shared by every layer:
    ``kernels.attention.PagedAttentionStep`` (the engine's paged pool, many sequences) or
    ``kernels.dense_attention.DenseAttentionStep`` (edged's batch-1 buffer)."""

    def attend(
        self,
        layer: int,  # the layer's index (a paged step may wait for a layer's KV to land)
        q: torch.Tensor,  # [T, heads, head_dim], rotary applied
        k: torch.Tensor,  # [T, kv_heads, head_dim], rotary applied
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        kv_cache: KVCache,
        scale: float,
    ) -> torch.Tensor:  # [T, heads, head_dim]
        """Write this step's ``k``/``v`` into ``kv_cache`` and attend ``q`` over its context."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:  # [head_dim // 2] float32
    """Rotary inverse frequencies, with llama3 scaling when the checkpoint asks for it."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq.float()


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, head_dim // 2] in the model's dtype


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_position_embeddings."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(config))  # [max_pos, head_dim // 2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos/sin at ``positions`` [T], looked up once per forward and shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, heads, head_dim]; rotate-half form."""
        return apply_rotary(x, self.tables(positions, x.dtype))


def apply_rotary(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """x: [T, heads, head_dim] rotated in rotate-half form (as HF checkpoints store Q/K)."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.split), bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: RopeTables,
        kv_cache: KVCache,
        step: AttentionStep,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size, _ = self.split
        # q and k sit side by side in qkv's rows: one rotation for both
        qk = apply_rotary(qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim), rope)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = step.attend(self.layer, q, k, v, kv_cache, self.scale)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, kv_cache, step):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, step)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Contract: ``forward`` writes this step's K/V into ``kv_caches`` (where ``step`` says)
    and returns final hidden states; ``logits`` maps chosen rows to vocabulary scores."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],  # one (K, V) pair per layer
        step: AttentionStep,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, kv_cache, step)
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        return self.lm_head(hidden).float()

    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up. Raises KeyError naming a missing one."""
        own = self.state_dict()
        for name, tensor in _fuse_hf_weights(weights, self.config).items():
            if name not in own:
                raise KeyError(f"unexpected weight {name!r} for {self.config.arch}")
            own[name].copy_(tensor)


def _fuse_hf_weights(weights: Mapping[str, torch.Tensor], config: ModelConfig):
    """HF parameter names -> this module's names (q/k/v and gate/up concatenated)."""
    fused: dict[str, torch.Tensor] = {
        "embed_tokens.weight": weights["model.embed_tokens.weight"],
        "norm.weight": weights["model.norm.weight"],
    }
    if not config.tie_word_embeddings:
        fused["lm_head.weight"] = weights["lm_head.weight"]
    for i in range(config.num_layers):
        hf, own = f"model.layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        fused[own + "self_attn.qkv_proj.weight"] = torch.cat(
            [weights[f"{attn}{p}_proj.weight"] for p in "qkv"]
        )
        if config.attention_bias:
            fused[own + "self_attn.qkv_proj.bias"] = torch.cat(
                [weights[f"{attn}{p}_proj.bias"] for p in "qkv"]
            )
        fused[own + "self_attn.o_proj.weight"] = weights[attn + "o_proj.weight"]
        fused[own + "mlp.gate_up_proj.weight"] = torch.cat(
            [weights[hf + "mlp.gate_proj.weight"], weights[hf + "mlp.up_proj.weight"]]
        )
        fused[own + "mlp.down_proj.weight"] = weights[hf + "mlp.down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            fused[f"{own}{norm}.weight"] = weights[f"{hf}{norm}.weight"]
    return fused


def build_model(
    config: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> LlamaModel:
    """A ready-to-run model in eval mode with the given HF-named weights."""
    with torch.device("meta"):
        model = LlamaModel(config)
    model = model.to_empty(device="cpu")
    model.rotary = RotaryEmbedding(config)  # buffers are computed, not loaded
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_hf_weights(weights)
    return model.to(dtype).eval()
