// x @ W^T for a 4-bit weight in Q4_1 form (per group of 32 input columns a scale and a minimum:
// w = scale * code + minimum), float activations, for the few rows of a batch-1 forward; and the
// weight dequantized to float32 [N, K], for a prefill's plain GEMM.
//
//   x         [M, K] float32, contiguous; K a multiple of 32
//   packed    [N, K / 2] uint8, contiguous: byte j of a row holds column 2j's code in its low
//             nibble and column 2j+1's in its high nibble (kernels.triton_int4_matmul.Int4Weight)
//   scales    [N, K / 32] float32, contiguous
//   minimums  [N, K / 32] float32, contiguous
//   returns   [M, N] float32
//
// Each weight is read once per call and widened to float in registers (scale * code + minimum),
// never dequantized into a float copy in memory. A row's result is computed by the same
// operations in the same order whatever M is, so a row of a multi-token forward equals the
// one-token forward of that row bit for bit. Measured on a 2-core AVX2 EPYC, 2 threads: a
// 576 x 1536 projection 60-95 us for one row (ONNX Runtime's float-activation MatMulNBits
// 118-140 us), then ~37 us a further row.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowTile = 4;    // rows of x sharing one widening of a group's codes (2 FMA chains a row)
constexpr int64_t kOutBlock = 16;  // outputs whose weights stay in L1 while every row tile passes them

// x's columns reordered within each group as the codes are stored: the 16 even columns (low
// nibbles), then the 16 odd ones (high nibbles).
void reorder_columns(const float* x, int64_t rows, int64_t k, float* reordered) {
  const int64_t groups = k / kGroup;
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* in = x + m * k + g * kGroup;
      float* out = reordered + m * k + g * kGroup;
      for (int64_t j = 0; j < kGroup / 2; ++j) {
        out[j] = in[2 * j];
        out[kGroup / 2 + j] = in[2 * j + 1];
      }
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
inline float horizontal_sum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline __m256 widen8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }

// Output n of rows [m_begin, m_begin + Tile) of x (Tile a constant: the accumulators stay in registers).
template <int64_t Tile>
void output_tile(const uint8_t* packed, const float* scales, const float* minimums, const float* reordered,
                 int64_t m_begin, int64_t k, int64_t n_total, int64_t n, float* y) {
  const int64_t groups = k / kGroup;
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  const uint8_t* w = packed + n * (k / 2);
  const float* s = scales + n * groups;
  const float* lows = minimums + n * groups;
  // two accumulators a row: the even and odd columns' products, independent FMA chains
  __m256 even[Tile], odd[Tile];
  for (int64_t r = 0; r < Tile; ++r) even[r] = odd[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * (kGroup / 2)));
    const __m128i lo = _mm_and_si128(bytes, low_nibbles);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles);
    const __m256 scale = _mm256_set1_ps(s[g]), minimum = _mm256_set1_ps(lows[g]);
    // the group's weights, columns in the reordered order
    const __m256 w0 = _mm256_fmadd_ps(widen8(lo), scale, minimum);
    const __m256 w1 = _mm256_fmadd_ps(widen8(_mm_srli_si128(lo, 8)), scale, minimum);
    const __m256 w2 = _mm256_fmadd_ps(widen8(hi), scale, minimum);
    const __m256 w3 = _mm256_fmadd_ps(widen8(_mm_srli_si128(hi, 8)), scale, minimum);
    for (int64_t r = 0; r < Tile; ++r) {
      const float* xg = reordered + (m_begin + r) * k + g * kGroup;
      even[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xg), even[r]);
      even[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), even[r]);
      odd[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), odd[r]);
      odd[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), odd[r]);
    }
  }
  for (int64_t r = 0; r < Tile; ++r) {
    const int64_t m = m_begin + r;
    y[(m_begin + r) * n_total + n] = horizontal_sum(_mm256_add_ps(even[r], odd[r]));
  }
}

