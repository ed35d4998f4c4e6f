"""Converted weights: a GGUF's model dequantized once into a dtype and kept on disk, so a restart
maps the converted file instead of dequantizing again.

Where: `model_cache_dir() / "converted"` (by default `~/.cache/fleetserve/models/converted/`),
one file per GGUF and dtype, `{gguf stem}.{dtype}.{key}.safetensors`: the model's own parameters
(q/k/v and gate/up fused, in that dtype) as a plain safetensors file. To clear it, delete the
folder or any file in it (`rm -r ~/.cache/fleetserve/models/converted`); the next load rebuilds
what it needs. Never edit a file in place: a loaded model's parameters are its pages.

The key hashes FORMAT_VERSION, the dtype and the GGUF's identity (size, mtime, first and last
MiB), so a replaced or touched GGUF gets a new file; the old one stays until deleted. A file is
used only when all of it checks: its size, its header exactly the model's (names, shapes, dtype,
offsets), and the crc32 of its data; a partial or corrupt file is ignored and written again.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch

from shared.config import model_cache_dir
from shared.model.checkpoint import Checkpoint, load_checkpoint
from shared.model.llama import LlamaModel, build_model, finish_model, meta_model
from shared.model.model_config import ModelConfig

log = logging.getLogger(__name__)

FORMAT = "fleetserve.converted-weights"
FORMAT_VERSION = 1  # bump when the conversion or the parameter layout changes
_METADATA = {"format": FORMAT, "version": str(FORMAT_VERSION)}  # a file's metadata, besides its crc32
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}  # safetensors' names
_SAMPLE = 1 << 20  # bytes hashed from each end of the GGUF
_ALIGN = 64  # the data starts on this boundary; a tensor that does not is copied, not mapped


def load_model(path: Path | str, dtype: torch.dtype, cache: bool = True) -> tuple[LlamaModel, Checkpoint]:
    """The model at ``path`` in ``dtype`` (``build_cached_model``) and its checkpoint
    (``load_checkpoint``: config, tokenizer, lazy weights)."""
    ckpt = load_checkpoint(path)
    return build_cached_model(ckpt, dtype, cache), ckpt


def build_cached_model(ckpt: Checkpoint, dtype: torch.dtype, cache: bool = True) -> LlamaModel:
    """``build_model(ckpt.config, ckpt.weights, dtype)``, ready to run on the CPU.

    A GGUF's model comes from its converted file when a valid one exists: its parameters then
    view the file's pages (copy-on-write), nothing dequantized or copied. Otherwise it is built
    from the GGUF and saved for next time; a failed save is logged, not raised. ``cache=False``
    neither reads nor writes converted files. A HF folder's model is always built.
    """
    if ckpt.source.suffix != ".gguf":
        return build_model(ckpt.config, ckpt.weights, dtype)
    file = converted_file(ckpt.source, dtype) if cache else None
    model = read_converted(file, ckpt.config, dtype) if file is not None else None
    if model is None:
        model = build_model(ckpt.config, ckpt.weights, dtype)
        if file is not None:
            try:
                write_converted(model, file)
            except OSError as e:
                log.warning("could not save the converted weights to %s: %s", file, e)
    model.gguf_source = ckpt.source
    return model


def converted_file(gguf_path: Path, dtype: torch.dtype) -> Path:
    """Where the model of ``gguf_path`` in ``dtype`` is kept (the file may not exist)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype}: converted weights are kept in {sorted(map(str, _DTYPES))} only")
    stat = gguf_path.stat()
    digest = hashlib.blake2b(f"{FORMAT_VERSION}:{dtype}:{stat.st_size}:{stat.st_mtime_ns}".encode(), digest_size=8)
    with open(gguf_path, "rb") as f:
        digest.update(f.read(_SAMPLE))
        f.seek(max(0, stat.st_size - _SAMPLE))
        digest.update(f.read(_SAMPLE))
    name = str(dtype).removeprefix("torch.")
    return model_cache_dir() / "converted" / f"{gguf_path.stem}.{name}.{digest.hexdigest()}.safetensors"


