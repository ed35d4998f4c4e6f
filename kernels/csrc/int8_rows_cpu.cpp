// The two passes around an int8 GEMM (kernels/int8_linear.py), each one read of its input:
//
//   quantize_rows_int8   rows of activations as int8 codes with one scale a row: scale = the
//                        row's largest magnitude / 127 (1 for a row of zeros), code = x / scale
//                        rounded to nearest even. So |code| <= 127, and a row's largest value
//                        is exact.
//   scale_int32_rows     the GEMM's int32 sums back in the activations' dtype: sum * column
//                        scale * row scale (+ bias), in float32, rounded once to the output.
//
// torch's own ops take five passes over the [rows, columns] sums for the second (measured on a
// 2-core EPYC: 26 ms of an 86 ms product at 512 rows of Qwen2.5-1.5B's projections).
#include <ATen/Parallel.h>

#include "cpu_kernels.h"
#include "cpu_math.h"

namespace {

using fleetserve::load;

constexpr float kLargestCode = 127.f;
constexpr int64_t kColumnsPerTask = 512;  // the sums' columns one task scales

#ifdef FLEETSERVE_LOAD16
using fleetserve::live_lanes;
using fleetserve::load16;

inline void store16(float* p, __mmask16 live, __m512 v) { _mm512_mask_storeu_ps(p, live, v); }
inline void store16(at::Half* p, __mmask16 live, __m512 v) {
  _mm256_mask_storeu_epi16(p, live, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// float32 to bf16 rounded to nearest even in integer steps (AVX-512 BF16's VCVTNEPS2BF16 where
// built; the same result for the finite values stored here).
inline void store16(at::BFloat16* p, __mmask16 live, __m512 v) {
#ifdef __AVX512BF16__
  _mm256_mask_storeu_epi16(p, live, (__m256i)_mm512_cvtneps_pbh(v));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_mask_storeu_epi16(p, live, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
#endif
}
#endif

template <typename T>
float largest_magnitude(const T* row, int64_t n) {
#ifdef FLEETSERVE_LOAD16
  __m512 top = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load16(row + j, live_lanes(j, n))));
  return _mm512_reduce_max_ps(top);
#else
  float top = 0.f;
  for (int64_t j = 0; j < n; ++j) top = std::max(top, std::fabs(load(row, j)));
  return top;
#endif
}

template <typename T>
void quantize_row(const T* row, int64_t n, float scale, int8_t* codes) {
#ifdef FLEETSERVE_LOAD16
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 live = live_lanes(j, n);
    // the default rounding mode, nearest even; |x / scale| <= 127 (+ an ulp), so no saturation
    const __m512i rounded = _mm512_cvtps_epi32(_mm512_div_ps(load16(row + j, live), s));
    _mm_mask_storeu_epi8(codes + j, live, _mm512_cvtsepi32_epi8(rounded));
  }
#else
  for (int64_t j = 0; j < n; ++j) {
    codes[j] = static_cast<int8_t>(std::clamp(std::nearbyint(load(row, j) / scale), -kLargestCode, kLargestCode));
  }
#endif
}

template <typename T>
void scale_columns(const int32_t* sums, float row_scale, const float* column_scales, const T* bias, int64_t begin,
                   int64_t end, T* out) {
#ifdef FLEETSERVE_LOAD16
  const __m512 r = _mm512_set1_ps(row_scale);
  for (int64_t j = begin; j < end; j += 16) {
    const __mmask16 live = live_lanes(j, end);
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(live, sums + j)),
                                           _mm512_maskz_loadu_ps(live, column_scales + j)), r);
    if (bias != nullptr) y = _mm512_add_ps(y, load16(bias + j, live));
    store16(out + j, live, y);
  }
#else
  for (int64_t j = begin; j < end; ++j) {
    const float y = static_cast<float>(sums[j]) * column_scales[j] * row_scale;
    out[j] = static_cast<T>(bias != nullptr ? y + load(bias, j) : y);
  }
#endif
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> quantize_rows_int8(torch::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
              "quantize_rows_int8: x must be a contiguous [rows, columns] CPU tensor");
  const int64_t rows = x.size(0), cols = x.size(1);
  auto codes = torch::empty({rows, cols}, x.options().dtype(torch::kInt8));
  auto scales = torch::empty({rows}, x.options().dtype(torch::kFloat32));
  fleetserve::dispatch_float_dtype(x.scalar_type(), "quantize_rows_int8", [&](auto element) {
    using T = decltype(element);
    const T* data = x.data_ptr<T>();
    int8_t* out = codes.data_ptr<int8_t>();
    float* scale_out = scales.data_ptr<float>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float top = largest_magnitude(data + r * cols, cols);
        const float scale = top > 0.f ? top / kLargestCode : 1.f;
        quantize_row(data + r * cols, cols, scale, out + r * cols);
        scale_out[r] = scale;
      }
    });
  });
  return {codes, scales};
}

torch::Tensor scale_int32_rows(torch::Tensor sums, torch::Tensor row_scales, torch::Tensor column_scales,
                               std::optional<torch::Tensor> bias, c10::ScalarType dtype) {
  TORCH_CHECK(sums.device().is_cpu() && sums.dim() == 2 && sums.is_contiguous() && sums.scalar_type() == torch::kInt32,
              "scale_int32_rows: sums must be a contiguous [rows, columns] int32 CPU tensor");
  const int64_t rows = sums.size(0), cols = sums.size(1);
  TORCH_CHECK(row_scales.scalar_type() == torch::kFloat32 && row_scales.is_contiguous() && row_scales.numel() == rows,
              "scale_int32_rows: row_scales must be ", rows, " contiguous float32 values");
  TORCH_CHECK(column_scales.scalar_type() == torch::kFloat32 && column_scales.is_contiguous() &&
                  column_scales.numel() == cols,
              "scale_int32_rows: column_scales must be ", cols, " contiguous float32 values");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == cols,
                "scale_int32_rows: bias must be ", cols, " contiguous values of the output dtype");
  }
  auto out = torch::empty({rows, cols}, sums.options().dtype(dtype));
  fleetserve::dispatch_float_dtype(dtype, "scale_int32_rows", [&](auto element) {
    using T = decltype(element);
    const int32_t* in = sums.data_ptr<int32_t>();
    const float* r_scales = row_scales.data_ptr<float>();
    const float* c_scales = column_scales.data_ptr<float>();
    const T* b = bias ? bias->data_ptr<T>() : nullptr;
    T* y = out.data_ptr<T>();
    const int64_t tasks_per_row = (cols + kColumnsPerTask - 1) / kColumnsPerTask;
    at::parallel_for(0, rows * tasks_per_row, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t r = task / tasks_per_row, start = (task % tasks_per_row) * kColumnsPerTask;
        scale_columns(in + r * cols, r_scales[r], c_scales, b, start, std::min(cols, start + kColumnsPerTask),
                      y + r * cols);
      }
    });
  });
  return out;
}
