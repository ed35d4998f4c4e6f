// x @ W^T for the few rows of a small engine step (a token and its grammar drafts, a short
// prompt) on the AMX tiles, or where the CPU has no AMX in AVX-512 BF16 vectors over the same
// layout, for a weight kept in 4- or 8-bit codes with a scale and minimum per
// `group` input columns of each output (w = scale * code + minimum): a GGUF's
// K-quant blocks as they are (Q4_K: 4-bit codes, groups of 32; Q6_K: 6-bit codes as bytes,
// groups of 16), so a step reads a quarter to a half of the bf16 weight's bytes.
//
//   x         [M, K] bfloat16, contiguous; K a multiple of 32
//   codes     [N / 16, K / 32, 16, 16 * bits / 4] uint8: one B tile's codes per 16 outputs and
//             32 columns, a tile row (a column pair r) a row: element e (0-31) of row r is the
//             weight of output e / 2 (e < 16) or 8 + (e - 16) / 2 (e >= 16), column 2r + e % 2.
//             4 bits: byte i holds element i in its low nibble and element 16 + i in its high
//             one; 8 bits: one element a byte (kernels.tile_quant_matmul_cpu.TileQuantWeight)
//   scales    a group's scale and minimum, factored as K-quants store them: int8 factors per
//             group, group_scales and group_minimums [N / 16, K / group, 16] (output block,
//             column group, output in the block), times float32 ones per super-group of
//             super_columns columns, super_scales and super_minimums [N / 16, K / super_columns,
//             16]: scale = super_scale * group_scale, minimum = super_minimum * group_minimum
//             (Q4_K: d * sc and -dmin * m; Q6_K: d * sc and -32 d * sc). A tenth of the bytes of
//             float32 scales and minimums per group, which were a third of what a step read.
//   bias      [N] bfloat16 or absent
//   returns   [M, N] bfloat16
//
// Per 16 outputs and one group of columns, the codes become the bf16 values 128 + code (exact
// below 128: one OR) in an L1 buffer, one TDPBF16PS sums them against up to 16 rows of x in
// float32, and the group's sums are scaled in vectors: sum(x w) = scale * sum(x (128 + code)) +
// (minimum - 128 scale) * sum(x). So the products are the exact weights' (no bf16 rounding of
// scale * code + minimum), up to float32 rounding, and the matrix unit does them: the cost is
// one widening a weight whatever M is, so the time barely grows with the rows. The codes are
// widened two groups ahead and the sums scaled two behind, so neither a tile load nor the
// vector reads of a tile store wait on stores still in flight. Bit-identical results for a row
// whatever rows come with it. Measured in docs/engine-speed.md.
//
// Without AMX (an AMD EPYC with AVX-512 BF16), the same layout feeds VDPBF16PS: a tile row is 16
// outputs' column pair, which is what one vector's 16 float32 lanes sum (lane o: x[2r] w[o, 2r] +
// x[2r+1] w[o, 2r+1]) against the row's pair of x broadcast. The codes are widened in registers,
// once per 8 rows of x, and each row's group sums are scaled as above. The vectors' arithmetic
// grows with every row where the tiles' barely does, so this path beats the dense bf16 products
// only for the fewest rows (at most 8: kernels/tile_quant_matmul_cpu.py's MAX_ROWS, measured in
// docs/engine-speed.md). Bit-identical for a row whatever rows come with it here too.

#include "amx_tiles.h"
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kOuts = 16;   // outputs a B tile holds
constexpr int64_t kCols = 32;   // columns a B tile holds (16 pairs)
constexpr int64_t kRows = 16;   // rows of x a tile holds
constexpr int64_t kVectorRows = 8;  // rows of x the vector path sums at once (its registers: two a row)

#if defined(__AVX512BF16__)
constexpr bool kVectorBuilt = true;
constexpr int64_t kCodeBias = 128;  // bf16 bits 0x4300 | q stand for 128 + q exactly, for q < 128

