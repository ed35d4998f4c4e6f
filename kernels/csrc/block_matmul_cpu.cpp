// x @ W^T for a weight quantized in blocks of 32 input columns, each block a scale and a minimum
// (w = scale * code + minimum; 4-bit codes: a Q4_0/Q4_1 GGUF's or our int4, 8-bit: a Q8_0
// GGUF's), float activations, for the few rows of a batch-1 forward; and the weight
// dequantized to float32 [N, K], for a prefill's plain GEMM.
//
//   x         [M, K] float32, contiguous; K a multiple of 32
//   packed    [N, K * bits / 8] uint8, contiguous. 4 bits: byte j of a row holds column 2j's code
//             in its low nibble and column 2j+1's in its high nibble
//             (kernels.triton_int4_matmul.Int4Weight); 8 bits: one code a byte
//   scales    [N, K / 32] float32, contiguous
//   minimums  [N, K / 32] float32, contiguous
//   returns   [M, N] float32
//
// Each weight is read once per call and widened to float in registers (scale * code + minimum),
// never dequantized into a float copy in memory. A row's result is computed by the same
// operations in the same order whatever M is, so a row of a multi-token forward equals the
// one-token forward of that row bit for bit. Measured on a 2-core AVX2 EPYC, 2 threads, 4 bits:
// a 576 x 1536 projection 60-95 us for one row (ONNX Runtime's float-activation MatMulNBits
// 118-140 us), then ~37 us a further row. With AVX-512 a group is 16 lanes wide, up to 12 rows
// share a widening of the codes and each load of x serves 2-4 outputs. On a 2-core AVX-512 EPYC,
// against the AVX2 form built for the same machine, SmolLM2-135M's 4-bit projections and 8-bit
// head (one forward's products) took 5.0-5.2 against 5.6 ms for one row (the head, 1.0 ms, reads
// 35 MB and moved little) and 14.1 against 16.2 ms for 6 rows, 23.8 against 31.4 ms for 13.
// Tiles of 12 rows instead of 8 (a 9-row forward no longer widens every group twice): the body's
// products 17.9-18.5 against 20.2-20.8 ms for 9 rows, 22.6-24.6 against 27.3-33.7 for 12, and
// edged's onnx-int4 plans decoded at 196-202 against 184-189 tok/s (a token and up to 11 drafts
// fit one tile). 16 rows a tile with one output a call lost: each x load then serves one FMA.
//
// Products in bfloat16 (Products::kBFloat16, a CPU with AVX-512 BF16): x rounded to bf16 once a
// call, each widened group rounded to 32 bf16, one VDPBF16PS a row and output where float takes
// two FMAs, float32 sums; a 4-bit group's bf16 weights are looked up from the 16 values its
// codes stand for (one body's products for 1 / 4 / 8 rows 3.5 / 5.0 / 7.7 against 4.4 / 6.0 /
// 8.7 ms widening each code). SmolLM2-135M's products (4-bit body and 8-bit head) on the same
// EPYC: 17.5-18 against 24-27 ms for 12 rows, 9.5-10.6 against 12.9-13.9 for 6, 6.0-6.5 against
// 6.5-7.0 for one. A row's result still does not depend on the rows beside it.

#include "block_weight.h"
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <vector>

namespace {

constexpr int64_t kGroup = 32;
// rows of x sharing one widening of a group's codes: their accumulators fill the registers
#if defined(__AVX512F__)
constexpr int64_t kRowTile = 12;   // 32 registers: 12 rows x 2 outputs, 4 weights, 2 of x
#else
constexpr int64_t kRowTile = 4;    // 16 registers: 4 rows x 2 FMA chains
#endif
constexpr int64_t kOutBlock = 16;  // outputs whose weights stay in L1 while every row tile passes them

// x's columns reordered within each group as 4-bit codes are stored: the 16 even columns (low
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
inline __m256 widen8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }

// A group's codes as two vectors of 16 bytes: for 4 bits the low nibbles (the even columns)
// and the high ones (the odd columns), reorder_columns' order; for 8 bits columns 0-15, 16-31.
template <int Bits>
inline void load_group_codes(const uint8_t* codes, __m128i& first, __m128i& second) {
  if constexpr (Bits == 4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i low_nibbles = _mm_set1_epi8(0x0F);
    first = _mm_and_si128(bytes, low_nibbles);
    second = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles);
  } else {
    first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16));
  }
}

