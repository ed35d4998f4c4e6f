"""The ONNX Runtime batch-1 backend: a genai-builder graph (GroupQueryAttention over a shared,
preallocated KV buffer) driven by plain ``onnxruntime.InferenceSession`` with IO binding.

The KV buffers are ours: one ``[1, kv_heads, max_len, head_dim]`` torch tensor per layer for K and
for V, bound by pointer as both ``past_key_values.i.*`` and ``present.i.*`` on every step, so GQA
writes the new positions in place and nothing is copied per step. ``save_kv``/``load_kv`` are slice
copies of those tensors. Logits come back to the caller's sampler as a ``[vocab]`` float32 tensor.
A graph whose manifest says it runs fleetserve's ``BlockMatMul`` (``kernels.ort_ops``) gets that
library registered with its session, and torch's intra-op threads (which run those products)
set to the backend's ``threads``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from edged.backends.base import QUANTS, KVSnapshot
from edged.graph_edits import KEEP_INPUT

_ONNX_DTYPES = {"tensor(float)": (np.float32, torch.float32), "tensor(float16)": (np.float16, torch.float16)}
_GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")


class OnnxBackend:
    """One sequence's K/V for positions ``0 .. max_len-1`` and a builder graph that extends it.

    ``model`` is an export directory (``edged.export.export_onnx``) or its ``model.onnx``.
    ``providers`` None picks: TensorRT then CUDA when the export targets cuda and ORT has them,
    else CPU. ``threads`` is ORT's intra-op pool size; its threads sleep between ops unless
    ``spinning`` (a few % faster on idle reserved cores, much slower on a shared CPU).
    Raises ValueError when ``max_len`` exceeds the model's context, ImportError without onnxruntime.
    """

    name = "onnx"

    def __init__(self, model: Path | str, max_len: int = 2048, threads: int = 2,
                 providers: Sequence[str] | None = None, spinning: bool = False) -> None:
        import onnxruntime as ort

        model = Path(model).expanduser()
        self.model_dir = model.parent if model.suffix == ".onnx" else model
        genai = json.loads((self.model_dir / "genai_config.json").read_text())["model"]
        decoder = genai["decoder"]
        manifest = _read_manifest(self.model_dir)
        key = manifest.get("key", {})
        if max_len <= 0 or max_len > genai["context_length"]:
            raise ValueError(f"max_len={max_len}: must be in 1..{genai['context_length']} (the model's context)")
        self.max_len = max_len
        self.vocab_size: int = genai["vocab_size"]
        self.quant: str = key.get("quant", "none")
        assert self.quant in QUANTS, self.quant
        # NOTE: int8 activations (edged.graph_edits) turn the rounding differences between GQA's
        # one-token and multi-token paths into up to ~1 logit; multi-token forwards agree with
        # each other bit for bit, whatever the rows' positions.
        self.row_exact = self.quant in ("none", "int4")
        self.products: str | None = key.get("products")  # BlockMatMul's (edged.export)
        self.num_layers: int = decoder["num_hidden_layers"]
        self.kv_heads: int = decoder["num_key_value_heads"]
        self.head_dim: int = decoder["head_size"]
        self._model_hash = key.get("model_sha256") or _file_hash(self.model_dir / "model.onnx")

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # NOTE: spinning workers steal the core from the robot's other processes and, when they are
        # preempted, stall every op's barrier; measured in docs/edged.md.
        spin = "1" if spinning else "0"
        options.add_session_config_entry("session.intra_op.allow_spinning", spin)
        options.add_session_config_entry("session.inter_op.allow_spinning", spin)
        if key.get("block_ops") is not None:
            _load_block_ops(options, self.model_dir)
            torch.set_num_threads(threads)  # the ops' products run on torch's intra-op threads
        chosen = list(providers) if providers is not None else pick_providers(key.get("target", "cpu"))
        self.session = ort.InferenceSession(str(self.model_dir / decoder["filename"]), options, providers=chosen)
        self.providers: tuple[str, ...] = tuple(self.session.get_providers())
        on_gpu = self.providers[0] in _GPU_PROVIDERS
        self.device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
        self._ort_device = "cuda" if on_gpu else "cpu"

        inputs = {i.name: i for i in self.session.get_inputs()}
        self._np_dtype, self.dtype = _ONNX_DTYPES[inputs["past_key_values.0.key"].type]
        logits_out = next(o for o in self.session.get_outputs() if o.name == "logits")
        self._logits_np_dtype, logits_dtype = _ONNX_DTYPES[logits_out.type]
        # which rows of logits the graph returns: as many as asked (edged.graph_edits), the last, or all
        self._rows = ("chosen" if KEEP_INPUT in inputs else
                      "all" if logits_out.shape[1] == "sequence_length" else "last")

        shape = (1, self.kv_heads, max_len, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self._logits_1 = torch.empty((1, 1, self.vocab_size), dtype=logits_dtype, device=self.device)
        self._logits_dtype = logits_dtype
        self._binding = self.session.io_binding()
        self._bind_kv()

    def forward(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """Logits ``[vocab]`` float32 (CPU) of the last of ``token_ids`` placed at ``start``; writes their K/V.

        Raises ValueError for empty ``token_ids``, ``start < 0``, ``start + len > max_len`` or an id
        outside the vocabulary.
        """
        return self._run(token_ids, start, 1)[0]

    def forward_rows(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """Logits ``[len(token_ids), vocab]`` float32 (CPU), one row per token; as ``forward``
        otherwise. Raises ValueError on a graph that returns the last token's logits only."""
        return self._run(token_ids, start, len(token_ids))

    def _run(self, token_ids: Sequence[int], start: int, rows: int) -> torch.Tensor:
        """The logits of the last ``rows`` of ``token_ids`` ``[rows, vocab]`` float32 on the CPU."""
        n = len(token_ids)
        if n == 0:
            raise ValueError("token_ids: must not be empty")
        if start < 0 or start + n > self.max_len:
            raise ValueError(f"start={start} + {n} tokens: must fit in max_len={self.max_len}")
        ids = np.asarray(token_ids, dtype=np.int64).reshape(1, n)  # [1, n] int64
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"token_ids: ids must be in 0..{self.vocab_size - 1}")
        if self._rows == "last" and rows > 1:
            raise ValueError(f"{self.model_dir}: this graph returns the last token's logits only (export it again)")
        # | positions 0 .. start-1: K/V already in the buffer | start .. start+n-1: written now |
        # NOTE: GQA reads the past length from the mask's length, so the mask covers all of it.
        mask = np.ones((1, start + n), dtype=np.int64)  # [1, total_len] int64
        binding = self._binding
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("attention_mask", mask)
        if self._rows == "chosen":
            binding.bind_cpu_input(KEEP_INPUT, np.array([rows], dtype=np.int64))
        computed = n if self._rows == "all" else rows
        logits = self._logits_1 if computed == 1 else torch.empty(
            (1, computed, self.vocab_size), dtype=self._logits_dtype, device=self.device)  # [1, computed, vocab]
        binding.bind_output("logits", self._ort_device, 0, self._logits_np_dtype, list(logits.shape),
                            logits.data_ptr())
        self.session.run_with_iobinding(binding)
        return logits[0, computed - rows:].float().cpu().clone()

    def save_kv(self, length: int) -> KVSnapshot:
        """A float32 host copy of the K/V of positions ``0 .. length-1``."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length={length}: must be in 0..{self.max_len}")
        return KVSnapshot(
            length=length,
            keys=tuple(_host_copy(k[0, :, :length]) for k in self.keys),
            values=tuple(_host_copy(v[0, :, :length]) for v in self.values),
        )

    def load_kv(self, snapshot: KVSnapshot) -> None:
        """Overwrite positions ``0 .. snapshot.length-1`` with ``snapshot``; later positions are left as they were."""
        n = snapshot.length
        if n > self.max_len or len(snapshot.keys) != self.num_layers or len(snapshot.values) != self.num_layers:
            raise ValueError(f"snapshot of {n} positions x {len(snapshot.keys)} layers does not fit this backend")
        for buffers, arrays in ((self.keys, snapshot.keys), (self.values, snapshot.values)):
            for buffer, array in zip(buffers, arrays):
                buffer[0, :, :n].copy_(torch.from_numpy(array))

    def identity(self) -> str:
        quant = self.quant if self.products is None else f"{self.quant}+{self.products}-products"
        return f"onnx:{self._model_hash[:16]}:{quant}:{self.dtype}:{','.join(self.providers)}"

    def _bind_kv(self) -> None:
        """Bind each layer's buffer as both past and present: GQA's shared-buffer mode writes in place."""
        shape = [1, self.kv_heads, self.max_len, self.head_dim]
        for i in range(self.num_layers):
            for kind, buffer in (("key", self.keys[i]), ("value", self.values[i])):
                ptr = buffer.data_ptr()
                self._binding.bind_input(f"past_key_values.{i}.{kind}", self._ort_device, 0, self._np_dtype, shape, ptr)
                self._binding.bind_output(f"present.{i}.{kind}", self._ort_device, 0, self._np_dtype, shape, ptr)


def _load_block_ops(options, model_dir: Path) -> None:
    """Register fleetserve's ONNX Runtime ops (``kernels.ort_ops``) for a graph that uses them;
    ValueError where the library cannot be built here."""
    from kernels.ort_ops import ort_ops_library

    library = ort_ops_library()
    if library is None:
        raise ValueError(f"{model_dir}: the graph runs fleetserve's ONNX Runtime ops, which cannot be built here "
                         "(a C++ compiler is needed); export the model again")
    options.register_custom_ops_library(str(library))


def pick_providers(target: str) -> list[str]:
    """TensorRT, then CUDA, then CPU for a cuda export where ORT offers them; CPU otherwise."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if target == "cuda" and "CUDAExecutionProvider" in available:
        return [p for p in (*_GPU_PROVIDERS, "CPUExecutionProvider") if p in available]
    return ["CPUExecutionProvider"]


def _host_copy(t: torch.Tensor) -> np.ndarray:
    # NOTE: .copy() even on CPU float32, where .numpy() is a view of the live buffer.
    return t.float().cpu().numpy().copy()  # [kv_heads, length, head_dim] float32, C-contiguous


def _read_manifest(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


def _file_hash(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()
