"""Build the configured batch-1 backend (the one place that knows every kind)."""

from __future__ import annotations

from pathlib import Path

import torch

from edged.backends.base import Batch1Backend
from shared.model.checkpoint import Checkpoint


def make_backend(kind: str, quant: str, checkpoint: Checkpoint, model_path: Path, max_len: int,
                 threads: int = 2, device: str = "cpu", cuda_graph: bool = True,
                 products: str = "auto") -> Batch1Backend:
    """``onnx``: the model exported (once, cached beside it) and run by ONNX Runtime, on the
    CUDA or TensorRT provider when ``device`` is cuda and they are installed. ``torch``: the
    engine's model over a dense buffer, on a GPU with the Triton kernels and (``cuda_graph``)
    its decode step replayed as a CUDA graph; int4 from a GGUF takes its quantized blocks as
    they are. ``products``: the precision of the int4 block kernels' products on a CPU
    (``kernels.block_products.PRODUCTS``; the ONNX graph's, ``edged.export.export_onnx``)."""
    from edged.export import model_hash

    if kind == "onnx":
        from edged.backends.onnx_backend import OnnxBackend, pick_providers
        from edged.export import export_onnx

        target = "cuda" if device == "cuda" else "cpu"
        export = export_onnx(model_path, quant, target=target, products=products)
        return OnnxBackend(export, max_len=max_len, threads=threads, providers=pick_providers(target))
    if kind == "torch":
        from edged.backends.torch_backend import TorchBackend

        if device == "cpu":
            torch.set_num_threads(threads)
        gguf = Path(model_path) if Path(model_path).suffix == ".gguf" else None
        return TorchBackend(checkpoint, max_len, quant=quant, device=device, model_digest=model_hash(Path(model_path)),
                            cuda_graph=cuda_graph, blocks_from=gguf, products=products)
    raise ValueError(f"backend kind {kind!r}: must be 'onnx' or 'torch'")
