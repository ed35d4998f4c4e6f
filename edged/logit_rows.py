"""How many logits rows an ONNX forward returns, chosen per call: the builder's pruned LM head
made to keep the last ``num_logits_to_keep`` tokens instead of the last one.

The builder (``prune_lm_head``) puts ``Gather(hidden, -1, axis=1)`` then ``Unsqueeze`` before the
LM head, so a prefill chunk pays for one row of logits, not for hundreds (~15 % of its time).
Speculative decoding needs the logits of every token it verifies. The two nodes are replaced by
``Slice(hidden, -num_logits_to_keep, end, axis=1)`` over a new int64 input of shape ``[1]``:
1 gives the builder's graph back, ``n`` the last ``n`` tokens' logits ``[batch, n, vocab]``.
Only the graph's structure changes; the weights' external data file is left as it is.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

KEEP_INPUT = "num_logits_to_keep"
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
    onnx.save_model(model, str(path))