// Tile rows r and r + 1 of a group's codes as bf16 (128 + code), 32 values a row.
// 4 bits: 32 bytes, byte i of a row holding element i (low nibble) and 16 + i (high nibble);
// 8 bits: a row's 32 bytes, read one row at a time.
template <int Bits>
inline void widen_two_rows(const uint8_t* codes, __m512i& row0, __m512i& row1) {
  const __m512i bias = _mm512_set1_epi16(0x4300);
  if constexpr (Bits == 4) {
    const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
    const __m512i low = _mm512_ternarylogic_epi32(words, _mm512_set1_epi16(0x0F), bias, 0xEA);  // (w & 15) | bias
    const __m512i high = _mm512_or_si512(_mm512_srli_epi16(words, 4), bias);
    // 128-bit lanes: low = [row r 0-7, 8-15 | row r+1 0-7, 8-15], high the same for elements 16-31
    row0 = _mm512_shuffle_i64x2(low, high, 0x44);
    row1 = _mm512_shuffle_i64x2(low, high, 0xEE);
  } else {
    const auto widen = [&](const uint8_t* row) {
      return _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row))), bias);
    };
    row0 = widen(codes);
    row1 = widen(codes + 32);
  }
}

// A group's scales and minimums as factors (see the header), read in place.
struct GroupScales {
  const int8_t* group_scales;
  const int8_t* group_minimums;
  const float* super_scales;
  const float* super_minimums;
  int64_t groups_per_super;

  // block b's 16 outputs' scale and minimum in group g of `groups`
  void of(int64_t b, int64_t g, int64_t groups, __m512& scale, __m512& minimum) const {
    const int64_t at = (b * groups + g) * kOuts;
    const int64_t super_at = (b * (groups / groups_per_super) + g / groups_per_super) * kOuts;
    scale = _mm512_mul_ps(_mm512_loadu_ps(super_scales + super_at), widen_factors(group_scales + at));
    minimum = _mm512_mul_ps(_mm512_loadu_ps(super_minimums + super_at), widen_factors(group_minimums + at));
  }

  static __m512 widen_factors(const int8_t* factors) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(factors))));
  }
};

// Each row's sum of x over each group of columns, in float32: [rows, K / group].
std::vector<float> group_sums(const at::BFloat16* x, int64_t rows, int64_t k, int64_t group) {
  std::vector<float> out(rows * (k / group));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < k / group; ++g) {
      float sum = 0.f;
      for (int64_t j = 0; j < group; ++j) sum += static_cast<float>(x[r * k + g * group + j]);
      out[r * (k / group) + g] = sum;
    }
  }
  return out;
}

// One row's 16 outputs of block b (float32 sums, plus the bias where given) as bf16 into y_row.
inline void store_outputs(__m512 sums, const at::BFloat16* bias, int64_t b, at::BFloat16* y_row) {
  if (bias != nullptr) {  // bf16 bits widened to float32: the high half of each lane
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + b * kOuts));
    sums = _mm512_add_ps(sums, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y_row + b * kOuts), (__m256i)_mm512_cvtneps_pbh(sums));
}

