"""A GGUF tensor's K-quant blocks as codes with a scale and minimum per group of columns, the form
``kernels.tile_quant_matmul_cpu.TileQuantWeight`` takes, without dequantizing anything:

- **Q4_K** (256 columns a super-block: fp16 ``d`` and ``dmin``, eight 6-bit scales ``sc`` and
  minimums ``m``, 4-bit codes ``q``): ``w = d sc q - dmin m``, so 4-bit codes with ``scale = d sc``
  and ``minimum = -dmin m`` per group of 32 columns;
- **Q6_K** (256 columns: sixteen int8 scales ``sc``, fp16 ``d``, 6-bit codes ``q``): ``w = d sc
  (q - 32)``, so the codes as bytes (0-63) with ``scale = d sc`` and ``minimum = -32 d sc`` per
  group of 16 columns.

Both are exact in float32 (an fp16 times a 6- or 8-bit integer). The scales stay factored as
the blocks hold them (an int8 per group, a float32 per 256 columns): a small step reads them with
the codes, and as float32 per group they were a third of its bytes. The bit layouts are llama.cpp's,
as gguf's dequantizers read them (``gguf.quants.Q4_K``, ``Q6_K``). Other types have no such form
here (``kquant_codes`` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
KQUANT_TYPES = (Q.Q4_K, Q.Q6_K)  # the types kquant_codes reads
SUPER_BLOCK = 256  # columns a K-quant block spans (its float16 scales')


@dataclass(frozen=True)
class KQuantCodes:
    """A [N, K] weight ``scales * codes + minimums`` per ``group`` columns of each row, the scales
    and minimums kept as the blocks hold them: int8 factors per group times float32 ones per
    super-block of ``SUPER_BLOCK`` columns (``kernels.tile_quant_matmul_cpu.GroupScales``)."""

    codes: np.ndarray  # [N, K] uint8, below 2 ** bits
    group_scales: np.ndarray  # [N, K // group] int8
    group_minimums: np.ndarray  # [N, K // group] int8
    super_scales: np.ndarray  # [N, K // SUPER_BLOCK] float32
    super_minimums: np.ndarray  # [N, K // SUPER_BLOCK] float32
    bits: int  # 4 or 8
    group: int  # 32 (Q4_K) or 16 (Q6_K)

    def dequantize(self) -> np.ndarray:  # [N, K] float32
        n, k = self.codes.shape

        def per_group(super_values: np.ndarray, factors: np.ndarray) -> np.ndarray:  # [N, K // group, 1]
            return (np.repeat(super_values, SUPER_BLOCK // self.group, axis=1) * factors.astype(np.float32))[..., None]

        grouped = self.codes.reshape(n, -1, self.group).astype(np.float32)
        scales, minimums = per_group(self.super_scales, self.group_scales), per_group(self.super_minimums,
                                                                                       self.group_minimums)
        return (grouped * scales + minimums).reshape(n, k)


def kquant_codes(kind: gguf.GGMLQuantizationType, data: np.ndarray) -> KQuantCodes | None:
    """``data`` [N, bytes a row] (a GGUF tensor's rows) of type ``kind`` as codes, scales and
    minimums; None for a type other than Q4_K and Q6_K."""
    if kind == Q.Q4_K:
        return _q4_k(data)
    if kind == Q.Q6_K:
        return _q6_k(data)
    return None


def _q4_k(data: np.ndarray) -> KQuantCodes:
    rows = data.shape[0]
    blocks = data.reshape(-1, gguf.GGML_QUANT_SIZES[Q.Q4_K][1])  # [N * K / 256, 144]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])  # [blocks, 8] each, 6-bit
    # 128 bytes of codes: four runs of 32, each the low nibbles of sub-block 2c, the high of 2c + 1
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & np.uint8(0x0F)).reshape(rows, -1)
    return KQuantCodes(codes, sc.astype(np.int8).reshape(rows, -1), m.astype(np.int8).reshape(rows, -1),
                       d.reshape(rows, -1), -dmin.reshape(rows, -1), bits=4, group=32)


def _q6_k(data: np.ndarray) -> KQuantCodes:
    rows = data.shape[0]
    blocks = data.reshape(-1, gguf.GGML_QUANT_SIZES[Q.Q6_K][1])  # [N * K / 256, 210]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = blocks[:, 192:208].copy().view(np.int8).reshape(rows, -1)  # [N, K / 16]
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32).reshape(rows, -1)  # [N, K / 256]
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(0x03)
    codes = (low.reshape(-1, 2, 4, 32) | (high.reshape(-1, 2, 4, 32) << np.uint8(4))).reshape(rows, -1)
    return KQuantCodes(codes, sc, sc, d, np.float32(-32) * d, bits=8, group=16)
