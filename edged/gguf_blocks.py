"""A GGUF tensor's quantized blocks as ONNX Runtime's MatMulNBits stores them, unchanged.

MatMulNBits computes each weight as ``(code - zero_point) * scale`` per block of ``BLOCK``
weights along a row. llama.cpp's block formats map onto it exactly:

- **Q4_0** (scale ``d``, 4-bit ``q``: ``w = d * (q - 8)``): 4-bit codes, scale ``d``, the
  default zero point 8 (no zero-point input);
- **Q4_1** (scale ``d``, minimum ``m``: ``w = d * q + m``): 4-bit codes, scale ``d``, the
  default zero point 8, and a per-block **offset** ``m + 8 d`` added to every weight of the
  block: ``x . w = (x . (q - 8) d) + offset * sum(x over the block)``, the second term a small
  float matmul beside the kernel (``edged.carry_blocks``). (A float zero point ``-m / d`` is
  exact too, but ONNX Runtime's CPU kernel then runs ten times slower: 13 tok/s against 140.)
- **Q8_0** (``w = d * q``, ``q`` signed): 8-bit codes ``q + 128``, scale ``d``, zero point 128.

Other formats return None (the export then keeps the builder's own quantization of them).
llama.cpp packs a 4-bit block as ``qs[j] = q[j] | q[j + 16] << 4``; MatMulNBits as consecutive
pairs ``q[2i] | q[2i + 1] << 4``: ``BlockWeight.packed`` repacks.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

BLOCK = 32  # weights per block: llama.cpp's Q4_0/Q4_1/Q8_0 and the export's MatMulNBits
Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class BlockWeight:
    """A [N, K] weight: ``(codes - zero_points) * scales`` per block of ``BLOCK`` along K."""

    bits: int  # 4 or 8
    codes: np.ndarray  # [N, K] uint8, unsigned codes
    scales: np.ndarray  # [N, K // BLOCK] float32
    zero_points: np.ndarray | None  # [N, K // BLOCK] uint8 (Q8_0: 128); None: the 4-bit default 8
    offsets: np.ndarray | None = None  # [N, K // BLOCK] float32 added to each weight (Q4_1), or None

    def dequantize(self) -> np.ndarray:  # [N, K] float32
        n, k = self.codes.shape
        zero = np.float32(8) if self.zero_points is None else self.zero_points.astype(np.float32)[..., None]
        blocks = (self.codes.reshape(n, -1, BLOCK).astype(np.float32) - zero) * self.scales[..., None]
        if self.offsets is not None:
            blocks += self.offsets[..., None]
        return blocks.reshape(n, k)

    def minimums(self) -> np.ndarray:  # [N, K // BLOCK] float32
        """Each block's ``m`` in the form ``w = scales * codes + m``: the offset (0 without one)
        less the zero point's ``scales * zero_point`` (for Q4_1 exactly its ``m``)."""
        zero = np.float32(8) if self.zero_points is None else self.zero_points.astype(np.float32)
        offsets = np.float32(0) if self.offsets is None else self.offsets
        return (offsets - zero * self.scales).astype(np.float32)

    def packed(self) -> np.ndarray:  # [N, K // BLOCK, BLOCK * bits // 8] uint8, MatMulNBits' B
        n, k = self.codes.shape
        codes = self.codes if self.bits == 8 else self.codes[:, 0::2] | (self.codes[:, 1::2] << 4)
        return np.ascontiguousarray(codes.reshape(n, k // BLOCK, -1))

    def rows(self, order: np.ndarray) -> BlockWeight:
        """The same weight with its rows (output features) taken in ``order``."""
        return BlockWeight(self.bits, self.codes[order], self.scales[order],
                           None if self.zero_points is None else self.zero_points[order],
                           None if self.offsets is None else self.offsets[order])

    @staticmethod
    def stack(parts: list[BlockWeight]) -> BlockWeight:
        """Weights of one format stacked along their rows (q, k and v as one qkv projection)."""
        kinds = {(p.bits, p.zero_points is None, p.offsets is None) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack weights of different formats: {sorted(map(str, kinds))}")

        def rows(field: str) -> np.ndarray | None:
            values = [getattr(p, field) for p in parts]
            return None if values[0] is None else np.concatenate(values)
        return BlockWeight(parts[0].bits, rows("codes"), rows("scales"), rows("zero_points"), rows("offsets"))


def block_weight(kind: gguf.GGMLQuantizationType, data: np.ndarray) -> BlockWeight | None:
    """The blocks of a 2-D GGUF tensor (``data``: [N, row bytes] uint8), or None for a format
    MatMulNBits cannot take as it is."""
    if kind not in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        return None
    n = data.shape[0]
    blocks = data.reshape(n, -1, gguf.GGML_QUANT_SIZES[kind][1])
    scales = _f16(blocks[..., 0:2])
    if kind == Q.Q8_0:
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return BlockWeight(8, codes.reshape(n, -1), scales, np.full(scales.shape, 128, np.uint8))
    qs = blocks[..., 4:] if kind == Q.Q4_1 else blocks[..., 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)  # q[j], then q[j + 16]
    if kind == Q.Q4_0:
        return BlockWeight(4, codes, scales, None)
    return BlockWeight(4, codes, scales, None, offsets=_f16(blocks[..., 2:4]) + 8 * scales)


def _f16(pairs: np.ndarray) -> np.ndarray:
    """[..., 2] little-endian float16 bytes -> [...] float32."""
    return np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32)