#if defined(__AVX512F__)
// A group's 32 weights, scale * code + minimum, as two vectors of 16 (load_group_codes' order).
template <int Bits>
inline void widen_group16(const uint8_t* codes, float scale, float minimum, __m512 w[2]) {
  const __m512 s = _mm512_set1_ps(scale), m = _mm512_set1_ps(minimum);
  __m128i first, second;
  load_group_codes<Bits>(codes, first, second);
  w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first)), s, m);
  w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second)), s, m);
}

// The products of a group of 32 columns with a row of x, in float32: the weights widened to two
// vectors of 16 floats, x's 32 values loaded as two, two chained FMAs.
struct FloatProducts {
  struct Weights {
    __m512 first, second;
  };
  struct Values {
    __m512 first, second;
  };
  template <int Bits>
  static Weights widen(const uint8_t* codes, float scale, float minimum) {
    __m512 w[2];
    widen_group16<Bits>(codes, scale, minimum, w);
    return {w[0], w[1]};
  }
  static Values load(const float* xg) { return {_mm512_loadu_ps(xg), _mm512_loadu_ps(xg + 16)}; }
  static __m512 multiply_add(__m512 acc, const Weights& w, const Values& x) {
    return _mm512_fmadd_ps(w.second, x.second, _mm512_fmadd_ps(w.first, x.first, acc));
  }
};

#if defined(__AVX512BF16__)
// The same in bfloat16: x rounded to bf16 once a call (to_bf16_columns), the group's 32 widened weights
// rounded to one vector of 32 bf16, and one VDPBF16PS (32 products summed into 16 float lanes)
// where the float form takes two FMAs.
struct Bf16Products {
  using Weights = __m512bh;
  using Values = __m512bh;
  // 4 bits: the 16 values a code can stand for (scale * code + minimum, one FMA, rounded to bf16)
  // looked up by each code (VPERMW), 7 instructions a group where widening each code takes 10;
  // the same bf16 values either way. 8 bits: widened, then rounded.
  template <int Bits>
  static Weights widen(const uint8_t* codes, float scale, float minimum) {
    if constexpr (Bits == 4) {
      const __m512 values = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_ps(scale), _mm512_set1_ps(minimum));
      const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values));  // entries 0-15
      const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
      const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)), high = _mm256_srli_epi16(bytes, 4);
      // load_group_codes' order: the low nibbles (even columns), then the high ones
      return (__m512bh)_mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1), table);
    } else {
      __m512 w[2];
      widen_group16<Bits>(codes, scale, minimum, w);
      return _mm512_cvtne2ps_pbh(w[1], w[0]);
    }
  }
  static Values load(const uint16_t* xg) { return (__m512bh)_mm512_loadu_si512(xg); }
  static __m512 multiply_add(__m512 acc, Weights w, Values x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#endif

template <typename X>
struct ProductsOf;  // the products of activations of type X: float, or bf16 bits (uint16_t)
template <>
struct ProductsOf<float> {
  using type = FloatProducts;
};
#if defined(__AVX512BF16__)
template <>
struct ProductsOf<uint16_t> {
  using type = Bf16Products;
};
#endif

// Outputs [n, n + Outs) of rows [m_begin, m_begin + Tile) of x (constants: the accumulators stay
// in registers); x as the weights' columns are ordered (reorder_columns for 4 bits). 16 lanes: a
// group's weights are widened once for the Tile rows, and each load of x serves Outs outputs.
template <int Bits, int64_t Tile, int64_t Outs = 1, typename X>
void output_tile(const uint8_t* packed, const float* scales, const float* minimums, const X* x,
                 int64_t m_begin, int64_t k, int64_t n_total, int64_t n, float* y) {
  using P = typename ProductsOf<X>::type;
  const int64_t groups = k / kGroup, group_bytes = kGroup * Bits / 8;
  __m512 acc[Tile][Outs];
  for (int64_t r = 0; r < Tile; ++r) {
    for (int64_t o = 0; o < Outs; ++o) acc[r][o] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    typename P::Weights w[Outs];
    for (int64_t o = 0; o < Outs; ++o) {
      const int64_t at = (n + o) * groups + g;
      w[o] = P::template widen<Bits>(packed + at * group_bytes, scales[at], minimums[at]);
    }
    for (int64_t r = 0; r < Tile; ++r) {
      const typename P::Values xg = P::load(x + (m_begin + r) * k + g * kGroup);
      for (int64_t o = 0; o < Outs; ++o) acc[r][o] = P::multiply_add(acc[r][o], w[o], xg);
    }
  }
  for (int64_t r = 0; r < Tile; ++r) {
    for (int64_t o = 0; o < Outs; ++o) y[(m_begin + r) * n_total + n + o] = _mm512_reduce_add_ps(acc[r][o]);
  }
}

#if defined(__AVX512BF16__)
// x [rows, k] rounded to bf16 (to nearest even, as torch rounds) in the order the weights'
// columns are stored (reorder_columns' for 4 bits), into out: one pass, 32 columns (a group) a
// step, so `elements` is a multiple of 32 (K is).
template <int Bits>
void to_bf16_columns(const float* x, int64_t elements, uint16_t* out) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t i = 0; i < elements; i += kGroup) {
    __m512 first = _mm512_loadu_ps(x + i), second = _mm512_loadu_ps(x + i + 16);
    if constexpr (Bits == 4) {  // the even columns (low nibbles), then the odd ones
      const __m512 evens = _mm512_permutex2var_ps(first, even, second);
      second = _mm512_permutex2var_ps(first, odd, second);
      first = evens;
    }
    _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(second, first));
  }
}
#endif  // __AVX512BF16__
#else
inline float horizontal_sum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// A group's 32 weights, scale * code + minimum, as four vectors of 8 (load_group_codes' order).
template <int Bits>
inline void widen_group(const uint8_t* codes, float scale, float minimum, __m256 w[4]) {
  const __m256 s = _mm256_set1_ps(scale), m = _mm256_set1_ps(minimum);
  __m128i first, second;
  load_group_codes<Bits>(codes, first, second);
  w[0] = _mm256_fmadd_ps(widen8(first), s, m);
  w[1] = _mm256_fmadd_ps(widen8(_mm_srli_si128(first, 8)), s, m);
  w[2] = _mm256_fmadd_ps(widen8(second), s, m);
  w[3] = _mm256_fmadd_ps(widen8(_mm_srli_si128(second, 8)), s, m);
}

