"""The Llama-family transformer in plain torch, over a paged KV pool.

Covers Llama 2/3 (llama3 RoPE scaling), SmolLM2, Qwen2/2.5 (q/k/v bias) and Mistral: RMSNorm,
rotary embeddings (rotate-half form, as HF checkpoints store Q/K), grouped-query attention,
SwiGLU MLP, optionally tied embeddings. Q/K/V and gate/up projections are fused at load time so
a layer is a handful of large matmuls. The layer math itself (RMSNorm, rotary, SwiGLU, the dense
halves around attention) is ``kernels.layer_math``, which the device kernels reproduce.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from kernels.layer_math import LayerFunctions, RopeTables, apply_rotary, rms_norm
from shared.model.lazy_weights import tensor_source
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
        rope: RopeTables | None = None,  # given: q and k are not rotated yet; rotate them first
    ) -> torch.Tensor:  # [T, heads, head_dim]
        """Write this step's ``k``/``v`` into ``kv_cache`` and attend ``q`` over its context.
        With ``rope``, q and k come unrotated (layer functions with ``rotary_in_attention``) and
        the step rotates them, a GPU step in the same kernel as its KV write."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


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


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # NOTE: the modules: a packed one holds no dense weight
        return self.down_proj(nn.functional.silu(gate) * up)