// Outputs of blocks [b_begin, b_end) for Rows rows of x from m0, in vectors; x_sums [Rows, K /
// group]: each row's sum over each group of columns. Per 16 outputs, each row's sums over a
// group in a register (128 + code as the weights), scaled into its accumulator at the group's end.
template <int Bits, int Rows>
void vector_block_range(const at::BFloat16* x, int64_t m0, int64_t k, const float* x_sums, const uint8_t* codes,
                        const GroupScales& scales, int64_t group, const at::BFloat16* bias, int64_t n,
                        int64_t b_begin, int64_t b_end, at::BFloat16* y) {
  constexpr int64_t row_bytes = kOuts * Bits / 4;  // a tile row's codes
  const int64_t groups = k / group, pair_rows = group / 2;
  // x as column pairs: row m's pair p is one 32-bit word
  const int32_t* pairs = reinterpret_cast<const int32_t*>(x + m0 * k);
  const int64_t pairs_per_row = k / 2;
  for (int64_t b = b_begin; b < b_end; ++b) {
    const uint8_t* block_codes = codes + b * (k / kCols) * 16 * row_bytes;
    __m512 acc[Rows];
    for (int m = 0; m < Rows; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512 sums[Rows];
      for (int m = 0; m < Rows; ++m) sums[m] = _mm512_setzero_ps();
      for (int64_t r = 0; r < pair_rows; r += 2) {
        __m512i row0, row1;
        widen_two_rows<Bits>(block_codes + (g * pair_rows + r) * row_bytes, row0, row1);
        const int64_t p = g * pair_rows + r;
        for (int m = 0; m < Rows; ++m) {
          const int32_t* row_pairs = pairs + m * pairs_per_row + p;
          sums[m] = _mm512_dpbf16_ps(sums[m], (__m512bh)row0, (__m512bh)_mm512_set1_epi32(row_pairs[0]));
          sums[m] = _mm512_dpbf16_ps(sums[m], (__m512bh)row1, (__m512bh)_mm512_set1_epi32(row_pairs[1]));
        }
      }
      __m512 scale, minimum;
      scales.of(b, g, groups, scale, minimum);
      const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(kCodeBias), scale, minimum);
      for (int m = 0; m < Rows; ++m) {
        acc[m] = _mm512_fmadd_ps(sums[m], scale, acc[m]);
        acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x_sums[m * groups + g]), offset, acc[m]);
      }
    }
    for (int m = 0; m < Rows; ++m) store_outputs(acc[m], bias, b, y + (m0 + m) * n);
  }
}

// A vector_block_range for 1 to kVectorRows rows.
template <int Bits>
void vector_rows(int64_t rows, const at::BFloat16* x, int64_t m0, int64_t k, const float* x_sums,
                 const uint8_t* codes, const GroupScales& scales, int64_t group, const at::BFloat16* bias, int64_t n,
                 int64_t b_begin, int64_t b_end, at::BFloat16* y) {
  using Range = void (*)(const at::BFloat16*, int64_t, int64_t, const float*, const uint8_t*, const GroupScales&,
                         int64_t, const at::BFloat16*, int64_t, int64_t, int64_t, at::BFloat16*);
  static constexpr Range by_rows[kVectorRows] = {
      vector_block_range<Bits, 1>, vector_block_range<Bits, 2>, vector_block_range<Bits, 3>,
      vector_block_range<Bits, 4>, vector_block_range<Bits, 5>, vector_block_range<Bits, 6>,
      vector_block_range<Bits, 7>, vector_block_range<Bits, 8>};
  by_rows[rows - 1](x, m0, k, x_sums, codes, scales, group, bias, n, b_begin, b_end, y);
}
#else
constexpr bool kVectorBuilt = false;
#endif

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr bool kTilesBuilt = true;

