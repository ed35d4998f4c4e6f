"""A GGUF model's layer projections as their K-quant codes (``shared.model.kquant_codes``), for the
small steps' codes kernel (``kernels.tile_quant_linear``: AMX tiles or AVX-512 BF16 vectors): the same weights the dense model holds
(its bf16 weights are these codes dequantized, then rounded), a quarter to a half of their bytes.

A projection gets a form only where every part of it (q, k and v; gate and up) is Q4_K or Q6_K
and its shapes fit the tiles (rows a multiple of 16); the others keep their dense products. The
LM head (``lm_head``) is one of them where its GGUF tensor is: a small step's logits read a
quarter to a half of its bytes too.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from kernels.tile_quant_linear import TileQuantProjection, attach
from kernels.tile_quant_matmul_cpu import OUTPUTS_PER_TILE, GroupScales, TileQuantWeight
from shared.model.gguf_loader import GGUFTensor, hf_tensor_name, read_config, read_gguf, unpermute_rope
from shared.model.kquant_codes import KQUANT_TYPES, SUPER_BLOCK, kquant_codes
from shared.model.llama import projection_sources
from shared.model.model_config import ModelConfig


def has_kquant_projections(gguf_path: Path) -> bool:
    """Whether the GGUF at ``gguf_path`` holds layer weights in Q4_K or Q6_K (reads its header)."""
    _, tensors = read_gguf(gguf_path)
    return any(t.name.startswith("blk.") and t.kind in KQUANT_TYPES for t in tensors)


def kquant_projections(gguf_path: Path) -> dict[str, TileQuantProjection]:
    """Module name (``layers.3.mlp.down_proj``, ``lm_head``) -> its projection as K-quant codes,
    for every projection of the GGUF at ``gguf_path`` that has one."""
    metadata, tensors = read_gguf(gguf_path)
    config = read_config(metadata, {t.name for t in tensors})
    by_name = {hf_tensor_name(t.name): t for t in tensors}
    projections = {}
    for module, sources in projection_sources(config).items():
        segments = _segments([by_name.get(name) for name in sources], sources, config)
        if segments is not None:
            projections[module] = TileQuantProjection(segments)
    return projections


def _segments(parts: list[GGUFTensor | None], names: list[str],
              config: ModelConfig) -> tuple[TileQuantWeight, ...] | None:
    """The parts' codes as tile weights, consecutive parts of one format merged into one segment;
    None where a part is missing, in another format, or does not fit the tiles."""
    forms = []
    for part, name in zip(parts, names, strict=True):
        codes = None if part is None or part.data.ndim != 2 else kquant_codes(part.kind, part.data)
        if codes is None or codes.codes.shape[0] % OUTPUTS_PER_TILE:
            return None
        # q/k rows in HF's order (llama-arch files permute them): the row permutation, as indices
        order = unpermute_rope(torch.arange(codes.codes.shape[0]), name, config)
        forms.append((codes.bits, codes.group, *(torch.from_numpy(a)[order] for a in (
            codes.codes, codes.group_scales, codes.group_minimums, codes.super_scales, codes.super_minimums))))
        part.release()
    segments = []
    start = 0
    while start < len(forms):  # runs of one (bits, group)
        end = start + 1
        while end < len(forms) and forms[end][:2] == forms[start][:2]:
            end += 1
        bits, group = forms[start][:2]
        codes, *scales = (torch.cat([f[i] for f in forms[start:end]]) for i in range(2, 7))
        segments.append(TileQuantWeight.from_codes(codes, GroupScales(*scales, SUPER_BLOCK), None, bits, group))
        start = end
    return tuple(segments)


def attach_projections(model, projections: Mapping[str, TileQuantProjection]) -> int:
    """Attach each projection to its module's weight in ``model`` (after any packing, which
    replaces the weights); returns how many."""
    for module, projection in projections.items():
        attach(model.get_submodule(module).weight, projection)
    return len(projections)