EAGER = LayerFunctions()
# Forwards with fewer tokens run eager even when the layers are compiled: measured on a 2-core
# EPYC (bf16, SmolLM2-135M), compiled dense halves cost ~1 ms more per forward at 1-16 tokens
# (30 layers of guard checks) and save ~6 ms at 256 tokens, ~50 ms at 2048.
COMPILED_MIN_TOKENS = 64


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: RopeTables, kv_cache: KVCache, step: AttentionStep,
                fns: LayerFunctions = EAGER) -> torch.Tensor:
        attn, mlp = self.self_attn, self.mlp
        q, k, v = fns.attention_inputs(x, self.input_layernorm.weight, self.input_layernorm.eps, attn.qkv_proj.weight,
                                       attn.qkv_proj.bias, *rope, attn.num_heads, attn.num_kv_heads)
        # NOTE: contiguous: a compiled half is specialized to its inputs' strides
        attended = step.attend(attn.layer, q, k, v, kv_cache, attn.scale,
                               rope if fns.rotary_in_attention else None).contiguous()
        return fns.attention_outputs(x, attended, attn.o_proj.weight, self.post_attention_layernorm.weight,
                                     self.post_attention_layernorm.eps, mlp.gate_up_proj.weight, mlp.down_proj.weight)


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
        # the GGUF file the weights were read from (shared.model.weight_cache), else None: small
        # steps may multiply by its K-quant codes (shared.model.kquant_projections)
        self.gguf_source: Path | None = None
        # shared.model.weight_cache.MappedWeights where the parameters view a converted-weights
        # file's pages (so a weight replaced by another form can give its pages back)
        self.mapped_weights = None
        self.eager_functions = EAGER  # what forwards of fewer than compiled_min_tokens tokens run
        self.layer_functions = EAGER  # compile_layers() swaps in compiled ones
        self.compiled_min_tokens = 0
        # forwards of at most small_step_max_tokens tokens run these where set (the layers'
        # products on their GGUF's K-quant codes: kernels.tile_quant_linear)
        self.small_step_functions: LayerFunctions | None = None
        self.small_step_max_tokens = 0
        self.small_step_head: Callable[[torch.Tensor], torch.Tensor] | None = None  # their logits, where set

    def use_small_step_functions(self, functions: LayerFunctions | None, max_tokens: int = 0,
                                 head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Run ``functions`` in forwards of at most ``max_tokens`` tokens (None: as any other),
        and ``head`` (hidden [rows, hidden] -> logits [rows, vocab] in the model's dtype) for the
        logits of at most that many rows where given."""
        self.small_step_functions = functions
        self.small_step_max_tokens = max_tokens if functions is not None else 0
        self.small_step_head = head if functions is not None else None

    def small_step_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits of ``hidden``'s rows [rows, vocab] in the model's dtype from the small
        steps' head, or None where it does not take them (no such head, or too many rows)."""
        if self.small_step_head is None or len(hidden) > self.small_step_max_tokens:
            return None
        return self.small_step_head(hidden)

    def use_layer_functions(self, functions: LayerFunctions) -> None:
        """Run ``functions`` in every forward (uncompiled; ``compile_layers`` compiles them)."""
        self.eager_functions = self.layer_functions = functions
        self.compiled_min_tokens = 0

    def compile_layers(self, min_tokens: int = COMPILED_MIN_TOKENS) -> float:
        """Run every layer's dense halves through ``torch.compile`` (inductor, the token dimension
        dynamic) in forwards of at least ``min_tokens`` tokens: RMSNorm, rotary, SwiGLU and
        the residual adds become a few fused kernels around the projections' GEMMs. Smaller
        forwards stay eager: there the compiled call's guards cost more than its fusions save.
        Compiles now, on ``min_tokens`` dummy tokens, and returns the seconds it took; later
        forwards of any size reuse that code (never a recompile). If compiling fails (no C++
        compiler for inductor, say), the layers stay eager and the error is raised."""
        if min_tokens < 2:
            raise ValueError(f"min_tokens must be >= 2 (one token specializes the compiled shapes), got {min_tokens}")
        started = time.perf_counter()
        eager = self.eager_functions
        self.layer_functions = LayerFunctions(
            attention_inputs=torch.compile(eager.attention_inputs),
            attention_outputs=torch.compile(eager.attention_outputs),
        )
        self.compiled_min_tokens = min_tokens
        try:
            self._compile_now(min_tokens)
        except Exception:
            self.layer_functions, self.compiled_min_tokens = eager, 0
            raise
        return time.perf_counter() - started

    def _compile_now(self, min_tokens: int) -> None:
        """Run both compiled halves once on dummy inputs whose token dimension is marked dynamic."""
        layer, weight = self.layers[0], self.embed_tokens.weight
        with torch.inference_mode():
            x = torch.zeros(min_tokens, self.config.hidden_size, dtype=weight.dtype, device=weight.device)
            cos, sin = self.rotary.tables(torch.arange(min_tokens, device=weight.device), weight.dtype)
            attended = torch.zeros(min_tokens, self.config.num_heads, self.config.head_dim, dtype=weight.dtype,
                                   device=weight.device)
            # NOTE: only the token dimension is dynamic: the weights' shapes stay constants the
            # kernels are specialized for, and a token count equal to some weight dimension
            # is never taken for a relation between them
            for t in (x, cos, sin, attended):
                torch._dynamo.mark_dynamic(t, 0)
            self.layer_functions.attention_inputs(
                x, layer.input_layernorm.weight, layer.input_layernorm.eps, layer.self_attn.qkv_proj.weight,
                layer.self_attn.qkv_proj.bias, cos, sin, layer.self_attn.num_heads, layer.self_attn.num_kv_heads)
            self.layer_functions.attention_outputs(
                x, attended, layer.self_attn.o_proj.weight, layer.post_attention_layernorm.weight,
                layer.post_attention_layernorm.eps, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight)

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
        tokens = len(input_ids)
        if tokens <= self.small_step_max_tokens:
            fns = self.small_step_functions
        else:
            fns = self.layer_functions if tokens >= self.compiled_min_tokens else self.eager_functions
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, kv_cache, step, fns)
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in ``dtype`` (None: the model's own, saving a copy the size
        of the logits when the caller converts only some rows)."""
        scores = self.small_step_logits(hidden)
        if scores is None:
            scores = self.lm_head(hidden)
        return scores if dtype is None else scores.to(dtype)

    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named weights in, each read once straight into its rows of this model's
        parameter (q/k/v and gate/up stacked), converted to the parameter's dtype: no fused or
        float32 copy of a whole model is made. Raises KeyError naming a missing weight,
        ValueError naming one whose shape does not fit."""
        own = self.state_dict()
        sources = parameter_sources(self.config)
        assert set(sources) | ({"lm_head.weight"} if self.config.tie_word_embeddings else set()) == set(own)
        for name, hf_names in sources.items():
            target, row = own[name], 0
            for hf_name in hf_names:  # | q rows | k rows | v rows |, | gate rows | up rows |
                source = tensor_source(weights, hf_name)
                rows = target[row : row + source.shape[0]]
                if tuple(rows.shape) != source.shape:
                    raise ValueError(f"{hf_name} {list(source.shape)} does not fit rows {row}.. of {name} "
                                     f"{list(target.shape)}")
                source.read_into(rows)
                row += source.shape[0]
            if row != len(target):
                raise ValueError(f"{name}: its HF weights {hf_names} fill {row} of its {len(target)} rows")


def projection_sources(config: ModelConfig) -> dict[str, list[str]]:
    """This model's linear layers (module names) -> the HF weights each multiplies by, stacked
    along its output rows (q/k/v and gate/up fused). A tied LM head multiplies by the embeddings."""
    sources = {"lm_head": ["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]}
    for i in range(config.num_layers):
        hf, own = f"model.layers.{i}.", f"layers.{i}."
        sources[own + "self_attn.qkv_proj"] = [f"{hf}self_attn.{p}_proj.weight" for p in "qkv"]
        sources[own + "self_attn.o_proj"] = [hf + "self_attn.o_proj.weight"]
        sources[own + "mlp.gate_up_proj"] = [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
        sources[own + "mlp.down_proj"] = [hf + "mlp.down_proj.weight"]
    return sources


def parameter_sources(config: ModelConfig) -> dict[str, list[str]]:
    """Every parameter of this model -> the HF weights stacked along its rows to make it. A tied
    LM head is left out: it is the embeddings' parameter."""
    sources = {"embed_tokens.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    for module, hf_names in projection_sources(config).items():
        if not (module == "lm_head" and config.tie_word_embeddings):
            sources[module + ".weight"] = hf_names
    for i in range(config.num_layers):
        hf, own = f"model.layers.{i}.", f"layers.{i}."
        if config.attention_bias:
            sources[own + "self_attn.qkv_proj.bias"] = [f"{hf}self_attn.{p}_proj.bias" for p in "qkv"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sources[f"{own}{norm}.weight"] = [f"{hf}{norm}.weight"]
    return sources


def meta_model(config: ModelConfig, dtype: torch.dtype) -> LlamaModel:
    """The model's structure in ``dtype`` on the meta device: its parameters' names, shapes and
    dtype, and no memory."""
    with torch.device("meta"):
        return LlamaModel(config).to(dtype)


def build_model(
    config: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> LlamaModel:
    """A ready-to-run model in eval mode on the CPU, its parameters in ``dtype`` holding the
    given HF-named weights (``load_hf_weights``: each read once, straight into ``dtype``)."""
    model = meta_model(config, dtype).to_empty(device="cpu")
    model.load_hf_weights(weights)
    return finish_model(model)


def finish_model(model: LlamaModel) -> LlamaModel:
    """``model`` (its parameters on the CPU, in one dtype) with its rotary tables computed in that
    dtype, its LM head tied to the embeddings when the config says so, in eval mode."""
    model.rotary = RotaryEmbedding(model.config).to(model.embed_tokens.weight.dtype)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()
