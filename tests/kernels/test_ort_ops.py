"""fleetserve.BlockMatMul, the block kernel as an ONNX Runtime custom op (kernels.ort_ops), run
by ONNX Runtime against the naive reference: a GGUF block weight dequantized by the ``gguf``
package, multiplied plainly; and what it does with inputs that do not match."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torch

from edged.gguf_blocks import BLOCK, block_weight
from kernels.block_matmul_cpu import block_matmul_cpu
from kernels.block_products import bf16_products_built
from kernels.ort_ops import BLOCK_MATMUL, DOMAIN, ort_ops_library
from kernels.triton_int4_matmul import Int4Weight

ort = pytest.importorskip("onnxruntime", reason="needs the onnx extra: pip install 'fleetserve[onnx]'")
onnx = pytest.importorskip("onnx")
pytestmark = pytest.mark.skipif(ort_ops_library() is None, reason="the ONNX Runtime ops cannot be built here")
Q = gguf.GGMLQuantizationType


def block_matmul_model(n: int, k: int, bits: int, initializers: dict[str, np.ndarray] | None = None,
                       overrides: dict[str, int] | None = None) -> bytes:
    """One BlockMatMul node, ``A [1, T, K] -> Y [1, T, N]``; B, scales and minimums are graph
    inputs unless given as initializers; ``overrides`` replace attributes."""
    from onnx import TensorProto, helper, numpy_helper

    initializers = initializers or {}
    attributes = {"K": k, "N": n, "bits": bits, "bf16_products": 0} | (overrides or {})
    node = helper.make_node(BLOCK_MATMUL, ["A", "B", "scales", "minimums"], ["Y"], domain=DOMAIN, **attributes)
    kinds = {"A": TensorProto.FLOAT, "B": TensorProto.UINT8, "scales": TensorProto.FLOAT, "minimums": TensorProto.FLOAT}
    inputs = [helper.make_tensor_value_info(name, kind, None) for name, kind in kinds.items() if name not in initializers]
    graph = helper.make_graph([node], "block_matmul", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(array, name) for name, array in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
    return model.SerializeToString()


def session(model: bytes):
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(ort_ops_library()))
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from([Q.Q4_0, Q.Q4_1, Q.Q8_0]), rows=st.sampled_from([1, 2, 5, 13, 32, 33, 70]),
       outputs=st.integers(1, 40), groups=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_block_matmul_is_the_gguf_weights_product(kind, rows, outputs, groups, seed):
    """Up to 32 rows by the block kernel (a row the same bit for bit alone or with others),
    more by the dequantized weight's GEMM: both the product of the GGUF's own weights."""
    rng = np.random.default_rng(seed)
    k = groups * BLOCK
    data = gguf.quants.quantize(rng.standard_normal((outputs, k)).astype(np.float32), kind)
    blocks = block_weight(kind, data)
    run = session(block_matmul_model(outputs, k, blocks.bits, {
        "B": blocks.packed(), "scales": blocks.scales, "minimums": blocks.minimums()}))
    x = rng.standard_normal((1, rows, k)).astype(np.float32)
    y = run.run(None, {"A": x})[0]
    assert y.shape == (1, rows, outputs)
    np.testing.assert_allclose(y[0], x[0] @ gguf.quants.dequantize(data, kind).T, atol=2e-4, rtol=1e-4)
    if rows <= 32:
        for r in (0, rows - 1):
            assert np.array_equal(run.run(None, {"A": x[:, r:r + 1]})[0][0, 0], y[0, r])


@pytest.mark.skipif(not bf16_products_built(), reason="bf16 products need a CPU with AVX-512 BF16")
def test_bf16_products_attribute_runs_the_kernels_bf16_products():
    rng = np.random.default_rng(0)
    n, k = 24, 96
    weight = Int4Weight.quantize(torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)))
    run = session(block_matmul_model(n, k, 4, {"B": weight.packed.numpy(), "scales": weight.scales.numpy(),
                                               "minimums": weight.minimums.numpy()}, {"bf16_products": 1}))
    x = rng.standard_normal((1, 5, k)).astype(np.float32)
    y = run.run(None, {"A": x})[0][0]
    assert np.array_equal(y, block_matmul_cpu(torch.from_numpy(x[0]), weight, bf16_products=True).numpy())
    assert not np.array_equal(y, block_matmul_cpu(torch.from_numpy(x[0]), weight).numpy())


def test_inputs_that_do_not_match_fail_the_run_and_name_themselves():
    n, k = 8, 64
    run = session(block_matmul_model(n, k, 4))
    good = {"A": np.ones((1, 2, k), np.float32), "B": np.zeros((n, k // 2), np.uint8),
            "scales": np.ones((n, k // BLOCK), np.float32), "minimums": np.zeros((n, k // BLOCK), np.float32)}
    assert run.run(None, good)[0].shape == (1, 2, n)
    assert run.run(None, good | {"A": np.ones((0, k), np.float32)})[0].shape == (0, n)  # no rows
    assert run.run(None, good | {"A": np.ones(k, np.float32)})[0].shape == (n,)  # a vector
    for name, value, message in [("A", np.ones((1, 2, k + 32), np.float32), r"A must be float32 \[\.\.\., K=64\]"),
                                 ("B", np.zeros((n, k), np.uint8), "B must be uint8 with N \\* K \\* bits / 8 = 256"),
                                 ("scales", np.ones((n, 1), np.float32), "scales must be float32"),
                                 ("minimums", np.ones((n + 1, 2), np.float32), "minimums must be float32")]:
        with pytest.raises(Exception, match=message):
            run.run(None, good | {name: value})
    assert run.run(None, good)[0].shape == (1, 2, n)  # the session still runs


@pytest.mark.parametrize(("attributes", "message"), [({"bits": 3}, "bits must be 4 or 8, got 3"),
                                                     ({"K": 48}, "K must be a positive multiple of 32"),
                                                     ({"N": 1 << 32}, "both at most 2\\^31"),
                                                     ({"bf16_products": 2}, "bf16_products must be 0 or 1")])
def test_bad_attributes_fail_the_session_with_a_reason(attributes, message):
    with pytest.raises(Exception, match=message):
        session(block_matmul_model(8, 64, 4, overrides=attributes))
