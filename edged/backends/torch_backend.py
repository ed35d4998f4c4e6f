"""The torch batch-1 backend: the engine's own model over a dense KV buffer.

On a GPU the one-token decode step is captured once as a CUDA graph at start-up and replayed
(static input ids, position and buffer; ``kernels.dense_attention`` keeps every shape fixed).
On CPU the same code runs eagerly. Weights can be int8 or int4 (``edged.backends.quantize``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from edged.backends.base import KVSnapshot
from kernels.dense_attention import DenseAttentionStep
from shared.model.checkpoint import Checkpoint
from shared.model.llama import LlamaModel, build_model
from edged.backends.quantize import quantize_linears


class TorchBackend:
    name = "torch"

    def __init__(self, checkpoint: Checkpoint, max_len: int, quant: str = "none", device: str = "cpu",
                 model_digest: str = "", cuda_graph: bool = True):
        cfg = checkpoint.config
        self.quant = quant
        self.max_len = max_len
        self.vocab_size = cfg.vocab_size
        self.device = torch.device(device)
        self._digest = model_digest
        self.model: LlamaModel = quantize_linears(build_model(cfg, checkpoint.weights).to(self.device), quant)
        shape = (max_len, cfg.num_kv_heads, cfg.head_dim)
        # NOTE: one buffer per layer (see shared.engine.runner): slices of one big tensor get
        # copied whole under torch.compile and CUDA graphs replay them fine either way.
        self.kv = [(torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device))
                   for _ in range(cfg.num_layers)]
        self._graph: _DecodeGraph | None = None
        if self.device.type == "cuda" and cuda_graph:
            self._graph = _DecodeGraph(self.model, self.kv, self.device)

    @property
    def uses_cuda_graph(self) -> bool:
        return self._graph is not None

    def forward(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        n = len(token_ids)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if start < 0 or start + n > self.max_len:
            raise ValueError(f"positions {start}..{start + n - 1} do not fit the KV buffer of {self.max_len}")
        if n == 1 and self._graph is not None:
            return self._graph.replay(token_ids[0], start)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        positions = torch.arange(start, start + n, device=self.device)
        hidden = self.model(ids, positions, self.kv, DenseAttentionStep(positions, start + n))
        return self.model.logits(hidden[-1:])[0].cpu()

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
        return f"{self._digest}:torch:{self.quant}:float32:{self.device.type}"


class _DecodeGraph:
    """One decode step captured as a CUDA graph over static input, position and KV buffers."""

    def __init__(self, model: LlamaModel, kv: list, device: torch.device):
        self.ids = torch.zeros(1, dtype=torch.int64, device=device)
        self.position = torch.zeros(1, dtype=torch.int64, device=device)
        step = DenseAttentionStep(self.position, end=0, static_len=True)

        def run() -> torch.Tensor:
            return model.logits(model(self.ids, self.position, kv, step))

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: allocator and kernel selection before capture
                run()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = run()
        for k, v in kv:  # the warm-up wrote garbage at position 0
            k.zero_()
            v.zero_()

    def replay(self, token: int, position: int) -> torch.Tensor:
        self.ids.fill_(token)
        self.position.fill_(position)
        self.graph.replay()
        return self.logits[0].cpu()
