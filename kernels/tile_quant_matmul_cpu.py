"""Few-row products on the AMX tiles, or in AVX-512 BF16 vectors where the CPU has no AMX, over a
weight kept in its GGUF's K-quant codes (``csrc/tile_quant_matmul_cpu.cpp``).

A small engine step (a plan's token with its grammar drafts: 1-16 rows) reads every weight
once and does little arithmetic with it, so its time is the weights' bytes: on a 2-core Xeon the
1.5B's bf16 projections stream at ~20 GB/s, ~130 ms a step. Kept as the GGUF holds them (Q4_K:
4-bit codes with a scale and minimum per 32 columns; Q6_K: 6-bit codes, a scale per 16), the
same weights are a quarter to a half of those bytes. ``TileQuantWeight`` holds them in the
order the kernel widens them into the matrix unit's B tiles; ``tile_quant_matmul`` multiplies,
by the exact weights ``scale * code + minimum`` (a model that dequantized the GGUF to bf16 holds
them rounded), up to float32 rounding.

Two paths over the same layout (``PATHS``): ``tiles`` (a Xeon with AMX; the cost is one widening
of the codes whatever the rows) and ``vectors`` (VDPBF16PS, a CPU with AVX-512 BF16 and no AMX,
such as an AMD EPYC: its arithmetic grows with the rows, so it pays for the fewest:
``max_rows``). ``tile_quant_matmul_usable`` says whether either runs here.
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


PATHS = ("tiles", "vectors")
# the most rows a small step runs on the codes per path: the tiles' time barely grows with rows
# (16 is one tile of x); the vectors' grows with every row, past the dense products' at ~8-12
# rows of the 1.5B on a 2-core EPYC (docs/engine-speed.md)
MAX_ROWS = {"tiles": 16, "vectors": 8}


def tile_quant_matmul_usable() -> bool:
    """Whether this build and process have the kernel (AMX built and granted, or AVX-512 BF16)."""
    module = cpu_kernels()
    return module is not None and module.tile_quant_matmul_usable()


def tile_quant_paths() -> tuple[str, ...]:
    """The paths that run here, the default first: ``tiles`` where AMX is built and granted,
    ``vectors`` wherever the kernel runs (empty where it does not)."""
    if not tile_quant_matmul_usable():
        return ()
    return PATHS if cpu_kernels().tile_quant_matmul_on_tiles() else ("vectors",)


def max_rows() -> int:
    """The most rows a small step should run on the codes here (0 where the kernel does not run)."""
    paths = tile_quant_paths()
    return MAX_ROWS[paths[0]] if paths else 0


@dataclass(frozen=True)
class GroupScales:
    """Each group's scale and minimum of a [N, K] weight, factored as K-quants store them: int8
    factors per ``group`` columns (``group_scales``, ``group_minimums`` [N, K / group]) times
    float32 ones per ``super_columns`` (``super_scales``, ``super_minimums`` [N, K / super_columns]).
    Q4_K: ``d * sc`` and ``-dmin * m`` per 256 columns; Q6_K: ``d * sc`` and ``-32 d * sc``."""

    group_scales: torch.Tensor
    group_minimums: torch.Tensor
    super_scales: torch.Tensor
    super_minimums: torch.Tensor
    super_columns: int

    @staticmethod
    def of_floats(scales: torch.Tensor, minimums: torch.Tensor, group: int) -> "GroupScales":
        """Any float scales and minimums [N, K / group]: factors of 1, a super-group a group."""
        ones = torch.ones(scales.shape, dtype=torch.int8)
        return GroupScales(ones, ones, scales.float(), minimums.float(), group)

    def values(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales and minimums [N, K / group] in float32."""
        per_super = self.super_columns // group
        return (self.super_scales.repeat_interleave(per_super, 1) * self.group_scales.float(),
                self.super_minimums.repeat_interleave(per_super, 1) * self.group_minimums.float())


