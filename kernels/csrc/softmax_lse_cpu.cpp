// Softmax of attention scores in place, over each row's visible keys, with the log-sum-exp.
//
//   scores   [batch, rows, keys] float32 | bfloat16 | float16, contiguous; on return the
//            probabilities softmax(scale * scores) over keys [0, visible[r]) and zeros after
//   visible  [rows] int64, each in [1, keys]: row r (in every batch) sees its first visible[r] keys
//   returns  lse [batch, rows] float32: log-sum-exp of each row's visible scaled scores
//
// The middle of attention computed as two GEMMs (scores = q k^T, out = probs v): one pass reads
// a row into float32 and takes its max, one takes exp and the sum, one writes the normalized
// probabilities back in the scores' dtype, all within the row (in L1). A causal mask is a
// visible count per row, so no mask tensor is built or read.

#include "cpu_kernels.h"
#include "cpu_math.h"

#include <ATen/Parallel.h>

#include <limits>
#include <vector>

namespace {

// One row: probabilities in place over its first n of keys scores, zeros after; returns its lse.
template <typename T>
float softmax_row(T* s, int64_t n, int64_t keys, float scale, float* x) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t j = 0; j < n; ++j) {
    x[j] = fleetserve::load(s, j) * scale;
    top = std::max(top, x[j]);
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    x[j] = fleetserve::exp_nonpositive(x[j] - top);
    sum += x[j];
  }
  const float inv = 1.f / sum;
  for (int64_t j = 0; j < n; ++j) s[j] = static_cast<T>(x[j] * inv);
  std::fill(s + n, s + keys, static_cast<T>(0.f));
  return top + std::log(sum);
}

#if defined(__AVX512BF16__)
// The bf16 row 16 lanes at a time: widened on load, rounded back by the CPU's bf16 conversion.
template <>
float softmax_row<at::BFloat16>(at::BFloat16* s, int64_t n, int64_t keys, float scale, float* x) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 top_v = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = j + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 v = _mm512_mul_ps(_mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, s + j)), scale_v);
    _mm512_mask_storeu_ps(x + j, m, v);
    top_v = _mm512_mask_max_ps(top_v, m, top_v, v);
  }
  const float top = _mm512_reduce_max_ps(top_v);
  __m512 sum_v = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = j + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(m, fleetserve::exp_nonpositive(
        _mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), _mm512_set1_ps(top))));
    _mm512_mask_storeu_ps(x + j, m, e);
    sum_v = _mm512_add_ps(sum_v, e);
  }
  const float sum = _mm512_reduce_add_ps(sum_v);
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  for (int64_t j = 0; j < keys; j += 16) {  // past n, x is not read: the lanes are zeroed
    const __mmask16 m = j + 16 <= keys ? 0xFFFF : static_cast<__mmask16>((1u << (keys - j)) - 1);
    const __mmask16 live = j >= n ? 0 : j + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 p = _mm512_maskz_mul_ps(live, _mm512_maskz_loadu_ps(live, x + j), inv);
    _mm256_mask_storeu_epi16(s + j, m, (__m256i)_mm512_cvtneps_pbh(p));
  }
  return top + std::log(sum);
}
#endif

template <typename T>
void softmax_rows(T* scores, const int64_t* visible, float* lse, int64_t batch, int64_t rows, int64_t keys,
                  float scale) {
  at::parallel_for(0, batch * rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(keys + 16);
    for (int64_t i = begin; i < end; ++i)
      lse[i] = softmax_row(scores + i * keys, visible[i % rows], keys, scale, row.data());
  });
}

}  // namespace

torch::Tensor softmax_lse_(torch::Tensor scores, torch::Tensor visible, double scale) {
  TORCH_CHECK(scores.device().is_cpu() && visible.device().is_cpu(), "softmax_lse_: CPU tensors only");
  TORCH_CHECK(scores.dim() == 3 && scores.is_contiguous(), "softmax_lse_: scores must be [batch, rows, keys], contiguous");
  TORCH_CHECK(visible.scalar_type() == torch::kInt64 && visible.dim() == 1 && visible.size(0) == scores.size(1),
              "softmax_lse_: visible must be int64 [rows]");
  visible = visible.contiguous();
  TORCH_CHECK(visible.numel() == 0 || (visible.min().item<int64_t>() >= 1 && visible.max().item<int64_t>() <= scores.size(2)),
              "softmax_lse_: every row must see between 1 and keys keys");
  auto lse = torch::empty({scores.size(0), scores.size(1)}, scores.options().dtype(torch::kFloat32));
  auto run = [&](auto element) {
    using T = decltype(element);
    softmax_rows<T>(scores.data_ptr<T>(), visible.data_ptr<int64_t>(), lse.data_ptr<float>(), scores.size(0),
                    scores.size(1), scores.size(2), static_cast<float>(scale));
  };
  fleetserve::dispatch_float_dtype(scores.scalar_type(), "softmax_lse_", run);
  return lse;
}
