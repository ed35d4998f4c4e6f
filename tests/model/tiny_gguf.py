"""A tiny random GGUF (gguf's own writer) with the quant types of the Qwen2.5-Coder files: Q4_K,
Q6_K, Q5_0, Q8_0 and F32. Qwen2 arch by default: q/k/v biases and its own `output.weight`;
a small byte-level BPE tokenizer and a chat template in the metadata.

The gguf package quantizes no K-quant, but a block of random bytes is a valid block as long as
its fp16 scales are finite: the blocks are random bytes with small random scales written over.
"""

from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
from tokenizers import pre_tokenizers

Q = gguf.GGMLQuantizationType
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, CONTEXT = 256, 512, 2, 4, 2, 256  # K-quant rows need 256 columns
HEAD_DIM = HIDDEN // HEADS
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
# each block's fp16 scales: byte offsets in the block, and the range of their random values
SCALES = {Q.Q4_K: ((0, 2), 1e-3), Q.Q6_K: ((208,), 1e-3), Q.Q5_0: ((0,), 1e-2), Q.Q8_0: ((0,), 4e-3)}
# llama.cpp names (`blk.{i}.` left out) -> quant type; every type in several places
LAYER_KINDS = {
    "attn_norm.weight": Q.F32, "ffn_norm.weight": Q.F32,
    "attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q5_0, "attn_v.weight": Q.Q6_K, "attn_output.weight": Q.Q8_0,
    "attn_q.bias": Q.F32, "attn_k.bias": Q.F32, "attn_v.bias": Q.F32,
    "ffn_gate.weight": Q.Q4_K, "ffn_up.weight": Q.Q5_0, "ffn_down.weight": Q.Q6_K,
}
GLOBAL_KINDS = {"token_embd.weight": Q.Q8_0, "output_norm.weight": Q.F32, "output.weight": Q.Q6_K}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "Ġ t"]


def vocabulary() -> list[str]:
    """The byte alphabet, one token per merge, then the control tokens."""
    return sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES] + SPECIAL


def shapes(arch: str, tied: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor's llama.cpp name -> its torch-order shape ([rows, cols] or [cols])."""
    vocab, kv = len(vocabulary()), KV_HEADS * HEAD_DIM
    layer = {"attn_norm.weight": (HIDDEN,), "ffn_norm.weight": (HIDDEN,), "attn_q.weight": (HIDDEN, HIDDEN),
             "attn_k.weight": (kv, HIDDEN), "attn_v.weight": (kv, HIDDEN), "attn_output.weight": (HIDDEN, HIDDEN),
             "ffn_gate.weight": (FFN, HIDDEN), "ffn_up.weight": (FFN, HIDDEN), "ffn_down.weight": (HIDDEN, FFN)}
    if arch == "qwen2":
        layer |= {"attn_q.bias": (HIDDEN,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    result = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,)}
    if not tied:
        result["output.weight"] = (vocab, HIDDEN)
    for i in range(LAYERS):
        result |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    return result


def kind_of(name: str, layer_kinds: Mapping[str, gguf.GGMLQuantizationType] = LAYER_KINDS) -> gguf.GGMLQuantizationType:
    return GLOBAL_KINDS[name] if name in GLOBAL_KINDS else layer_kinds[name.split(".", 2)[2]]


def random_blocks(kind: gguf.GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] uint8: random blocks of ``kind`` with finite scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    offsets, bound = SCALES[kind]
    for offset in offsets:
        scales = rng.uniform(-bound, bound, len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(path: Path, arch: str = "qwen2", tied: bool = False, seed: int = 0,
                    layer_kinds: Mapping[str, gguf.GGMLQuantizationType] = LAYER_KINDS) -> Path:
    """A 2-layer ``arch`` ("qwen2" or "llama": no biases, q/k rows as llama.cpp permutes them)
    GGUF at ``path`` with random weights; ``tied``: no `output.weight`; ``layer_kinds``: each
    layer tensor's type (default ``LAYER_KINDS``)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    tokens = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_merges(MERGES)
    writer.add_token_types([3 if t in SPECIAL else 1 for t in tokens])  # 3: control
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    for name, shape in shapes(arch, tied).items():
        kind = kind_of(name, layer_kinds)
        if kind == Q.F32:
            center = 1.0 if "norm" in name else 0.0  # norms near 1, biases near 0
            writer.add_tensor(name, (center + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            writer.add_tensor(name, random_blocks(kind, shape[0], shape[1], rng), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