@dataclass(frozen=True)
class TileQuantWeight:
    """A [N, K] weight ``scale * code + minimum`` per ``group`` columns of each output, its codes
    in B-tile order (see the kernel's header): ``codes`` [N / 16, K / 32, 16, 16 * bits / 4] uint8;
    ``scales`` its ``GroupScales``, each tensor [N / 16, columns' groups, 16] (by output block)."""

    codes: torch.Tensor
    scales: GroupScales
    bits: int
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        blocks, col_tiles = self.codes.shape[:2]
        return blocks * OUTPUTS_PER_TILE, col_tiles * COLUMNS_PER_TILE

    @staticmethod
    def from_codes(codes: torch.Tensor, scales: torch.Tensor | GroupScales, minimums: torch.Tensor | None, bits: int,
                   group: int) -> "TileQuantWeight":
        """From codes [N, K] (integers in ``[0, CODE_LIMITS[bits])``) and float ``scales`` and
        ``minimums`` [N, K / group], or ``GroupScales`` (``minimums`` None); ValueError where N
        is not a multiple of 16, K of 32, a code is out of range, or bits, group or the scales'
        shapes do not fit."""
        n, k = codes.shape
        if bits not in BITS or group not in GROUPS:
            raise ValueError(f"bits must be one of {BITS} and group one of {GROUPS}, got {bits}, {group}")
        factored = scales if isinstance(scales, GroupScales) else GroupScales.of_floats(scales, minimums, group)
        supers = factored.super_columns
        if (n % OUTPUTS_PER_TILE or k % COLUMNS_PER_TILE or supers % group or k % supers
                or not factored.group_scales.shape == factored.group_minimums.shape == (n, k // group)
                or not factored.super_scales.shape == factored.super_minimums.shape == (n, k // supers)):
            raise ValueError(f"codes [N, K] with N % 16 == 0 and K % 32 == 0 and scales/minimums [N, K / {group}] "
                             f"(per super-group [N, K / {supers}]), got codes {tuple(codes.shape)}, group scales "
                             f"{tuple(factored.group_scales.shape)}, super scales {tuple(factored.super_scales.shape)}")
        limit = CODE_LIMITS[bits]
        if codes.numel() and (int(codes.max()) >= limit or int(codes.min()) < 0):
            raise ValueError(f"{bits}-bit codes must be in [0, {limit}), got [{int(codes.min())}, {int(codes.max())}]")
        blocks = n // OUTPUTS_PER_TILE
        # element e of tile row r: output e // 2 of the block, column 2r + e % 2 of the tile
        elements = codes.to(torch.uint8).view(blocks, OUTPUTS_PER_TILE, k // COLUMNS_PER_TILE, 16, 2)
        elements = elements.permute(0, 2, 3, 1, 4).reshape(blocks, k // COLUMNS_PER_TILE, 16, 32)
        if bits == 4:  # element i in the low nibble, element 16 + i in the high one
            elements = elements[..., :16] | (elements[..., 16:] << 4)

        def by_block(values: torch.Tensor) -> torch.Tensor:  # [N, G] -> [N / 16, G, 16]
            return values.view(blocks, OUTPUTS_PER_TILE, -1).transpose(1, 2).contiguous()

        by_blocks = GroupScales(by_block(factored.group_scales.to(torch.int8)),
                                by_block(factored.group_minimums.to(torch.int8)),
                                by_block(factored.super_scales.float()), by_block(factored.super_minimums.float()),
                                supers)
        return TileQuantWeight(elements.contiguous(), by_blocks, bits, group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] weight the kernel multiplies by, in ``dtype``."""
        blocks, col_tiles = self.codes.shape[:2]
        if self.bits == 4:
            elements = torch.cat([self.codes & 0x0F, self.codes >> 4], dim=-1)
        else:
            elements = self.codes
        codes = elements.view(blocks, col_tiles, 16, OUTPUTS_PER_TILE, 2).permute(0, 3, 1, 2, 4)
        codes = codes.reshape(blocks * OUTPUTS_PER_TILE, col_tiles * COLUMNS_PER_TILE).float()

        def by_output(values: torch.Tensor) -> torch.Tensor:  # [N / 16, G, 16] -> [N, G]
            return values.transpose(1, 2).reshape(blocks * OUTPUTS_PER_TILE, -1)

        per_output = GroupScales(*(by_output(t) for t in (self.scales.group_scales, self.scales.group_minimums,
                                                           self.scales.super_scales, self.scales.super_minimums)),
                                 self.scales.super_columns)
        scales, minimums = (v.repeat_interleave(self.group, dim=1) for v in per_output.values(self.group))
        return torch.addcmul(minimums, codes, scales).to(dtype)


def tile_quant_matmul(x: torch.Tensor, weight: TileQuantWeight, bias: torch.Tensor | None = None,
                      path: str | None = None) -> torch.Tensor:
    """``x`` [M, K] bf16 times ``weight`` transposed, plus ``bias`` [N] bf16: [M, N] bf16, on
    ``path`` (one of ``tile_quant_paths()``; None: the first)."""
    if path is not None and path not in tile_quant_paths():
        raise ValueError(f"path {path!r} does not run here; these do: {tile_quant_paths()}")
    scales = weight.scales
    return cpu_kernels().tile_quant_matmul(x.contiguous(), weight.codes, scales.group_scales, scales.group_minimums,
                                           scales.super_scales, scales.super_minimums, weight.bits, weight.group,
                                           scales.super_columns, bias, vectors=path == "vectors")
