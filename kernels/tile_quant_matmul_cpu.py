"""Few-row products on the AMX tiles over a weight kept in its GGUF's K-quant codes
(``csrc/tile_quant_matmul_cpu.cpp``).

A small engine step (a plan's token with its grammar drafts: 1-16 rows) reads every weight
once and does little arithmetic with it, so its time is the weights' bytes: on a 2-core Xeon the
1.5B's bf16 projections stream at ~20 GB/s, ~130 ms a step. Kept as the GGUF holds them (Q4_K:
4-bit codes with a scale and minimum per 32 columns; Q6_K: 6-bit codes, a scale per 16), the
same weights are a quarter to a half of those bytes. ``TileQuantWeight`` holds them in the
order the kernel widens them into the matrix unit's B tiles; ``tile_quant_matmul`` multiplies,
by the exact weights ``scale * code + minimum`` (a model that dequantized the GGUF to bf16 holds
them rounded), up to float32 rounding.

Needs the CPU kernels built with AMX and the tiles granted (``tile_quant_matmul_usable``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_extension import cpu_kernels

OUTPUTS_PER_TILE = 16
COLUMNS_PER_TILE = 32
GROUPS = (16, 32)  # columns sharing one scale and minimum
BITS = (4, 8)
# codes the kernel widens exactly: it stands code c for the bf16 value 128 + c, exact below 128,
# so 8-bit codes take 7 bits (a Q6_K's 6 do)
CODE_LIMITS = {4: 16, 8: 128}


def tile_quant_matmul_usable() -> bool:
    """Whether this build and process have the kernel (AMX built and granted)."""
    module = cpu_kernels()
    return module is not None and module.tile_quant_matmul_usable()


@dataclass(frozen=True)
class TileQuantWeight:
    """A [N, K] weight ``scale * code + minimum`` per ``group`` columns of each output, its codes
    in B-tile order (see the kernel's header): ``codes`` [N / 16, K / 32, 16, 16 * bits / 4] uint8,
    ``scales`` and ``minimums`` [N / 16, K / group, 16] float32."""

    codes: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor
    bits: int
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        blocks, col_tiles = self.codes.shape[:2]
        return blocks * OUTPUTS_PER_TILE, col_tiles * COLUMNS_PER_TILE

    @staticmethod
    def from_codes(codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor, bits: int,
                   group: int) -> "TileQuantWeight":
        """From codes [N, K] (integers in ``[0, CODE_LIMITS[bits])``) and ``scales``/``minimums``
        [N, K / group]; ValueError where N is not a multiple of 16, K of 32, a code is out of
        range, or bits/group unsupported."""
        n, k = codes.shape
        if bits not in BITS or group not in GROUPS:
            raise ValueError(f"bits must be one of {BITS} and group one of {GROUPS}, got {bits}, {group}")
        if n % OUTPUTS_PER_TILE or k % COLUMNS_PER_TILE or not scales.shape == minimums.shape == (n, k // group):
            raise ValueError(f"codes [N, K] with N % 16 == 0 and K % 32 == 0 and scales/minimums [N, K / {group}], "
                             f"got codes {tuple(codes.shape)}, scales {tuple(scales.shape)}, "
                             f"minimums {tuple(minimums.shape)}")
        limit = CODE_LIMITS[bits]
        if codes.numel() and (int(codes.max()) >= limit or int(codes.min()) < 0):
            raise ValueError(f"{bits}-bit codes must be in [0, {limit}), got [{int(codes.min())}, {int(codes.max())}]")
        blocks = n // OUTPUTS_PER_TILE
        # element e of tile row r: output e // 2 of the block, column 2r + e % 2 of the tile
        elements = codes.to(torch.uint8).view(blocks, OUTPUTS_PER_TILE, k // COLUMNS_PER_TILE, 16, 2)
        elements = elements.permute(0, 2, 3, 1, 4).reshape(blocks, k // COLUMNS_PER_TILE, 16, 32)
        if bits == 4:  # element i in the low nibble, element 16 + i in the high one
            elements = elements[..., :16] | (elements[..., 16:] << 4)

        def by_block(values: torch.Tensor) -> torch.Tensor:
            return values.float().view(blocks, OUTPUTS_PER_TILE, -1).transpose(1, 2).contiguous()

        return TileQuantWeight(elements.contiguous(), by_block(scales), by_block(minimums), bits, group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] weight the kernel multiplies by (before its bf16 rounding), in ``dtype``."""
        blocks, col_tiles = self.codes.shape[:2]
        if self.bits == 4:
            elements = torch.cat([self.codes & 0x0F, self.codes >> 4], dim=-1)
        else:
            elements = self.codes
        codes = elements.view(blocks, col_tiles, 16, OUTPUTS_PER_TILE, 2).permute(0, 3, 1, 2, 4)
        codes = codes.reshape(blocks * OUTPUTS_PER_TILE, col_tiles * COLUMNS_PER_TILE).float()

        def by_output(values: torch.Tensor) -> torch.Tensor:
            per_output = values.transpose(1, 2).reshape(blocks * OUTPUTS_PER_TILE, -1)
            return per_output.repeat_interleave(self.group, dim=1)

        return torch.addcmul(by_output(self.minimums), codes, by_output(self.scales)).to(dtype)


def tile_quant_matmul(x: torch.Tensor, weight: TileQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] bf16 times ``weight`` transposed, plus ``bias`` [N] bf16: [M, N] bf16."""
    return cpu_kernels().tile_quant_matmul(x.contiguous(), weight.codes, weight.scales, weight.minimums, weight.bits,
                                           weight.group, bias)