// Output n of rows [m_begin, m_begin + Tile) of x (Tile a constant: the accumulators stay in
// registers); x as the weights' columns are ordered (reorder_columns for 4 bits).
template <int Bits, int64_t Tile>
void output_tile(const uint8_t* packed, const float* scales, const float* minimums, const float* x,
                 int64_t m_begin, int64_t k, int64_t n_total, int64_t n, float* y) {
  const int64_t groups = k / kGroup, group_bytes = kGroup * Bits / 8;
  const uint8_t* codes = packed + n * groups * group_bytes;
  // two accumulators a row, independent FMA chains
  __m256 first[Tile], second[Tile];
  for (int64_t r = 0; r < Tile; ++r) first[r] = second[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 w[4];
    widen_group<Bits>(codes + g * group_bytes, scales[n * groups + g], minimums[n * groups + g], w);
    for (int64_t r = 0; r < Tile; ++r) {
      const float* xg = x + (m_begin + r) * k + g * kGroup;
      first[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xg), first[r]);
      first[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), first[r]);
      second[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), second[r]);
      second[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), second[r]);
    }
  }
  for (int64_t r = 0; r < Tile; ++r) {
    y[(m_begin + r) * n_total + n] = horizontal_sum(_mm256_add_ps(first[r], second[r]));
  }
}
#endif  // __AVX512F__

