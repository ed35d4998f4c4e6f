"""A model's products put in another weight form in place (``kernels.weight_forms``): its decoder
layers' projections (``convert_layer_linears``: oneDNN's packed layout, ``PackedLinear``, or int8
codes, ``Int8Linear``) and its LM head (``pack_head``). The engine's runner converts what its
kernel plan chose (``shared.engine.runner.ModelRunner.apply_plan``).
"""

from __future__ import annotations

from kernels.int8_linear import Int8Linear
from kernels.onednn_linear import PackedHead, PackedLinear
from kernels.weight_forms import FormLinear
from shared.model.llama import LlamaModel

# the kernel choice's dense implementations that put the projections in a form -> its layer
DENSE_FORMS: dict[str, type[FormLinear]] = {"packed": PackedLinear, "int8": Int8Linear}


def dense_form(model: LlamaModel) -> str | None:
    """The ``DENSE_FORMS`` name of the form ``model``'s projections are in (None: dense)."""
    down = model.layers[0].mlp.down_proj
    return next((name for name, form in DENSE_FORMS.items() if isinstance(down, form)), None)


def convert_layer_linears(model: LlamaModel, form: type[FormLinear]) -> int:
    """Replace every decoder layer's projections (q/k/v, o, gate/up, down) with ``form``'s layer
    in place, dropping their dense weights (and their pages, where they view a converted-weights
    file: ``shared.model.weight_cache.MappedWeights``); the LM head stays dense
    (``kernels.greedy_head`` reads it in slices). Returns how many were converted (none when
    they are in that form already). ValueError where they are in another form: a form is made
    from the dense weight, which is gone. The model must run the layer functions of
    ``kernels.weight_forms.FORM_LAYERS`` afterwards (``LlamaModel.use_layer_functions``)."""
    count = 0
    mapped = model.mapped_weights
    for layer in model.layers:
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                            (layer.mlp, "down_proj")):
            linear = getattr(owner, name)
            if isinstance(linear, form):
                continue
            if isinstance(linear, FormLinear):
                raise ValueError(f"{name} is a {type(linear).__name__} already: its dense weight is gone, "
                                 f"so it cannot become a {form.__name__}")
            setattr(owner, name, form(linear.weight, linear.bias))
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
