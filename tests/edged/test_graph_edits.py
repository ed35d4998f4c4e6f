"""edged.graph_edits on small graphs of the builder's shape: logits rows chosen per call, the
activation precision of 4-bit nodes only, and initializers nothing reads dropped."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="needs the onnx extra")
ort = pytest.importorskip("onnxruntime", reason="needs the onnx extra")
from onnx import TensorProto, helper  # noqa: E402

from edged.graph_edits import KEEP_INPUT, keep_last_logits, set_activation_precision  # noqa: E402

HIDDEN, VOCAB = 8, 5


def _pruned_head(path, with_prune: bool = True) -> np.ndarray:
    """hidden [1, seq, 8] -> (the builder's Gather(-1) + Unsqueeze) -> MatMul -> logits."""
    weight = np.random.default_rng(0).standard_normal((HIDDEN, VOCAB)).astype(np.float32)
    inits = [helper.make_tensor("w", TensorProto.FLOAT, weight.shape, weight.ravel()),
             helper.make_tensor("/model/constants/INT64/-1", TensorProto.INT64, [], [-1]),
             helper.make_tensor("/model/constants/INT64/[1]", TensorProto.INT64, [1], [1]),
             helper.make_tensor("unused", TensorProto.FLOAT, [1], [0.0])]
    nodes = [helper.make_node("Gather", ["hidden", "/model/constants/INT64/-1"], ["g"], name="/lm_head/prune/Gather",
                              axis=1),
             helper.make_node("Unsqueeze", ["g", "/model/constants/INT64/[1]"], ["u"], name="/lm_head/prune/Unsqueeze"),
             helper.make_node("MatMul", ["u" if with_prune else "hidden", "w"], ["logits"], name="/lm_head/MatMul")]
    graph = helper.make_graph(nodes if with_prune else nodes[2:], "head",
                              [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, "seq", HIDDEN])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1, VOCAB])], inits,
                              value_info=[helper.make_tensor_value_info("u", TensorProto.FLOAT, [1, 1, HIDDEN])])
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path / "model.onnx"))
    return weight


def test_the_lm_head_keeps_as_many_rows_as_asked(tmp_path):
    weight = _pruned_head(tmp_path)
    keep_last_logits(tmp_path)
    model = onnx.load(str(tmp_path / "model.onnx"))
    assert KEEP_INPUT in [i.name for i in model.graph.input]
    assert {i.name for i in model.graph.initializer} >= {"w"} and "unused" not in {i.name for i in model.graph.initializer}
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    hidden = np.random.default_rng(1).standard_normal((1, 6, HIDDEN)).astype(np.float32)
    for rows in (1, 3, 6):
        (logits,) = session.run(None, {"hidden": hidden, KEEP_INPUT: np.array([rows], dtype=np.int64)})
        np.testing.assert_allclose(logits, hidden[:, -rows:] @ weight, rtol=1e-5, atol=1e-5)


def test_a_graph_without_the_builder_s_pruned_head_is_refused_unchanged(tmp_path):
    _pruned_head(tmp_path, with_prune=False)
    before = (tmp_path / "model.onnx").read_bytes()
    with pytest.raises(ValueError, match="pruned LM head"):
        keep_last_logits(tmp_path)
    assert (tmp_path / "model.onnx").read_bytes() == before


def test_only_4_bit_nodes_get_float_activations(tmp_path):
    def matmul(name: str, bits: int) -> onnx.NodeProto:
        return helper.make_node("MatMulNBits", ["x", f"{name}.w", f"{name}.s"], [f"{name}.y"], name=name,
                                domain="com.microsoft", K=32, N=4, bits=bits, block_size=32, accuracy_level=4)
    inits = [helper.make_tensor(f"{n}.{k}", TensorProto.UINT8 if k == "w" else TensorProto.FLOAT, [1], [0])
             for n in ("q4", "q8") for k in ("w", "s")]
    graph = helper.make_graph([matmul("q4", 4), matmul("q8", 8)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
                              [helper.make_tensor_value_info(f"{n}.y", TensorProto.FLOAT, [1, 4]) for n in ("q4", "q8")],
                              inits)
    onnx.save_model(helper.make_model(graph), str(tmp_path / "model.onnx"))

    def levels() -> dict[str, int]:
        model = onnx.load(str(tmp_path / "model.onnx"))
        return {n.name: next(a.i for a in n.attribute if a.name == "accuracy_level") for n in model.graph.node}

    assert set_activation_precision(tmp_path, int8_activations=False) == 1
    assert levels() == {"q4": 1, "q8": 4}  # ONNX Runtime has no fast float path for 8-bit nodes
    assert set_activation_precision(tmp_path, int8_activations=True) == 1
    assert levels() == {"q4": 4, "q8": 4}