// A group's 32 weights in column order, written to out: scale * code + minimum.
template <int Bits>
void dequantize_group(const uint8_t* codes, float scale, float minimum, float* out) {
  __m128i first, second;  // then the codes of columns 0-15 and 16-31, a byte each
  load_group_codes<Bits>(codes, first, second);
  if constexpr (Bits == 4) {  // even and odd columns interleaved back into column order
    const __m128i even = first, odd = second;
    first = _mm_unpacklo_epi8(even, odd);
    second = _mm_unpackhi_epi8(even, odd);
  }
  const __m256 s = _mm256_set1_ps(scale), m = _mm256_set1_ps(minimum);
  _mm256_storeu_ps(out, _mm256_fmadd_ps(widen8(first), s, m));
  _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(widen8(_mm_srli_si128(first, 8)), s, m));
  _mm256_storeu_ps(out + 16, _mm256_fmadd_ps(widen8(second), s, m));
  _mm256_storeu_ps(out + 24, _mm256_fmadd_ps(widen8(_mm_srli_si128(second, 8)), s, m));
}
#else
// Portable form: the same products, column by column in the order x is given.
template <int Bits>
inline float code_at(const uint8_t* group_codes, int64_t j) {  // the code of position j in that order
  if constexpr (Bits == 4) {
    return static_cast<float>(j < kGroup / 2 ? group_codes[j] & 0x0F : group_codes[j - kGroup / 2] >> 4);
  } else {
    return static_cast<float>(group_codes[j]);
  }
}

template <int Bits, int64_t Tile>
void output_tile(const uint8_t* packed, const float* scales, const float* minimums, const float* x,
                 int64_t m_begin, int64_t k, int64_t n_total, int64_t n, float* y) {
  const int64_t groups = k / kGroup, group_bytes = kGroup * Bits / 8;
  const uint8_t* codes = packed + n * groups * group_bytes;
  for (int64_t r = 0; r < Tile; ++r) {
    const int64_t m = m_begin + r;
    float acc = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + m * k + g * kGroup;
      const float scale = scales[n * groups + g], minimum = minimums[n * groups + g];
      for (int64_t j = 0; j < kGroup; ++j) acc += (scale * code_at<Bits>(codes + g * group_bytes, j) + minimum) * xg[j];
    }
    y[m * n_total + n] = acc;
  }
}

template <int Bits>
void dequantize_group(const uint8_t* codes, float scale, float minimum, float* out) {
  for (int64_t j = 0; j < kGroup; ++j) {
    const uint8_t code = Bits == 4 ? (j % 2 ? codes[j / 2] >> 4 : codes[j / 2] & 0x0F) : codes[j];
    out[j] = scale * static_cast<float>(code) + minimum;
  }
}
#endif

// Rows [m, m + Tile) of outputs [n_begin, n_end). With 16 lanes, several outputs a call: each
// load of x serves them all, and a few rows still have independent FMA chains to overlap.
template <int Bits, int64_t Tile, typename X>
void row_tile(const uint8_t* packed, const float* scales, const float* minimums, const X* x, int64_t m,
              int64_t k, int64_t n_total, int64_t n_begin, int64_t n_end, float* y) {
  int64_t n = n_begin;
#if defined(__AVX512F__)
  constexpr int64_t outs = Tile <= 4 ? 4 : 2;  // accumulators, weights and x within the 32 registers
  for (; n + outs <= n_end; n += outs) output_tile<Bits, Tile, outs>(packed, scales, minimums, x, m, k, n_total, n, y);
#endif
  for (; n < n_end; ++n) output_tile<Bits, Tile>(packed, scales, minimums, x, m, k, n_total, n, y);
}

// The rows left after the whole row tiles (`left` < kRowTile), as one tile of that many.
template <int Bits, typename X, int64_t Tile = kRowTile - 1>
void remainder_tile(int64_t left, const uint8_t* packed, const float* scales, const float* minimums, const X* x,
                    int64_t m, int64_t k, int64_t n_total, int64_t n_begin, int64_t n_end, float* y) {
  if constexpr (Tile > 0) {
    if (left == Tile) {
      row_tile<Bits, Tile>(packed, scales, minimums, x, m, k, n_total, n_begin, n_end, y);
    } else {
      remainder_tile<Bits, X, Tile - 1>(left, packed, scales, minimums, x, m, k, n_total, n_begin, n_end, y);
    }
  }
}

template <int Bits, typename X>
void matmul(const X* x, const uint8_t* packed, const float* scales, const float* minimums, int64_t rows,
            int64_t k, int64_t n_total, float* y) {
  // NOTE: outputs in blocks of 16 (also the grain: both cores busy on a 576-output projection),
  // row tiles within: a block's weights stay in L1 while every row tile passes them
  at::parallel_for(0, n_total, kOutBlock, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t block = n_begin; block < n_end; block += kOutBlock) {
      const int64_t block_end = std::min(block + kOutBlock, n_end);
      int64_t m = 0;
      for (; m + kRowTile <= rows; m += kRowTile) {
        row_tile<Bits, kRowTile>(packed, scales, minimums, x, m, k, n_total, block, block_end, y);
      }
      remainder_tile<Bits>(rows - m, packed, scales, minimums, x, m, k, n_total, block, block_end, y);
    }
  });
}

