"""The builder's graph adjusted for edged: logits rows chosen per call, and the precision of the
activations its quantized matmuls see.

**Logits rows.** The builder (``prune_lm_head``) puts ``Gather(hidden, -1, axis=1)`` then ``Unsqueeze`` before the
LM head, so a prefill chunk pays for one row of logits, not for hundreds (~15 % of its time).
Speculative decoding needs the logits of every token it verifies. The two nodes are replaced by
``Slice(hidden, -num_logits_to_keep, end, axis=1)`` over a new int64 input of shape ``[1]``:
1 gives the builder's graph back, ``n`` the last ``n`` tokens' logits ``[batch, n, vocab]``.

**Activations.** ONNX Runtime's CPU MatMulNBits quantizes its input to int8 per block at
``accuracy_level`` 4 (the builder's choice) and keeps it float at level 1. Measured on the default
model (a Q4_1 GGUF's own blocks) against the dequantized model in fp32: next-token agreement
96-98 % with int8 activations, 99.7 % with float ones, which cost ~2x in the 4-bit kernels
(+25 % on a one-token forward). 8-bit nodes stay at level 4: ORT has no fast float path for
them (~50x slower). Level 4 also turns GQA's rounding differences between its one-token and
multi-token paths into up to ~1 logit (see ``edged.generation``).

Both edits change only the graph's structure; the weights' external data file is left as it is.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

KEEP_INPUT = "num_logits_to_keep"
FLOAT_ACTIVATIONS, INT8_ACTIVATIONS = 1, 4  # MatMulNBits accuracy levels
_GATHER, _UNSQUEEZE = "/lm_head/prune/Gather", "/lm_head/prune/Unsqueeze"
_INT64_MAX = (1 << 63) - 1


def keep_last_logits(onnx_dir: Path) -> None:
    """Rewrite ``onnx_dir/model.onnx`` so that input ``num_logits_to_keep`` sets the logits rows.

    Raises ValueError when the graph has no pruned LM head of the builder's shape (nothing is
    written then).
    """
    path = onnx_dir / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)  # initializers keep pointing at the data file
    graph = model.graph
    by_name = {node.name: node for node in graph.node}
    gather, unsqueeze = by_name.get(_GATHER), by_name.get(_UNSQUEEZE)
    if gather is None or unsqueeze is None or unsqueeze.input[0] != gather.output[0]:
        raise ValueError(f"{path}: no pruned LM head ({_GATHER} -> {_UNSQUEEZE}) to make selectable")
    prefix = "/lm_head/keep_last"
    constants = [helper.make_tensor(f"{prefix}/ends", TensorProto.INT64, [1], [_INT64_MAX]),
                 helper.make_tensor(f"{prefix}/axes", TensorProto.INT64, [1], [1])]
    graph.initializer.extend(constants)
    negated = helper.make_node("Neg", [KEEP_INPUT], [f"{prefix}/starts"], name=f"{prefix}/Neg")
    sliced = helper.make_node("Slice", [gather.input[0], f"{prefix}/starts", f"{prefix}/ends", f"{prefix}/axes"],
                              [unsqueeze.output[0]], name=f"{prefix}/Slice")
    nodes = []
    for node in graph.node:
        if node is gather:
            nodes += [negated, sliced]
        elif node is not unsqueeze:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    stale = {gather.output[0], unsqueeze.output[0]}  # their recorded shapes say one row
    kept_info = [info for info in graph.value_info if info.name not in stale]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    graph.input.append(helper.make_tensor_value_info(KEEP_INPUT, TensorProto.INT64, [1]))
    logits = next(o for o in graph.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[1].dim_param = KEEP_INPUT
    _save(model, path)


def set_activation_precision(onnx_dir: Path, int8_activations: bool) -> int:
    """Set the accuracy level of every 4-bit MatMulNBits node of ``onnx_dir/model.onnx``
    (int8 activations or float ones); returns how many nodes it set."""
    path = onnx_dir / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    level = INT8_ACTIVATIONS if int8_activations else FLOAT_ACTIVATIONS
    changed = 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or _attribute(node, "bits").i != 4:
            continue
        accuracy = next((a for a in node.attribute if a.name == "accuracy_level"), None)
        if accuracy is None:
            node.attribute.append(helper.make_attribute("accuracy_level", level))
        else:
            accuracy.i = level
        changed += 1
    _save(model, path)
    return changed


def _save(model: onnx.ModelProto, path: Path) -> None:
    """Write the graph without initializers no node reads (the pruned LM head's index, tensors
    the carried blocks replaced): ONNX Runtime warns about each one at every start."""
    graph = model.graph
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    used = [init for init in graph.initializer if init.name in read]
    del graph.initializer[:]
    graph.initializer.extend(used)
    onnx.save_model(model, str(path))


def _attribute(node: onnx.NodeProto, name: str) -> onnx.AttributeProto:
    return next(a for a in node.attribute if a.name == name)