// Outputs of blocks [b_begin, b_end) for rows [m0, m0 + rows) of x; x_sums [rows, K / group]:
// each row's sum over each group of columns.
template <int Bits>
void block_range(const at::BFloat16* x, int64_t m0, int64_t rows, int64_t k, const float* x_sums,
                 const uint8_t* codes, const GroupScales& scales, int64_t group, const at::BFloat16* bias, int64_t n,
                 int64_t b_begin, int64_t b_end, at::BFloat16* y) {
  constexpr int64_t row_bytes = kOuts * Bits / 4;  // a tile row's codes
  const int64_t groups = k / group, pair_rows = group / 2;
  // tile registers: 0 and 4 a group's sums [rows x 16 outputs] float32 (128 + code as the
  // weights), 1 and 5 x [rows x group columns], 2 and 3 the codes as bf16 [group / 2 column
  // pairs x 16 outputs x 2]: two groups at a time on their own tiles. The codes are widened
  // two groups ahead and a group's sums scaled two groups behind, so the stores a tile load
  // reads, and the tile stores the vector code reads, have long landed.
  AmxTileConfig config;
  for (int tile : {0, 4}) config.shape(tile, rows, kOuts * 4);
  for (int tile : {1, 5}) config.shape(tile, rows, group * 2);
  for (int tile : {2, 3}) config.shape(tile, pair_rows, 64);
  _tile_loadconfig(&config);
  alignas(64) at::BFloat16 widened[4][16 * 32];
  alignas(64) float sums[4][kRows * kOuts];
  alignas(64) float acc[kRows * kOuts];
  for (int64_t b = b_begin; b < b_end; ++b) {
    std::fill(acc, acc + rows * kOuts, 0.f);
    const uint8_t* block_codes = codes + b * (k / kCols) * 16 * row_bytes;
    const auto widen = [&](int64_t g) {
      if (g >= groups) return;
      for (int64_t r = 0; r < pair_rows; r += 2) {
        __m512i row0, row1;
        widen_two_rows<Bits>(block_codes + (g * pair_rows + r) * row_bytes, row0, row1);
        _mm512_store_si512(reinterpret_cast<__m512i*>(widened[g & 3] + r * 32), row0);
        _mm512_store_si512(reinterpret_cast<__m512i*>(widened[g & 3] + (r + 1) * 32), row1);
      }
    };
    // w = scale * code + minimum: sum(x w) = scale * sum(x (128 + code)) + (minimum - 128 scale) * sum(x)
    const auto add_group = [&](int64_t g) {
      __m512 scale, minimum;
      scales.of(b, g, groups, scale, minimum);
      const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(kCodeBias), scale, minimum);
      for (int64_t r = 0; r < rows; ++r) {
        __m512 a = _mm512_fmadd_ps(_mm512_load_ps(sums[g & 3] + r * kOuts), scale, _mm512_load_ps(acc + r * kOuts));
        a = _mm512_fmadd_ps(_mm512_set1_ps(x_sums[r * groups + g]), offset, a);
        _mm512_store_ps(acc + r * kOuts, a);
      }
    };
    widen(0);
    widen(1);
    int64_t g = 0;
    for (; g + 1 < groups; g += 2) {
      widen(g + 2);
      _tile_zero(0);
      _tile_loadd(1, x + m0 * k + g * group, k * sizeof(at::BFloat16));
      _tile_loadd(2, widened[g & 3], 64);
      _tile_dpbf16ps(0, 1, 2);
      widen(g + 3);
      _tile_zero(4);
      _tile_loadd(5, x + m0 * k + (g + 1) * group, k * sizeof(at::BFloat16));
      _tile_loadd(3, widened[(g + 1) & 3], 64);
      _tile_dpbf16ps(4, 5, 3);
      if (g >= 2) {
        add_group(g - 2);
        add_group(g - 1);
      }
      _tile_stored(0, sums[g & 3], kOuts * sizeof(float));
      _tile_stored(4, sums[(g + 1) & 3], kOuts * sizeof(float));
    }
    if (g < groups) {  // an odd count's last group
      _tile_zero(0);
      _tile_loadd(1, x + m0 * k + g * group, k * sizeof(at::BFloat16));
      _tile_loadd(2, widened[g & 3], 64);
      _tile_dpbf16ps(0, 1, 2);
      _tile_stored(0, sums[g & 3], kOuts * sizeof(float));
      add_group(g);
    }
    for (int64_t pending = std::max<int64_t>(0, g - 2); pending < g; ++pending) add_group(pending);
    for (int64_t r = 0; r < rows; ++r) store_outputs(_mm512_load_ps(acc + r * kOuts), bias, b, y + (m0 + r) * n);
  }
  _tile_release();
}

#else
constexpr bool kTilesBuilt = false;
#endif

}  // namespace

bool tile_quant_matmul_on_tiles() { return kTilesBuilt && amx_tiles_usable(); }

bool tile_quant_matmul_usable() { return kVectorBuilt || tile_quant_matmul_on_tiles(); }