def write_converted(model: LlamaModel, file: Path) -> None:
    """Save ``model``'s parameters (one dtype, on the CPU) as ``file``, atomically: written to a
    temporary file beside it, renamed over it when complete. Raises OSError (the temporary file
    removed). NOTE: no fsync: a file a crash cut short fails the size or crc32 check."""
    params = _parameters(model)
    crc = 0
    for tensor in params.values():
        crc = zlib.crc32(_as_bytes(tensor), crc)
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_header(params, {**_METADATA, "crc32": str(crc)}))
            for tensor in params.values():
                f.write(_as_bytes(tensor))
        os.replace(temp, file)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def read_converted(file: Path, config: ModelConfig, dtype: torch.dtype) -> LlamaModel | None:
    """The model kept in ``file`` for ``config`` in ``dtype``, its parameters viewing the file's
    pages; None when there is no file or it fails a check (logged: the caller rebuilds it)."""
    try:
        with open(file, "rb") as f:
            pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        log.warning("ignoring converted weights %s: %s", file, e)
        return None
    model = meta_model(config, dtype)
    params = _parameters(model)
    problem = _problem(pages, params)
    if problem is not None:
        log.warning("ignoring converted weights %s: %s", file, problem)
        return None
    tensors, offset = {}, _data_start(pages)
    for name, param in params.items():
        tensor = torch.frombuffer(pages, dtype=dtype, count=param.numel(), offset=offset).view(param.shape)
        tensors[name] = tensor if offset % _ALIGN == 0 else tensor.clone()
        offset += _nbytes(param)
    model.load_state_dict(tensors, strict=False, assign=True)  # NOTE: a tied head is tied below
    model = finish_model(model)
    model.mapped_weights = MappedWeights(pages)
    return model


class MappedWeights:
    """The converted file's pages a model's parameters view (``read_converted``), so that a
    weight replaced by another form (``kernels.onednn_linear`` packs them) stops counting in the
    process's memory: ``release`` drops its pages, which a private mapping of an unchanged file
    can always read back (a later read of the old tensor faults them in again, same bytes)."""

    def __init__(self, pages: mmap.mmap):
        self._pages = pages
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(pages))

    def release(self, tensor: torch.Tensor) -> None:
        """Drop the whole pages inside ``tensor``'s bytes, if it views these pages (else nothing)."""
        start, end = tensor.data_ptr() - self._base, tensor.data_ptr() + _nbytes(tensor) - self._base
        if start < 0 or end > len(self._pages):
            return
        first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            self._pages.madvise(mmap.MADV_DONTNEED, first, last - first)


def _problem(pages: mmap.mmap, params: dict[str, torch.Tensor]) -> str | None:
    """Why ``pages`` is not exactly the converted file of ``params`` (their names, shapes and
    dtype, in order); None when it is."""
    if len(pages) < 8:
        return "shorter than a header"
    data_start = _data_start(pages)
    expected_size = data_start + sum(map(_nbytes, params.values()))
    if len(pages) != expected_size:
        return f"{len(pages)} bytes where its header says {expected_size}"
    try:
        header = json.loads(pages[8:data_start])
    except ValueError:
        return "its header is not JSON"
    metadata = header.pop("__metadata__", None) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or {key: metadata.get(key) for key in _METADATA} != _METADATA:
        return f"not a {FORMAT} file of version {FORMAT_VERSION}"
    if header != _entries(params):
        return "its tensors are not this model's parameters"
    if str(zlib.crc32(memoryview(pages)[data_start:])) != metadata.get("crc32"):
        return "its data fails its crc32"
    return None


def _parameters(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The model's parameters by name, a tied head once (as the embeddings)."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    assert all(p.is_contiguous() for p in params.values())
    return params


def _entries(params: dict[str, torch.Tensor]) -> dict[str, dict]:
    """safetensors header entries: the tensors back to back, in order."""
    entries, offset = {}, 0
    for name, tensor in params.items():
        entries[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + _nbytes(tensor)]}
        offset += _nbytes(tensor)
    return entries


def _header(params: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The length-prefixed JSON header, space-padded so the data starts on an _ALIGN boundary."""
    text = json.dumps({"__metadata__": metadata, **_entries(params)}).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)
    return struct.pack("<Q", len(text)) + text


def _data_start(pages: mmap.mmap) -> int:
    return 8 + struct.unpack_from("<Q", pages)[0]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:  # [nbytes] uint8, a view of the tensor
    return tensor.reshape(-1).view(torch.uint8).numpy()