template <int Bits>
void dequantize(const uint8_t* packed, const float* scales, const float* minimums, int64_t k, int64_t n_total,
                float* w) {
  const int64_t groups = k / kGroup, group_bytes = kGroup * Bits / 8;
  at::parallel_for(0, n_total, kOutBlock, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t n = n_begin; n < n_end; ++n) {
      for (int64_t g = 0; g < groups; ++g) {
        dequantize_group<Bits>(packed + (n * groups + g) * group_bytes, scales[n * groups + g],
                               minimums[n * groups + g], w + n * k + g * kGroup);
      }
    }
  });
}

}  // namespace

BlockWeightView block_weight_view(const torch::Tensor& packed, const torch::Tensor& scales,
                                  const torch::Tensor& minimums, int64_t bits) {
  TORCH_CHECK_VALUE(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK_VALUE(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                        packed.device().is_cpu(),
                    "packed: [N, K * bits / 8] uint8, contiguous, on the CPU");
  const int64_t k = packed.size(1) * 8 / bits;
  TORCH_CHECK_VALUE(k % kGroup == 0, "K must be a multiple of ", kGroup, ", got ", k);
  for (const auto& t : {scales, minimums}) {
    TORCH_CHECK_VALUE(t.dim() == 2 && t.scalar_type() == torch::kFloat && t.is_contiguous() &&
                          t.size(0) == packed.size(0) && t.size(1) == k / kGroup && t.device().is_cpu(),
                      "scales and minimums: [N, K / 32] float32, contiguous, on the CPU");
  }
  return {packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), minimums.data_ptr<float>(), packed.size(0), k, bits};
}

bool bf16_products_built() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void block_matmul_into(const float* x, int64_t rows, const BlockWeightView& w, float* y, Products products) {
  if (rows == 0 || w.n == 0) return;
  if (products == Products::kBFloat16) {
#if defined(__AVX512BF16__)
    std::vector<uint16_t> rounded(rows * w.k);
    (w.bits == 4 ? to_bf16_columns<4> : to_bf16_columns<8>)(x, rows * w.k, rounded.data());
    const auto run = w.bits == 4 ? matmul<4, uint16_t> : matmul<8, uint16_t>;
    run(rounded.data(), w.packed, w.scales, w.minimums, rows, w.k, w.n, y);
    return;
#else
    TORCH_CHECK_VALUE(false, "block_matmul: bf16 products need a CPU with AVX-512 BF16 (bf16_products_built())");
#endif
  }
  std::vector<float> reordered;
  if (w.bits == 4) {
    reordered.resize(rows * w.k);
    reorder_columns(x, rows, w.k, reordered.data());
    x = reordered.data();
  }
  const auto run = w.bits == 4 ? matmul<4, float> : matmul<8, float>;
  run(x, w.packed, w.scales, w.minimums, rows, w.k, w.n, y);
}

torch::Tensor block_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor minimums, int64_t bits) {
  const BlockWeightView w = block_weight_view(packed, scales, minimums, bits);
  auto out = torch::empty({w.n, w.k}, scales.options());
  const auto run = bits == 4 ? dequantize<4> : dequantize<8>;
  run(w.packed, w.scales, w.minimums, w.k, w.n, out.data_ptr<float>());
  return out;
}

torch::Tensor block_matmul(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor minimums,
                           int64_t bits, bool bf16_products) {
  const BlockWeightView w = block_weight_view(packed, scales, minimums, bits);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == w.k && x.scalar_type() == torch::kFloat && x.is_contiguous() &&
                        x.device().is_cpu(),
                    "block_matmul: x must be [M, ", w.k, "] float32, contiguous, on the CPU");
  auto y = torch::empty({x.size(0), w.n}, x.options());
  block_matmul_into(x.data_ptr<float>(), x.size(0), w, y.data_ptr<float>(), products_of(bf16_products));
  return y;
}
