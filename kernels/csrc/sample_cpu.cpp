// One token per row of a step's logits: greedy rows take their first largest value, sampled
// rows draw from softmax(x / temperature) by inverse CDF.
//
//   x             [rows, n] float32 | bfloat16 | float16, contiguous, no NaN (-inf: a masked token)
//   temperatures  [rows] float32: 0 for greedy, else > 0 with a finite 1 / temperature
//   uniforms      [rows] float32 in [0, 1): a sampled row's random number (greedy rows ignore it)
//   returns       [rows] int64: greedy, the smallest j with x_j == max x; sampled, the first j
//                 whose running sum of weights exceeds u times their total, where
//                 weight_j = exp((x_j - max x) / temperature), 0 below e^-87
//
// Greedy: torch's argmax over bf16 is a scalar loop on a CPU (21 ms for 256 x 49,152 logits,
// 3.6 ms by torch.max); here (with AVX-512) each lane keeps its own first maximum and index, 16
// values per step in four independent chains, and the lanes holding the row's maximum give the
// smallest index. Sampled: a token of weight 0 (masked, or e^-87 times less likely than the top one) is
// never drawn: the running sum does not grow there. A row without a finite value draws token 0.
// Three passes over a row held in float32 (in L2): its max, its weights with their sums per
// 16-token chunk, then a walk over the chunk sums and within the one chunk that holds the draw.
// torch's softmax, cumsum and searchsorted take several times as long, torch.multinomial longer.

#include "cpu_kernels.h"
#include "cpu_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kChunk = 16;

#if defined(FLEETSERVE_LOAD16)
constexpr int kChains = 4;  // independent chains of 16 lanes: one chain is a latency-bound loop
const __m512 kMinusInf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());

template <typename T>
int64_t first_argmax(const T* x, int64_t n) {
  __m512 top[kChains];
  __m512i top_index[kChains], index[kChains];
  for (int c = 0; c < kChains; ++c) {
    top[c] = kMinusInf;
    top_index[c] = _mm512_setzero_si512();
    index[c] = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                _mm512_set1_epi32(16 * c));
  }
  const __m512i step = _mm512_set1_epi32(16 * kChains);
  for (int64_t j = 0; j < n; j += 16 * kChains) {
    for (int c = 0; c < kChains; ++c) {
      const __mmask16 live = fleetserve::live_lanes(j + 16 * c, n);
      const __m512 v = _mm512_mask_mov_ps(kMinusInf, live, fleetserve::load16(x + j + 16 * c, live));
      const __mmask16 greater = _mm512_cmp_ps_mask(v, top[c], _CMP_GT_OQ);  // strict: a lane keeps its first
      top[c] = _mm512_mask_mov_ps(top[c], greater, v);
      top_index[c] = _mm512_mask_mov_epi32(top_index[c], greater, index[c]);
      index[c] = _mm512_add_epi32(index[c], step);
    }
  }
  float best = -std::numeric_limits<float>::infinity();
  for (int c = 0; c < kChains; ++c) best = std::max(best, _mm512_reduce_max_ps(top[c]));
  if (best == -std::numeric_limits<float>::infinity()) return 0;  // every value -inf: the first
  int64_t first = n;
  for (int c = 0; c < kChains; ++c) {
    const __mmask16 holders = _mm512_cmp_ps_mask(top[c], _mm512_set1_ps(best), _CMP_EQ_OQ);
    if (holders) first = std::min<int64_t>(first, _mm512_mask_reduce_min_epi32(holders, top_index[c]));
  }
  return first;
}

template <typename T>
float row_max(const T* x, int64_t n) {
  __m512 top[kChains] = {kMinusInf, kMinusInf, kMinusInf, kMinusInf};
  for (int64_t j = 0; j < n; j += 16 * kChains)
    for (int c = 0; c < kChains; ++c) {
      const __mmask16 live = fleetserve::live_lanes(j + 16 * c, n);
      top[c] = _mm512_mask_max_ps(top[c], live, top[c], fleetserve::load16(x + j + 16 * c, live));
    }
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(top[0], top[1]), _mm512_max_ps(top[2], top[3])));
}

