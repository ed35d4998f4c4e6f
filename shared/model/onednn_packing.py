"""Packing a model's products for oneDNN in place (``kernels.onednn_linear``): its decoder
layers' projections (``pack_layer_linears``) and its LM head (``pack_head``). The engine's
runner packs what its kernel plan chose (``shared.engine.runner.ModelRunner.apply_plan``).
"""

from __future__ import annotations

from kernels.onednn_linear import PackedHead, PackedLinear
from shared.model.llama import LlamaModel


def pack_layer_linears(model: LlamaModel) -> int:
    """Replace every decoder layer's projections (q/k/v, o, gate/up, down) with ``PackedLinear``
    in place, dropping their dense weights (and their pages, where they view a converted-weights
    file: ``shared.model.weight_cache.MappedWeights``); the LM head stays dense
    (``kernels.greedy_head`` reads it in slices). Returns how many were packed (none when they
    already are). The model must run the layer functions of ``kernels.onednn_linear.PACKED_LAYERS``
    afterwards (``LlamaModel.use_layer_functions``)."""
    count = 0
    mapped = model.mapped_weights
    for layer in model.layers:
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                            (layer.mlp, "down_proj")):
            linear = getattr(owner, name)
            if not isinstance(linear, PackedLinear):
                setattr(owner, name, PackedLinear(linear.weight, linear.bias))
                if mapped is not None:  # its dense copy no longer counts in memory
                    mapped.release(linear.weight)
                count += 1
    return count


def pack_head(model: LlamaModel) -> bool:
    """Give ``model`` a ``PackedHead`` (in place); False when it has one already."""
    if isinstance(model.lm_head, PackedHead):
        return False
    model.lm_head = PackedHead(model.lm_head)
    return True