torch::Tensor tile_quant_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor group_scales,
                                torch::Tensor group_minimums, torch::Tensor super_scales, torch::Tensor super_minimums,
                                int64_t bits, int64_t group, int64_t super_columns, std::optional<torch::Tensor> bias,
                                bool vectors) {
  TORCH_CHECK(tile_quant_matmul_usable(), "tile_quant_matmul: this CPU or build has neither AMX tiles nor AVX-512 BF16");
  TORCH_CHECK_VALUE(bits == 4 || bits == 8, "tile_quant_matmul: bits must be 4 or 8, got ", bits);
  TORCH_CHECK_VALUE(group == 16 || group == 32, "tile_quant_matmul: group must be 16 or 32, got ", group);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous() && x.device().is_cpu(),
                    "tile_quant_matmul: x must be [M, K] bfloat16, contiguous, on the CPU");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK_VALUE(k % kCols == 0, "tile_quant_matmul: K must be a multiple of 32, got ", k);
  TORCH_CHECK_VALUE(codes.dim() == 4 && codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() &&
                        codes.size(1) == k / kCols && codes.size(2) == 16 && codes.size(3) == kOuts * bits / 4,
                    "tile_quant_matmul: codes must be [N / 16, K / 32, 16, ", kOuts * bits / 4, "] uint8, contiguous");
  const int64_t blocks = codes.size(0), n = blocks * kOuts;
  TORCH_CHECK_VALUE(super_columns % group == 0 && k % super_columns == 0,
                    "tile_quant_matmul: super_columns must be a multiple of group dividing K, got ", super_columns);
  for (const auto& t : {group_scales, group_minimums}) {
    TORCH_CHECK_VALUE(t.dim() == 3 && t.scalar_type() == torch::kChar && t.is_contiguous() && t.size(0) == blocks &&
                          t.size(1) == k / group && t.size(2) == kOuts,
                      "tile_quant_matmul: group_scales and group_minimums must be [N / 16, K / group, 16] int8, "
                      "contiguous");
  }
  for (const auto& t : {super_scales, super_minimums}) {
    TORCH_CHECK_VALUE(t.dim() == 3 && t.scalar_type() == torch::kFloat && t.is_contiguous() && t.size(0) == blocks &&
                          t.size(1) == k / super_columns && t.size(2) == kOuts,
                      "tile_quant_matmul: super_scales and super_minimums must be [N / 16, K / super_columns, 16] "
                      "float32, contiguous");
  }
  const at::BFloat16* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == torch::kBFloat16 &&
                          bias->is_contiguous(),
                      "tile_quant_matmul: bias must be [N] bfloat16, contiguous");
    bias_data = bias->data_ptr<at::BFloat16>();
  }
  auto y = torch::empty({m, n}, x.options());
#if defined(__AVX512BF16__)
  const at::BFloat16* xd = x.data_ptr<at::BFloat16>();
  const std::vector<float> x_sums = group_sums(xd, m, k, group);
  at::BFloat16* yd = y.data_ptr<at::BFloat16>();
  const uint8_t* cd = codes.data_ptr<uint8_t>();
  const GroupScales scales{group_scales.data_ptr<int8_t>(), group_minimums.data_ptr<int8_t>(),
                           super_scales.data_ptr<float>(), super_minimums.data_ptr<float>(), super_columns / group};
  const bool tiles = !vectors && tile_quant_matmul_on_tiles();
  const int64_t rows_at_once = tiles ? kRows : kVectorRows;
  // NOTE: blocks in grains of 8 (128 outputs): a 1,536-output projection still splits over the cores
  at::parallel_for(0, blocks, 8, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t m0 = 0; m0 < m; m0 += rows_at_once) {
      const int64_t rows = std::min(rows_at_once, m - m0);
      const float* sums = x_sums.data() + m0 * (k / group);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (tiles) {
        (bits == 4 ? block_range<4> : block_range<8>)(xd, m0, rows, k, sums, cd, scales, group, bias_data, n,
                                                      b_begin, b_end, yd);
        continue;
      }
#endif
      (bits == 4 ? vector_rows<4> : vector_rows<8>)(rows, xd, m0, k, sums, cd, scales, group, bias_data, n, b_begin,
                                                    b_end, yd);
    }
  });
#endif
  return y;
}
