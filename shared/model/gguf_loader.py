"""Load a llama.cpp GGUF file: config from metadata, lazily dequantized weights under HF names, tokenizer.

Supported: general.architecture "llama" / "qwen2"; tokenizer.ggml.model "gpt2" (byte-level BPE)
and "llama" (sentencepiece-style BPE with byte fallback).
"""

import mmap
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import tokenizers
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from shared.model.checkpoint import Checkpoint
from shared.model.lazy_weights import LazyWeights, TensorSource
from shared.model.model_config import ModelConfig
from shared.model.tokenizer import Tokenizer

# llama.cpp tensor name (without `blk.{i}.`) -> HF module name (without `model.layers.{i}.`)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_SUPPORTED_ARCHS = ("llama", "qwen2")


def load_gguf(path: Path) -> Checkpoint:
    """A GGUF file's config and tokenizer, its weights read lazily (dequantized to float32 when
    accessed, one tensor at a time). ValueError for unsupported files."""
    metadata, tensors = read_gguf(path)
    config = read_config(metadata, {t.name for t in tensors})
    sources = {}
    for tensor in tensors:
        name = hf_tensor_name(tensor.name)
        sources[name] = TensorSource(tensor.shape, partial(dequantize_into, tensor, name, config))
    return Checkpoint(config=config, weights=LazyWeights(sources), tokenizer=build_tokenizer(metadata), source=path)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, not yet dequantized."""

    name: str
    kind: gguf.GGMLQuantizationType
    data: np.ndarray  # [*rows, bytes_per_row] uint8, a view of the memory-mapped file
    mapping: mmap.mmap  # the whole file, which `data` views
    offset: int  # where `data` starts in `mapping`

    @property
    def shape(self) -> tuple[int, ...]:
        """The dequantized tensor's shape, torch order: [*rows, cols]."""
        block_size, type_size = gguf.GGML_QUANT_SIZES[self.kind]
        return (*self.data.shape[:-1], self.data.shape[-1] // type_size * block_size)

    def release(self) -> None:
        """Take this tensor's pages out of the process's resident memory (they stay in the page
        cache, and `data` stays valid: a later read faults them in again)."""
        start = self.offset // mmap.PAGESIZE * mmap.PAGESIZE
        self.mapping.madvise(mmap.MADV_DONTNEED, start, self.offset + self.data.nbytes - start)


# Float32 values dequantized per chunk: gguf's numpy dequantizers make a few temporaries the
# size of their input, so a whole 150k x 1536 embedding would cost GBs of them.
_CHUNK_VALUES = 1 << 22


def dequantize_into(tensor: GGUFTensor, name: str, config: ModelConfig, out: torch.Tensor) -> None:
    """Dequantize `tensor` (HF name `name`) into `out` [*tensor.shape] (contiguous, any float
    dtype), q/k rows un-permuted, a chunk of rows at a time; then drop the tensor's file pages
    from this process's resident memory."""
    data = tensor.data.reshape(-1, tensor.data.shape[-1])  # [rows, bytes_per_row]
    rows_out = out.view(-1, out.shape[-1])  # [rows, cols]
    # NOTE: whole heads per chunk (a multiple of head_dim rows): unpermute_rope works per head
    step = max(1, _CHUNK_VALUES // out.shape[-1] // config.head_dim) * config.head_dim
    for start in range(0, len(data), step):
        array = gguf.quants.dequantize(data[start:start + step], tensor.kind)  # [chunk rows, cols]
        if not array.flags.writeable:  # an F32 view straight into the read-only mapping
            array = array.copy()
        chunk = torch.from_numpy(array).view(-1, *out.shape[1:])  # [chunk rows, cols]; a 1-D tensor's: [cols]
        rows_out[start:start + len(array)].copy_(unpermute_rope(chunk, name, config).view(len(array), -1))
    tensor.release()


# GGUF value types (gguf.GGUFValueType) with a fixed width -> struct format / numpy dtype
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAGIC, _DEFAULT_ALIGNMENT = b"GGUF", 32


def read_gguf(path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """Metadata (key -> Python value; arrays as lists) and tensors of a little-endian GGUF v2/v3 file.

    NOTE: gguf.GGUFReader parses every array element through a numpy memmap view, which costs
    ~8 s for a 49k-token vocabulary; this reads the same format with struct in ~0.2 s.
    """
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buf)
    if buf[:4] != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
    cursor.pos = 4
    version, tensor_count, kv_count = cursor.scalar("<I"), cursor.scalar("<Q"), cursor.scalar("<Q")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (expected 2 or 3, little-endian)")
    metadata = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("<I"))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
        infos.append((name, dims, gguf.GGMLQuantizationType(cursor.scalar("<I")), cursor.scalar("<Q")))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_start = -(-cursor.pos // alignment) * alignment
    return metadata, [_tensor(buf, data_start, *info) for info in infos]


def _tensor(buf: mmap.mmap, data_start: int, name: str, dims: list[int],
            kind: gguf.GGMLQuantizationType, offset: int) -> GGUFTensor:
    # dims is GGUF `ne` order (fastest first); numpy/torch order is the reverse.
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    row_bytes = dims[0] // block_size * type_size
    rows = list(reversed(dims[1:]))
    start = data_start + offset
    data = np.frombuffer(buf, np.uint8, row_bytes * int(np.prod(rows, dtype=np.int64)), start).reshape(*rows, row_bytes)
    return GGUFTensor(name=name, kind=kind, data=data, mapping=buf, offset=start)


class _Cursor:
    """Sequential reader over the GGUF header."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("<Q")
        self.pos += size
        return self.buf[self.pos - size:self.pos].decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.scalar(_SCALARS[kind])
        item_kind, count = self.scalar("<I"), self.scalar("<Q")
        if item_kind in (_STRING, _ARRAY):
            return [self.value(item_kind) for _ in range(count)]
        dtype = np.dtype(_SCALARS[item_kind])
        items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
        self.pos += dtype.itemsize * count
        return items


def read_config(metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; tied embeddings iff `output.weight` is absent."""
    arch = metadata.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(f"general.architecture {arch!r} is not supported (expected one of {_SUPPORTED_ARCHS})")
    if "rope_freqs.weight" in tensor_names or metadata.get(f"{arch}.rope.scaling.type", "none") != "none":
        raise ValueError(f"{arch}.rope.scaling / rope_freqs: scaled RoPE in GGUF files is not supported yet")

    def key(suffix: str) -> Any:
        name = f"{arch}.{suffix}"
        if name not in metadata:
            raise ValueError(f"{name}: missing from the GGUF metadata")
        return metadata[name]

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    return ModelConfig(
        arch=arch,
        vocab_size=int(metadata.get(f"{arch}.vocab_size") or len(metadata["tokenizer.ggml.tokens"])),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(metadata.get(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
    )


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; ValueError if unknown."""
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match[2] in _LAYER_NAMES:
        return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF name")


def unpermute_rope(weight: torch.Tensor, name: str, config: ModelConfig) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows for llama-arch files; other tensors pass through.

    convert_hf_to_gguf.py permutes each head's rows from HF's rotate-half order
    [x0..x(d/2-1), x(d/2)..x(d-1)] to interleaved pairs [x0, x(d/2), x1, x(d/2+1), ...]:
    per head, rows are viewed as [2, d/2] and transposed to [d/2, 2]. Here the reverse.
    Qwen2 files are written unpermuted. `weight` may be any run of whole heads' rows.
    """
    if config.arch != "llama" or not (".q_proj." in name or ".k_proj." in name):
        return weight
    rest = weight.shape[1:]
    # weight: [heads * head_dim, ...] -> [heads, head_dim/2, 2, ...] -> [heads, 2, head_dim/2, ...]
    per_head = weight.reshape(-1, config.head_dim // 2, 2, *rest)
    return per_head.transpose(1, 2).reshape(weight.shape).contiguous()


# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4
# tokenizer.ggml.pre -> the split regex the vocabulary's merges were learned with. Unlisted values
# get GPT-2's regex (ByteLevel's own), as transformers does.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """The Tokenizer a GGUF's `tokenizer.*` metadata describes; ValueError for unsupported kinds.

    Control tokens (`<|im_start|>`) become special added tokens, so they encode to one id and
    `decode(skip_special_tokens=True)` drops them; user-defined ones become plain added tokens.
    """
    kind = metadata.get("tokenizer.ggml.model")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    if kind == "gpt2":
        backend = byte_level_backend(tokens, metadata["tokenizer.ggml.merges"], metadata.get("tokenizer.ggml.pre"))
    elif kind == "llama":
        backend = sentencepiece_backend(tokens, metadata["tokenizer.ggml.scores"], metadata.get("tokenizer.ggml.merges"),
                                        metadata.get("tokenizer.ggml.unknown_token_id"))
    else:
        raise ValueError(f"tokenizer.ggml.model {kind!r} is not supported (expected 'gpt2' or 'llama')")
    add_added_tokens(backend, tokens, metadata.get("tokenizer.ggml.token_type") or [], byte_level=kind == "gpt2")

    def token(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return None if token_id is None else tokens[token_id]

    bos = token("bos_token_id")
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    return Tokenizer(backend, metadata.get("tokenizer.chat_template"), bos, token("eos_token_id"))


def byte_level_backend(tokens: Sequence[str], merges: Sequence[str], pre: str | None) -> tokenizers.Tokenizer:
    """GPT-2-style byte-level BPE. Tokens are already spelled in the byte alphabet (`Ġ` for space)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                              fuse_unk=False, byte_fallback=False))
    if pre == "smollm":
        # NOTE: llama.cpp's "smollm" splits every digit off first, as SmolLM's own tokenizer.json does.
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in _PRE_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def sentencepiece_backend(tokens: Sequence[str], scores: Sequence[float], merges: Sequence[str] | None,
                          unk_id: int | None) -> tokenizers.Tokenizer:
    """Llama-2-style sentencepiece BPE: `▁` for space, a leading `▁`, `<0xNN>` byte fallback.

    Files without merges get them rebuilt from the vocabulary, best token score first.
    """
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else merges_from_scores(tokens, scores)
    unk = tokens[unk_id] if unk_id is not None else None
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk,
                                              fuse_unk=True, byte_fallback=True))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(content=" ", left=1, right=0)])
    return backend


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of a vocabulary token into two vocabulary tokens, ranked by the whole token's score."""
    vocab = set(tokens)
    ranked = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, len(ranked), left, right))
    return [(left, right) for _, _, left, right in sorted(ranked)]


def add_added_tokens(backend: tokenizers.Tokenizer, tokens: Sequence[str], token_types: Sequence[int],
                     byte_level: bool) -> None:
    """Register control tokens as special and user-defined ones as plain added tokens.

    In a byte-level vocabulary a control token with a character outside the byte alphabet is a
    llama.cpp mislabel; adding it would grow the vocabulary, so it is skipped (as transformers does).
    """
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if byte_level else None
    special = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, token_types)
               if kind == _CONTROL and (alphabet is None or set(t) <= alphabet)]
    backend.add_special_tokens(special)
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED])
