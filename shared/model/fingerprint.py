"""A model's fingerprint: what distinguishes its weights from another checkpoint's of the same
shape, cheaply (KV saved by one model must never be read as another's)."""

from __future__ import annotations

import hashlib

import torch

SAMPLE = 256  # values read from each end of every tensor


def weights_fingerprint(model: torch.nn.Module) -> bytes:
    """A 16-byte digest of every parameter's and buffer's name, shape and dtype, and of its first
    and last ``SAMPLE`` values: a fine-tune or another quantization changes them, and the digest
    costs microseconds per tensor instead of a read of every weight."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        ends = torch.cat([flat[:SAMPLE], flat[-SAMPLE:]]).to("cpu", torch.float32)
        digest.update(ends.numpy().tobytes())
    return digest.digest()
