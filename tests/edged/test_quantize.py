"""Weight-only int8/int4 layers against a naive reference: the float weight their rounding rule
gives, multiplied the plain way."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from edged.backends.quantize import INT4_GROUP, BlockLinear, Int8Linear, quantize_linears
from kernels.block_products import bf16_products_built
from kernels.cpu_extension import cpu_kernels
from shared.model.llama import EAGER


def reference_int8(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
    return torch.round(w / scale).clamp(-128, 127) * scale


def reference_int4(w: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for g in range(0, w.shape[1], INT4_GROUP):
            block = w[r, g:g + INT4_GROUP]
            low, high = block.min(), block.max()
            scale = max(float(high - low), 1e-8) / 15
            out[r, g:g + INT4_GROUP] = torch.round((block - low) / scale).clamp(0, 15) * scale + low
    return out


@settings(max_examples=20, deadline=None)
@given(out_f=st.integers(1, 4).map(lambda n: 16 * n), groups=st.integers(1, 4), rows=st.integers(1, 5),
       seed=st.integers(0, 2**16), bias=st.booleans())
def test_quantized_linears_multiply_by_their_rounded_weight(out_f, groups, rows, seed, bias):
    torch.manual_seed(seed)
    linear = nn.Linear(groups * INT4_GROUP * 2, out_f, bias=bias)
    x = torch.randn(rows, linear.in_features)
    for layer, reference in ((Int8Linear(linear), reference_int8), (BlockLinear.quantize(linear), reference_int4)):
        expected = x @ reference(linear.weight.detach()).T + (linear.bias.detach() if bias else 0)
        torch.testing.assert_close(layer(x), expected, atol=2e-4, rtol=2e-4)


def test_quantize_linears_replaces_every_linear_and_keeps_the_embedding_float():
    model = nn.Sequential(nn.Embedding(10, 64), nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 32)))
    quantize_linears(model, "int4")
    assert isinstance(model[1], BlockLinear) and isinstance(model[2][0], BlockLinear)
    assert model[0].weight.dtype == torch.float32
    with pytest.raises(ValueError, match="quantization 'int3'"):
        quantize_linears(model, "int3")
    with pytest.raises(ValueError, match="ONNX graph's"):  # int8 activations are ONNX Runtime's kernel
        quantize_linears(model, "int4-a8")


def test_a_quantized_weight_stands_in_for_the_float_one_in_linear():
    """The layer functions call nn.functional.linear on each projection's weight."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x = torch.randn(3, 64)
    for layer in (Int8Linear(linear), BlockLinear.quantize(linear)):
        torch.testing.assert_close(nn.functional.linear(x, layer.weight, layer.bias), layer(x), atol=0, rtol=0)
        assert layer.weight.shape == (32, 64)
        with pytest.raises(TypeError):
            torch.matmul(x, layer.weight)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_the_torch_backend_runs_quantized_weights(default_checkpoint, plan_prompt, quant):
    """The whole model on quantized linears: its next-token choices over a plan prompt mostly
    agree with the float model's (int4 re-rounds the GGUF's 8-bit LM head, and ties in the
    prompt's free text go either way: 85 % measured), and a row is the same, to rounding,
    whether computed alone or with the rows before it."""
    from edged.backends.torch_backend import TorchBackend

    float_rows = TorchBackend(default_checkpoint, 1024, "none").forward_rows(plan_prompt, 0)
    backend = TorchBackend(default_checkpoint, 1024, quant)
    rows = backend.forward_rows(plan_prompt, 0)
    agreement = (rows.argmax(-1) == float_rows.argmax(-1)).float().mean().item()
    assert agreement >= 0.7, agreement
    tail = plan_prompt[-8:]
    start = len(plan_prompt) - 8
    torch.testing.assert_close(backend.forward_rows(tail, start)[-1], backend.forward(tail, start),
                               atol=1e-3, rtol=1e-3)


def test_int4_from_a_gguf_runs_its_own_blocks(default_checkpoint, default_model_path, plan_prompt):
    """Every linear layer of the default Q4_1 GGUF (its LM head Q8_0) takes the file's blocks as
    they are: the next-token choices are the float model's (the dequantized GGUF), to rounding."""
    from edged.backends.torch_backend import TorchBackend

    backend = TorchBackend(default_checkpoint, 1024, "int4", blocks_from=default_model_path)
    config = default_checkpoint.config
    assert backend.carried_layers == 4 * config.num_layers + 1
    assert "gguf-blocks" in backend.identity()
    float_rows = TorchBackend(default_checkpoint, 1024, "none").forward_rows(plan_prompt, 0)
    agreement = (backend.forward_rows(plan_prompt, 0).argmax(-1) == float_rows.argmax(-1)).float().mean().item()
    assert agreement >= 0.99, agreement


@pytest.mark.skipif(cpu_kernels() is None, reason="the CPU extension cannot be built here")
@pytest.mark.parametrize("products", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not bf16_products_built(), reason="bf16 products need a CPU with AVX-512 BF16"))])
def test_short_int4_forwards_run_each_layer_in_one_fused_call(default_checkpoint, default_model_path, plan_prompt,
                                                              products):
    """A decode step with drafts runs the fused layers (``edged.backends.block_layers``): its
    logits are the plain layer functions' to rounding (bf16 products: a C++ and a torch RMSNorm
    may round an operand to neighbouring bf16 values, and 30 layers carry that to ~0.2 of a
    logit), and its first row is the one-token forward's bit for bit (speculation never changes
    a token)."""
    from edged.backends.block_layers import BLOCK_LAYERS_CPU
    from edged.backends.torch_backend import TorchBackend

    backend = TorchBackend(default_checkpoint, 1024, "int4", blocks_from=default_model_path, products=products)
    assert backend.model.layer_functions is BLOCK_LAYERS_CPU and backend.products == products
    start = len(plan_prompt) - 6
    backend.forward_rows(plan_prompt[:start], 0)  # a prefill: the plain functions (more than 32 rows)
    fused = backend.forward_rows(plan_prompt[start:], start)
    assert torch.equal(backend.forward(plan_prompt[start:start + 1], start), fused[0])
    backend.model.layer_functions = EAGER
    tolerance = 1e-3 if products == "float32" else 0.5
    torch.testing.assert_close(fused, backend.forward_rows(plan_prompt[start:], start), atol=tolerance, rtol=1e-3)


def test_a_block_layer_s_weight_follows_its_buffers_when_moved():
    layer = BlockLinear.quantize(nn.Linear(64, 32))
    assert layer.block_weight.scales is layer.scales
    layer.to(torch.float64)  # replaces the float buffers
    assert layer.block_weight.scales is layer.scales and layer.scales.dtype == torch.float64
