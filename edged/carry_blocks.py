"""The robot runs the model's own weights: a GGUF's quantized blocks carried into the int4 ONNX
graph as they are, in place of the builder's re-quantization of their dequantized values.

The builder (``edged.export``) reads a float32 HF folder dequantized from the GGUF and rounds
every weight to 4 bits again (symmetric, its own scales): a second rounding of weights that
were 4-bit already. Here each of its MatMulNBits nodes gets the GGUF's blocks instead
(``edged.gguf_blocks``: Q4_0, Q4_1, Q8_0 exactly; Q8_0 as an 8-bit node), with the rows of q/k
in HF's order (``unpermute_rope``) and q, k, v stacked for the fused qkv projection. Q4_1's
per-block minimum becomes an offset term beside the node (the input's block sums times the
offsets: ``edged.gguf_blocks``), so the kernel keeps its fast integer path. With tied
embeddings the builder's token lookup (``GatherBlockQuantized``) reads the LM head's blocks
too; it follows them (their bit width, their zero points; Q4_1 embeddings, which a lookup
cannot offset, keep the builder's). A node whose weights are in another format keeps the
builder's. CPU exports only: a CUDA export's
float16 scales would round Q4_1's zero points.

With ``block_ops`` (the int4 CPU export where ``kernels.ort_ops`` builds) each carried node
becomes ``fleetserve.BlockMatMul`` instead: the same packed codes and scales (still shared with
the lookups) and the blocks' minimums, multiplied by edged's own block kernel with float
activations, the LM head's 8-bit blocks among them. ONNX Runtime's MatMulNBits has no fast
float-activation path on x86 and costs nearly a forward per token on speculation's
multi-token forwards; measured on a 2-core AVX-512 EPYC (SmolLM2-135M, 500-token context):
10.6 against 14.9 ms for one token, 32 against 45 ms for 13, prefills within a few per cent.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from edged.gguf_blocks import BLOCK, BlockWeight, block_weight
from kernels.ort_ops import BLOCK_MATMUL, DOMAIN
from shared.model.gguf_loader import hf_tensor_name, read_config, read_gguf, unpermute_rope
from shared.model.model_config import ModelConfig

_LAYER_NODE = re.compile(r"/model/layers\.(\d+)/(attn|mlp)/(\w+)/MatMul_Q4")
_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}  # fused nodes; others are one projection each
_BLOCK_SECTION = {"attn": "self_attn", "mlp": "mlp"}


def carry_gguf_blocks(onnx_dir: Path, gguf_path: Path, block_ops: bool = False, bf16_products: bool = False) -> int:
    """Rewrite ``onnx_dir/model.onnx`` (and its external data) with the GGUF's blocks; returns
    how many of its MatMulNBits nodes now hold them. With ``block_ops`` those nodes become
    ``fleetserve.BlockMatMul`` (``kernels.ort_ops``: the blocks with their minimums, no offset
    term), reading the same packed codes and scales as the token lookups that share them; the
    session must then load that library (a node with a bias keeps MatMulNBits). ``bf16_products``
    sets their attribute of that name (the kernel's products in bfloat16)."""
    config, blocks = gguf_block_weights(gguf_path)
    model = onnx.load(str(onnx_dir / "model.onnx"))  # with its external data
    initializers = {i.name: i for i in model.graph.initializer}
    nodes: list[onnx.NodeProto] = []  # the graph's nodes in order, offset terms after their node
    block_sums: dict[str, str] = {}  # input -> its per-block sums, shared by the nodes reading it
    carried = 0
    for node in list(model.graph.node):
        weight = _carried_weight(node, config, blocks)
        if weight is None or (weight.offsets is not None and _lookups(model, node.input[1])):
            nodes.append(node)
            continue
        _replace(initializers[node.input[1]], weight.packed())
        scales = initializers[node.input[2]]
        _replace(scales, weight.scales.astype(onnx.helper.tensor_dtype_to_np_dtype(scales.data_type)))
        zero = None
        if weight.zero_points is not None:
            zero = numpy_helper.from_array(np.ascontiguousarray(weight.zero_points), f"{node.input[1]}_zero_points")
            model.graph.initializer.append(zero)
        _follow_lookups(model, node.input[1], weight, zero)
        carried += 1
        if block_ops and scales.data_type == onnx.TensorProto.FLOAT and not any(node.input[4:]):  # no bias
            nodes.append(_block_matmul(model, node, weight, bf16_products))
            continue
        nodes.append(node)
        next(a for a in node.attribute if a.name == "bits").i = weight.bits
        if zero is not None:
            _set_input(node, 3, zero.name)
        else:
            del node.input[3:]  # the default zero point, 8
        if weight.offsets is not None:
            nodes += _offset_term(model, node, weight.offsets, block_sums)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    data = onnx_dir / "model.onnx.data"
    data.unlink(missing_ok=True)  # the writer appends to an existing file
    onnx.save_model(model, str(onnx_dir / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    return carried


def _block_matmul(model: onnx.ModelProto, node: onnx.NodeProto, weight: BlockWeight,
                  bf16_products: bool) -> onnx.NodeProto:
    """``node`` (a MatMulNBits whose packed codes and scales now hold ``weight``) as a
    ``fleetserve.BlockMatMul`` over them and a new initializer of the blocks' minimums."""
    minimums = numpy_helper.from_array(weight.minimums(), f"{node.input[1]}_minimums")
    model.graph.initializer.append(minimums)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    n, k = weight.codes.shape
    return onnx.helper.make_node(BLOCK_MATMUL, [node.input[0], node.input[1], node.input[2], minimums.name],
                                 list(node.output), name=node.name, domain=DOMAIN, K=k, N=n, bits=weight.bits,
                                 bf16_products=int(bf16_products))


def _carried_weight(node: onnx.NodeProto, config: ModelConfig, blocks: dict[str, BlockWeight]) -> BlockWeight | None:
    """The GGUF blocks a MatMulNBits node should hold, or None (another op, another format, a
    shape or block size that does not match)."""
    if node.op_type != "MatMulNBits":
        return None
    names = _sources(node.name, config)
    if names is None or any(n not in blocks for n in names):
        return None
    weight = BlockWeight.stack([blocks[n] for n in names])
    attrs = {a.name: a.i for a in node.attribute}
    return weight if weight.codes.shape == (attrs["N"], attrs["K"]) and attrs["block_size"] == BLOCK else None


def _offset_term(model: onnx.ModelProto, node: onnx.NodeProto, offsets: np.ndarray,
                 block_sums: dict[str, str]) -> list[onnx.NodeProto]:
    """Nodes that add ``offsets`` (per output row and block) to ``node``'s product: the input's
    sums over each block of ``BLOCK`` times the offsets, a [K / BLOCK, N] float matmul. The
    node's output is renamed; the last new node writes the old name."""
    x, y = node.input[0], node.output[0]
    node.output[0] = f"{y}_blocks"
    added = []
    if x not in block_sums:
        shape = numpy_helper.from_array(np.array([0, 0, -1, BLOCK], np.int64), f"{node.name}/block_shape")
        axes = numpy_helper.from_array(np.array([-1], np.int64), f"{node.name}/block_axes")
        model.graph.initializer.extend([shape, axes])
        added += [onnx.helper.make_node("Reshape", [x, shape.name], [f"{node.name}/blocks"], name=f"{node.name}/Blocks"),
                  onnx.helper.make_node("ReduceSum", [f"{node.name}/blocks", axes.name], [f"{node.name}/block_sums"],
                                        name=f"{node.name}/BlockSums", keepdims=0)]
        block_sums[x] = f"{node.name}/block_sums"
    table = numpy_helper.from_array(np.ascontiguousarray(offsets.T.astype(np.float32)), f"{node.input[1]}_offsets")
    model.graph.initializer.append(table)
    added += [onnx.helper.make_node("MatMul", [block_sums[x], table.name], [f"{y}_offsets"], name=f"{node.name}/Offsets"),
              onnx.helper.make_node("Add", [node.output[0], f"{y}_offsets"], [y], name=f"{node.name}/AddOffsets")]
    return added


def _lookups(model: onnx.ModelProto, packed: str) -> bool:
    """Whether a token lookup reads these blocks (directly or through a Reshape)."""
    return bool(_lookup_nodes(model, packed)[1])


def _lookup_nodes(model: onnx.ModelProto, packed: str) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]]:
    """The Reshapes of ``packed`` and the token lookups (GatherBlockQuantized) reading it or them."""
    reshapes = [n for n in model.graph.node if n.op_type == "Reshape" and n.input[0] == packed]
    sources = {packed} | {n.output[0] for n in reshapes}
    gathers = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized" and n.input[0] in sources]
    return reshapes, gathers


def gguf_block_weights(gguf_path: Path) -> tuple[ModelConfig, dict[str, BlockWeight]]:
    """The GGUF's model config, and HF name -> the blocks of every 2-D tensor in a carried
    format (Q4_0, Q4_1, Q8_0), q/k rows in HF's order."""
    metadata, tensors = read_gguf(gguf_path)
    config = read_config(metadata, {t.name for t in tensors})
    out = {}
    for tensor in tensors:
        weight = block_weight(tensor.kind, tensor.data) if tensor.data.ndim == 2 else None
        if weight is None:
            continue
        name = hf_tensor_name(tensor.name)
        rows = torch.arange(weight.codes.shape[0], dtype=torch.float32)[:, None]
        order = unpermute_rope(rows, name, config)[:, 0].long().numpy()  # the row permutation, applied to indices
        out[name] = weight.rows(order)
    return config, out


def _sources(node_name: str, config: ModelConfig) -> list[str] | None:
    """The HF weights a builder node multiplies by (stacked along output rows), or None."""
    if node_name == "/lm_head/MatMul_Q4":
        return ["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    match = _LAYER_NODE.fullmatch(node_name)
    if match is None:
        return None
    layer, section, projection = match.groups()
    prefix = f"model.layers.{layer}.{_BLOCK_SECTION[section]}"
    return [f"{prefix}.{p}.weight" for p in _PROJECTIONS.get(projection, (projection,))]


def _follow_lookups(model: onnx.ModelProto, packed: str, weight: BlockWeight, zero: onnx.TensorProto | None) -> None:
    """Point the token lookups that read ``packed`` (through a Reshape to [N, K * bits / 8]) at
    the new blocks: the reshape's shape, the lookup's bits and zero points."""
    n, k = weight.codes.shape
    reshapes, gathers = _lookup_nodes(model, packed)
    for node in reshapes:
        shape = numpy_helper.from_array(np.array([n, k * weight.bits // 8], np.int64), f"{packed}_lookup_shape")
        model.graph.initializer.append(shape)
        node.input[1] = shape.name
    reshaped = {node.output[0] for node in reshapes}
    stale = [v for v in model.graph.value_info if v.name in reshaped]  # the old shape, inferred by the builder
    for info in stale:
        model.graph.value_info.remove(info)
    for node in gathers:
        next(a for a in node.attribute if a.name == "bits").i = weight.bits
        if zero is not None:
            _set_input(node, 3, zero.name)


def _set_input(node: onnx.NodeProto, index: int, name: str) -> None:
    """Input ``index`` of ``node`` set to ``name`` (empty optional inputs filled in before it)."""
    while len(node.input) <= index:
        node.input.append("")
    node.input[index] = name


def _replace(initializer: onnx.TensorProto, array: np.ndarray) -> None:
    initializer.CopyFrom(numpy_helper.from_array(array, initializer.name))
