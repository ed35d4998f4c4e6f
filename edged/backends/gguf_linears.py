"""The torch backend runs a GGUF's own quantized weights: each linear layer whose GGUF tensors
are in a block format (Q4_0, Q4_1: 4-bit; Q8_0: 8-bit) takes those blocks as they are, in the
form ``scale * code + minimum`` per 32 input columns that ``edged.backends.quantize.BlockLinear``
reads (``edged.gguf_blocks``: Q4_0 ``d (q - 8)``, Q4_1 ``d q + m``, Q8_0 ``d q``). Without this,
int4 rounds the dequantized GGUF a second time (a Q8_0 LM head to 4 bits among it).

Fused projections stack their parts' rows as the model does: q, k, v (q/k rows in HF's order,
``unpermute_rope``) and gate, up. A layer whose parts are in other formats, or in different
ones, keeps what it had.
"""

from __future__ import annotations

from pathlib import Path

import torch

from edged.backends.quantize import BlockLinear
from edged.carry_blocks import gguf_block_weights
from edged.gguf_blocks import BLOCK, BlockWeight
from kernels.block_matmul_cpu import Int8BlockWeight, PackedBlockWeight
from kernels.triton_int4_matmul import Int4Weight
from shared.model.llama import LlamaModel, projection_sources


def carry_gguf_linears(model: LlamaModel, gguf_path: Path) -> int:
    """Replace (in place) every linear layer of ``model`` whose GGUF weights are block-quantized
    with a ``BlockLinear`` holding those blocks, on the model's device; returns how many."""
    _, blocks = gguf_block_weights(gguf_path)
    device = model.embed_tokens.weight.device
    carried = 0
    for module_name, sources in projection_sources(model.config).items():
        if any(name not in blocks for name in sources):
            continue
        try:
            weight = _kernel_form(BlockWeight.stack([blocks[name] for name in sources]))
        except ValueError:  # parts in different formats
            continue
        layer = model.get_submodule(module_name)
        if weight.packed.shape[0] != layer.out_features:
            continue
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child,
                BlockLinear(weight, layer.bias).to(device))
        carried += 1
    return carried


def _kernel_form(weight: BlockWeight) -> PackedBlockWeight:
    """The GGUF-side blocks (numpy) in the torch form the kernels read."""
    codes = torch.from_numpy(weight.codes)
    scales, minimums = torch.from_numpy(weight.scales), torch.from_numpy(weight.minimums())
    if weight.bits == 4:
        return Int4Weight.from_codes(codes, scales, minimums, BLOCK)
    return Int8BlockWeight(codes, scales, minimums)
