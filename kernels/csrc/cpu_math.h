// Element loads, exp and the dtype dispatch of the CPU kernels (header-only, one copy for all).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace fleetserve {

// Element loads as float: bf16 is the high half of a float32 (a shift the compiler vectorizes).
inline float load(const float* p, int64_t j) { return p[j]; }
inline float load(const at::Half* p, int64_t j) { return static_cast<float>(p[j]); }
inline float load(const at::BFloat16* p, int64_t j) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[j]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// exp(x) for x <= 0 (scores minus their running max), in a form the compiler vectorizes (libm's
// expf is a scalar call per score): 2^(x log2 e) as 2^floor times a degree-6 polynomial for the
// fraction; relative error about 2e-7. Below -87 it returns about 1e-38, not 0: a weight that
// small vanishes in the float32 sums anyway.
// The vector forms below compute the same steps with the same constants.
constexpr float kExpLowest = -87.f;     // the clamp
constexpr float kLog2E = 1.44269504f;
constexpr float kExp2Fraction[] = {0.000154035304f, 0.00133335581f, 0.00961812911f, 0.0555041087f,
                                   0.240226507f,    0.693147182f,   1.f};  // 2^f on [0, 1), Horner order
inline float exp_nonpositive(float x) {
  const float t = std::max(x, kExpLowest) * kLog2E;
  const float whole = std::floor(t);
  const float f = t - whole;
  float p = kExp2Fraction[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExp2Fraction[i];
  const int32_t bits = (static_cast<int32_t>(whole) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__AVX512F__)
// exp(x) for x <= 0, 16 lanes: exp_nonpositive's polynomial, the power of two applied by scalef.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLowest)), _mm512_set1_ps(kLog2E));
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);
  __m512 p = _mm512_set1_ps(kExp2Fraction[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Fraction[i]));
  return _mm512_scalef_ps(p, whole);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp(x) for x <= 0, 8 lanes: exp_nonpositive's polynomial, the power of two built in the exponent.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLowest)), _mm256_set1_ps(kLog2E));
  const __m256 whole = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, whole);
  __m256 p = _mm256_set1_ps(kExp2Fraction[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Fraction[i]));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FLEETSERVE_LOAD16 1
// 16 elements as float32 lanes; lanes outside `live` read nothing and hold 0.
inline __m512 load16(const float* p, __mmask16 live) { return _mm512_maskz_loadu_ps(live, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 live) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16));
}
inline __m512 load16(const at::Half* p, __mmask16 live) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, p)); }

// The lanes of elements [j, j + 16) that lie before n.
inline __mmask16 live_lanes(int64_t j, int64_t n) {
  return j + 16 <= n ? 0xFFFF : j >= n ? 0 : static_cast<__mmask16>((1u << (n - j)) - 1);
}
#endif

// Calls run(element) with a value of the C++ type of `dtype` (float32, bfloat16 or float16, the
// kernels' dtypes); any other dtype is refused with an error naming `kernel`.
template <typename Run>
void dispatch_float_dtype(c10::ScalarType dtype, const char* kernel, Run&& run) {
  switch (dtype) {
    case c10::ScalarType::Float: run(float{}); break;
    case c10::ScalarType::BFloat16: run(at::BFloat16{}); break;
    case c10::ScalarType::Half: run(at::Half{}); break;
    default: TORCH_CHECK(false, kernel, ": dtype ", dtype, " is not float32, bfloat16 or float16");
  }
}

}  // namespace fleetserve
