"""The torch batch-1 backend: the engine's own model over a dense KV buffer.

With the Triton kernels (``kernels``; auto picks them on a GPU) it runs cloudd's: the layers of
``kernels.triton_layers``, the attention of ``kernels.triton_attention``, the dense buffer
``[max_len, kv_heads, head_dim]`` seen as a paged pool of ``GPU_BLOCK``-token blocks whose
block table is 0, 1, 2, ... (slot = position). On a GPU the one-token decode step is captured
once as a CUDA graph at start-up and replayed (static input id, position and context length).
Otherwise ``kernels.dense_attention`` runs eagerly (short steps on the CPU decode kernel, the
buffer then whole ``DECODE_BLOCK``-row blocks). Weights can be int8 or int4
(``edged.backends.quantize``: on a CPU int4 reads its 4-bit weights in place,
``kernels.block_matmul_cpu``, and short forwards run each layer's dense halves in one C++ call,
``edged.backends.block_layers``; Triton GEMV/GEMM on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from edged.backends.base import KVSnapshot
from edged.backends.block_layers import BLOCK_LAYERS_CPU
from edged.backends.gguf_linears import carry_gguf_linears
from edged.backends.quantize import BlockLinear, quantize_linears
from kernels.block_products import check_products, resolve_products
from kernels.cpu_extension import cpu_kernels
from kernels.dense_attention import DECODE_BLOCK, DenseAttentionStep
from kernels.triton_attention import TritonAttentionMetadata, TritonAttentionStep
from kernels.triton_decode_attention import DecodePlan, launch_programs, splits_for
from kernels.triton_layers import TRITON_LAYERS
from shared.engine.decode_graphs import capture
from shared.engine.kernel_choice import resolve_kernels
from shared.model.checkpoint import Checkpoint
from shared.model.llama import AttentionStep, KVCache, LlamaModel, build_model

GPU_BLOCK = 16  # tokens per block of the dense buffer seen as a paged pool on a GPU


class TorchBackend:
    name = "torch"
    row_exact = True  # float weights or weight-only quantization: rows differ by rounding only

    def __init__(self, checkpoint: Checkpoint, max_len: int, quant: str = "none", device: str = "cpu",
                 model_digest: str = "", cuda_graph: bool = True, kernels: str = "auto",
                 blocks_from: Path | None = None, products: str = "auto"):
        """``kernels`` as ``[engine] kernels`` (``shared.engine.kernel_choice``): auto is Triton
        on a GPU and the plain-torch dense attention on a CPU. ``blocks_from``: with int4, the
        GGUF the checkpoint came from; its block-quantized tensors are used as they are
        (``edged.backends.gguf_linears``) and only the other layers are quantized. ``products``
        (``kernels.block_products.PRODUCTS``): the precision of the CPU block kernels' products,
        where int4 runs them; ValueError for another name."""
        cfg = checkpoint.config
        self.quant = quant
        self.max_len = max_len
        self.vocab_size = cfg.vocab_size
        self.device = torch.device(device)
        self._digest = model_digest
        model = build_model(cfg, checkpoint.weights).to(self.device)
        self.carried_layers = carry_gguf_linears(model, blocks_from) if quant == "int4" and blocks_from else 0
        self.model: LlamaModel = quantize_linears(model, quant)
        self.triton = resolve_kernels(kernels, device) == "triton"
        block = GPU_BLOCK if self.triton else DECODE_BLOCK  # whole blocks for Triton and the CPU decode kernel
        rows = -(-max_len // block) * block
        shape = (rows, cfg.num_kv_heads, cfg.head_dim)
        # NOTE: one buffer per layer (see shared.engine.runner): slices of one big tensor get
        # copied whole under torch.compile and CUDA graphs replay them fine either way.
        self.kv = [(torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device))
                   for _ in range(cfg.num_layers)]
        # the same memory as paged pools [blocks, GPU_BLOCK, kv_heads, head_dim] for the Triton kernels
        self._pools: list[KVCache] = [(k.view(-1, GPU_BLOCK, *shape[1:]), v.view(-1, GPU_BLOCK, *shape[1:]))
                                      for k, v in self.kv] if self.triton else self.kv
        if self.triton:
            self.model.layer_functions = TRITON_LAYERS
        elif quant == "int4" and self.device.type == "cpu" and cpu_kernels() is not None:
            self.model.layer_functions = BLOCK_LAYERS_CPU
        self.products: str | None = None  # the block kernels' products, where they run
        check_products(products)
        if self.model.layer_functions is BLOCK_LAYERS_CPU:
            self.products = resolve_products(products)
            for module in self.model.modules():
                if isinstance(module, BlockLinear):
                    module.bf16_products = self.products == "bfloat16"
        self._programs = launch_programs(self.device)  # the Triton decode launch's target
        self._graph: _DecodeGraph | None = None
        if self.triton and self.device.type == "cuda" and cuda_graph:
            self._graph = _DecodeGraph(self.model, self._pools, self.device)

    @property
    def uses_cuda_graph(self) -> bool:
        return self._graph is not None

    def forward(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        if len(token_ids) == 1 and self._graph is not None and 0 <= start < self.max_len:
            return self._graph.replay(token_ids[0], start)
        return self._run(token_ids, start, 1)[0]

    def forward_rows(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        return self._run(token_ids, start, len(token_ids))

    def _run(self, token_ids: Sequence[int], start: int, rows: int) -> torch.Tensor:
        """Logits ``[rows, vocab]`` (CPU) of the last ``rows`` of ``token_ids`` placed at ``start``."""
        n = len(token_ids)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if start < 0 or start + n > self.max_len:
            raise ValueError(f"positions {start}..{start + n - 1} do not fit the KV buffer of {self.max_len}")
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        positions = torch.arange(start, start + n, device=self.device)
        hidden = self.model(ids, positions, self._pools, self._step(positions, start, n))
        return self.model.logits(hidden[n - rows:]).cpu()

    def _step(self, positions: torch.Tensor, start: int, n: int) -> AttentionStep:
        """Tokens ``start .. start + n - 1`` over the buffer: one extend segment of the Triton
        kernels (its block table the buffer's first blocks), or dense attention."""
        if not self.triton:
            return DenseAttentionStep.over(positions, start + n, self.kv[0][0])
        blocks = list(range(-(-(start + n) // GPU_BLOCK)))
        return TritonAttentionStep(TritonAttentionMetadata.build(
            [], [], [(blocks, start, n)], list(range(start, start + n)), GPU_BLOCK, self._pools[0][0].shape[2],
            self.device, target_programs=self._programs))

    def save_kv(self, length: int) -> KVSnapshot:
        def host(t: torch.Tensor) -> np.ndarray:
            return np.ascontiguousarray(t[:length].transpose(0, 1).float().cpu().numpy())
        return KVSnapshot(length, tuple(host(k) for k, _ in self.kv), tuple(host(v) for _, v in self.kv))

    def load_kv(self, snapshot: KVSnapshot) -> None:
        n = snapshot.length
        for (k, v), ks, vs in zip(self.kv, snapshot.keys, snapshot.values, strict=True):
            k[:n].copy_(torch.from_numpy(ks).transpose(0, 1))
            v[:n].copy_(torch.from_numpy(vs).transpose(0, 1))

    def identity(self) -> str:
        weights = f"{self.quant}+gguf-blocks" if self.carried_layers else self.quant
        if self.products is not None:
            weights += f"+{self.products}-products"
        return f"{self._digest}:torch:{weights}:float32:{self.device.type}"


class _DecodeGraph:
    """One decode step captured as a CUDA graph over static input, position and context-length
    buffers: the Triton decode kernel over the pools' every block, bounded by the length."""

    def __init__(self, model: LlamaModel, kv: list[KVCache], device: torch.device):
        self.ids = torch.zeros(1, dtype=torch.int64, device=device)
        self.position = torch.zeros(1, dtype=torch.int64, device=device)  # also the KV slot: slot = position
        self.context_len = torch.ones(1, dtype=torch.int64, device=device)
        num_blocks, kv_heads = kv[0][0].shape[0], kv[0][0].shape[2]
        table = torch.arange(num_blocks, device=device)[None, :]
        plan = DecodePlan.per_row(table, self.context_len,
                                  splits=splits_for(1, kv_heads, num_blocks, launch_programs(device)))
        step = TritonAttentionStep(TritonAttentionMetadata(self.position, 1, plan, None))
        self.graph, self.logits = capture(lambda: model.logits(model(self.ids, self.position, kv, step)), device)
        for k, v in kv:  # the warm-up wrote garbage at position 0
            k.zero_()
            v.zero_()

    def replay(self, token: int, position: int) -> torch.Tensor:
        self.ids.fill_(token)
        self.position.fill_(position)
        self.context_len.fill_(position + 1)
        self.graph.replay()
        return self.logits[0].cpu()
