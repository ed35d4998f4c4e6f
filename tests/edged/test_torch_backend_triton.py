"""edged's torch backend on the Triton kernels (``kernels="triton"``): on the CPU under the
interpreter, the logits of the default model's first two layers (its weights, its head)
against the plain-torch backend's over a prompt and decode steps (all thirty layers cost the
interpreter half a minute and test nothing more); on a CUDA device (``gpu``), the quantized
layers' Triton matmuls against dequantize-then-matmul."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

from edged.backends.torch_backend import TorchBackend


def first_layers(checkpoint, n: int):
    """``checkpoint`` cut to its first ``n`` decoder layers (embeddings, final norm and head kept)."""
    layer = re.compile(r"model\.layers\.(\d+)\.")
    weights = {k: w for k, w in checkpoint.weights.items() if (m := layer.match(k)) is None or int(m[1]) < n}
    return dataclasses.replace(checkpoint, config=dataclasses.replace(checkpoint.config, num_layers=n), weights=weights)


def test_the_triton_backend_computes_the_plain_torch_logits(default_checkpoint):
    checkpoint = first_layers(default_checkpoint, 2)
    reference = TorchBackend(checkpoint, 64, kernels="torch")
    triton = TorchBackend(checkpoint, 64, kernels="triton")
    prompt = list(range(100, 120))
    torch.testing.assert_close(triton.forward(prompt, 0), reference.forward(prompt, 0), atol=2e-4, rtol=1e-4)
    for i, token in enumerate((5, 900, 31)):  # decode steps read what the prompt wrote
        torch.testing.assert_close(triton.forward([token], 20 + i), reference.forward([token], 20 + i),
                                   atol=2e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 37])  # the GEMV (batch-1 decode) and the GEMM (prefill)
def test_quantized_linears_on_cuda_equal_dequantize_then_matmul(quant, rows):
    from edged.backends.quantize import QUANTIZED_LINEAR
    from kernels.triton_int4_matmul import Int4Weight

    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=False).cuda()  # the default model's MLP shape
    layer = QUANTIZED_LINEAR[quant](linear)
    if quant == "int4":
        dequantized = Int4Weight(layer.packed, layer.scales, layer.minimums, layer.group).dequantize(torch.float32)
    else:
        dequantized = layer.weight.float() * layer.scales[:, None].float()
    x = torch.randn(rows, 576, device="cuda")
    torch.testing.assert_close(layer(x), x @ dequantized.T, atol=1e-3, rtol=1e-3)