// One group of output n's weights in column order, widened: scale * code + minimum.
void dequantize_group(const uint8_t* bytes16, float scale, float minimum, float* out) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes16));
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, low_nibbles);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles);
  const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);  // columns 0-15, 16-31
  const __m256 s = _mm256_set1_ps(scale), m = _mm256_set1_ps(minimum);
  _mm256_storeu_ps(out, _mm256_fmadd_ps(widen8(first), s, m));
  _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(widen8(_mm_srli_si128(first, 8)), s, m));
  _mm256_storeu_ps(out + 16, _mm256_fmadd_ps(widen8(second), s, m));
  _mm256_storeu_ps(out + 24, _mm256_fmadd_ps(widen8(_mm_srli_si128(second, 8)), s, m));
}
#else
// Portable form: the same products, group by group.
template <int64_t Tile>
void output_tile(const uint8_t* packed, const float* scales, const float* minimums, const float* reordered,
                 int64_t m_begin, int64_t k, int64_t n_total, int64_t n, float* y) {
  const int64_t groups = k / kGroup;
  const uint8_t* w = packed + n * (k / 2);
  for (int64_t r = 0; r < Tile; ++r) {
    const int64_t m = m_begin + r;
    float acc = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = reordered + m * k + g * kGroup;
      const float scale = scales[n * groups + g], minimum = minimums[n * groups + g];
      for (int64_t j = 0; j < kGroup / 2; ++j) {
        const uint8_t byte = w[g * (kGroup / 2) + j];
        acc += (scale * static_cast<float>(byte & 0x0F) + minimum) * xg[j] +
               (scale * static_cast<float>(byte >> 4) + minimum) * xg[kGroup / 2 + j];
      }
    }
    y[m * n_total + n] = acc;
  }
}

void dequantize_group(const uint8_t* bytes16, float scale, float minimum, float* out) {
  for (int64_t j = 0; j < kGroup / 2; ++j) {
    out[2 * j] = scale * static_cast<float>(bytes16[j] & 0x0F) + minimum;
    out[2 * j + 1] = scale * static_cast<float>(bytes16[j] >> 4) + minimum;
  }
}
#endif

}  // namespace

namespace {

// The weight's tensors as int4_matmul and int4_dequantize take them, for K columns.
void check_weight(const torch::Tensor& packed, const torch::Tensor& scales, const torch::Tensor& minimums,
                  int64_t k) {
  TORCH_CHECK(k % kGroup == 0, "K must be a multiple of ", kGroup, ", got ", k);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  packed.size(1) == k / 2 && packed.device().is_cpu(),
              "packed: [N, K / 2] uint8, contiguous, on the CPU");
  for (const auto& t : {scales, minimums}) {
    TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat && t.is_contiguous() &&
                    t.size(0) == packed.size(0) && t.size(1) == k / kGroup && t.device().is_cpu(),
                "scales and minimums: [N, K / 32] float32, contiguous, on the CPU");
  }
}

}  // namespace

torch::Tensor int4_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor minimums) {
  TORCH_CHECK(packed.dim() == 2, "packed: [N, K / 2] uint8");
  const int64_t n_total = packed.size(0), k = 2 * packed.size(1), groups = k / kGroup;
  check_weight(packed, scales, minimums, k);
  auto w = torch::empty({n_total, k}, scales.options());
  const uint8_t* bytes = packed.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const float* mins = minimums.data_ptr<float>();
  float* out = w.data_ptr<float>();
  at::parallel_for(0, n_total, kOutBlock, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t n = n_begin; n < n_end; ++n) {
      for (int64_t g = 0; g < groups; ++g) {
        dequantize_group(bytes + n * (k / 2) + g * (kGroup / 2), s[n * groups + g], mins[n * groups + g],
                         out + n * k + g * kGroup);
      }
    }
  });
  return w;
}

torch::Tensor int4_matmul(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor minimums) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x: [M, K] float32, contiguous, on the CPU");
  const int64_t rows = x.size(0), k = x.size(1);
  check_weight(packed, scales, minimums, k);
  const int64_t n_total = packed.size(0);
  auto y = torch::empty({rows, n_total}, x.options());
  if (rows == 0 || n_total == 0) return y;
  std::vector<float> reordered(rows * k);
  reorder_columns(x.data_ptr<float>(), rows, k, reordered.data());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const float* mins = minimums.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const float* xr = reordered.data();
  // NOTE: outputs in blocks of 16 (also the grain: both cores busy on a 576-output projection),
  // row tiles within: a block's weights stay in L1 while every row tile passes them
  at::parallel_for(0, n_total, kOutBlock, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t block = n_begin; block < n_end; block += kOutBlock) {
      const int64_t block_end = std::min(block + kOutBlock, n_end);
      int64_t m = 0;
      for (; m + kRowTile <= rows; m += kRowTile) {
        for (int64_t n = block; n < block_end; ++n) output_tile<kRowTile>(w, s, mins, xr, m, k, n_total, n, out);
      }
      for (int64_t n = block; n < block_end; ++n) {
        switch (rows - m) {
          case 3: output_tile<3>(w, s, mins, xr, m, k, n_total, n, out); break;
          case 2: output_tile<2>(w, s, mins, xr, m, k, n_total, n, out); break;
          case 1: output_tile<1>(w, s, mins, xr, m, k, n_total, n, out); break;
          default: break;
        }
      }
    }
  });
  return y;
}