// Weights of the row into w, the sum of each 16-token chunk into chunk_sums; returns the total.
template <typename T>
float weigh(const T* x, int64_t n, float top, float inv_temperature, float* w, float* chunk_sums) {
  const __m512 top_v = _mm512_set1_ps(top), inv_t = _mm512_set1_ps(inv_temperature);
  float total = 0.f;
  for (int64_t j = 0; j < n; j += kChunk) {
    const __mmask16 live = fleetserve::live_lanes(j, n);
    const __m512 a = _mm512_mul_ps(_mm512_sub_ps(fleetserve::load16(x + j, live), top_v), inv_t);
    const __mmask16 weighty = _mm512_mask_cmp_ps_mask(live, a, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
    const __m512 e = _mm512_maskz_mov_ps(weighty, fleetserve::exp_nonpositive(a));
    _mm512_storeu_ps(w + j, e);
    chunk_sums[j / kChunk] = _mm512_reduce_add_ps(e);
    total += chunk_sums[j / kChunk];
  }
  return total;
}
#else
template <typename T>
int64_t first_argmax(const T* x, int64_t n) {
  int64_t best = 0;
  float top = fleetserve::load(x, 0);
  for (int64_t j = 1; j < n; ++j) {
    const float v = fleetserve::load(x, j);
    if (v > top) {
      top = v;
      best = j;
    }
  }
  return best;
}

template <typename T>
float row_max(const T* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t j = 0; j < n; ++j) top = std::max(top, fleetserve::load(x, j));
  return top;
}

template <typename T>
float weigh(const T* x, int64_t n, float top, float inv_temperature, float* w, float* chunk_sums) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float a = (fleetserve::load(x, j) - top) * inv_temperature;
    w[j] = a >= -87.f ? fleetserve::exp_nonpositive(a) : 0.f;
  }
  float total = 0.f;
  for (int64_t c = 0; c * kChunk < n; ++c) {
    float sum = 0.f;
    for (int64_t j = c * kChunk; j < std::min(n, (c + 1) * kChunk); ++j) sum += w[j];
    chunk_sums[c] = sum;
    total += sum;
  }
  return total;
}
#endif

// Row x's token for uniform u; w holds the row's whole chunks, chunk_sums one float per chunk.
template <typename T>
int64_t draw_row(const T* x, int64_t n, float inv_temperature, float u, float* w, float* chunk_sums) {
  const float top = row_max(x, n);
  if (!(top > -std::numeric_limits<float>::infinity())) return 0;
  // (top - top) * inv_temperature is 0: inv_temperature is finite
  const float target = u * weigh(x, n, top, inv_temperature, w, chunk_sums);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  float running = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    if (running + chunk_sums[c] <= target) {
      running += chunk_sums[c];
      continue;
    }
    int64_t last = -1;  // the chunk's last token with weight, should rounding leave the target unmet
    for (int64_t j = c * kChunk; j < std::min(n, (c + 1) * kChunk); ++j) {
      if (w[j] == 0.f) continue;
      running += w[j];
      last = j;
      if (running > target) return j;
    }
    return last;
  }
  for (int64_t j = n - 1; j > 0; --j)  // u * total rounded up to the total: the last token with weight
    if (w[j] > 0.f) return j;
  return 0;
}

}  // namespace

torch::Tensor sample_rows(torch::Tensor x, torch::Tensor temperatures, torch::Tensor uniforms) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) >= 1, "sample_rows: a CPU tensor [rows, n], n >= 1");
  TORCH_CHECK(temperatures.scalar_type() == torch::kFloat32 && uniforms.scalar_type() == torch::kFloat32 &&
                  temperatures.dim() == 1 && uniforms.dim() == 1 && temperatures.size(0) == x.size(0) &&
                  uniforms.size(0) == x.size(0),
              "sample_rows: temperatures and uniforms are float32 [rows]");
  x = x.contiguous();
  temperatures = temperatures.contiguous();
  uniforms = uniforms.contiguous();
  const float* temps = temperatures.data_ptr<float>();
  const float* us = uniforms.data_ptr<float>();
  for (int64_t r = 0; r < x.size(0); ++r) {
    TORCH_CHECK(temps[r] == 0.f || (temps[r] > 0.f && std::isfinite(1.f / temps[r])),
                "sample_rows: temperature ", temps[r], " is neither 0 (greedy) nor positive with a finite inverse");
    TORCH_CHECK(us[r] >= 0.f && us[r] < 1.f, "sample_rows: uniform ", us[r], " is not in [0, 1)");
  }
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));
  int64_t* picks = out.data_ptr<int64_t>();
  const int64_t n = x.size(1);
  auto run = [&](auto element) {
    using T = decltype(element);
    const T* data = x.data_ptr<T>();
    at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
      const int64_t chunks = (n + kChunk - 1) / kChunk;
      std::vector<float> scratch;  // a sampled row's weights (whole chunks), then its chunk sums
      if (std::any_of(temps + begin, temps + end, [](float t) { return t > 0.f; })) scratch.resize(chunks * (kChunk + 1));
      for (int64_t r = begin; r < end; ++r)
        picks[r] = temps[r] == 0.f ? first_argmax<T>(data + r * n, n)
                                   : draw_row<T>(data + r * n, n, 1.f / temps[r], us[r], scratch.data(), scratch.data() + chunks * kChunk);
    });
  };
  fleetserve::dispatch_float_dtype(x.scalar_type(), "sample_rows", run);
  return out;
}
