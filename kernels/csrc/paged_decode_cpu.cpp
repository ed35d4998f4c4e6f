// Paged decode attention on the CPU: one query token per row, reading K/V in place from the
// paged pools (no gather into contiguous copies), GQA, online softmax in float32.
//
//   q            [rows, heads, D]                       float32 | bfloat16
//   k/v caches   same dtype as q, in one of two layouts (kernels/kv_layout.py):
//                tokens  k, v [num_blocks, block_size, kv_heads, D]
//                paired  k [num_blocks, kv_heads, D / 2, block_size, 2]  (dimension pairs by key)
//                        v [num_blocks, kv_heads, block_size / 2, D, 2]  (key pairs by dimension)
//                        bf16 on CPUs with AVX-512 BF16 only: the pairs are the operands of its
//                        dot-product instruction as they lie, no shuffles
//   block_tables [rows, max_blocks] int64 (padding is never read: context_lens bound it)
//   context_lens [rows] int64: keys of row r are its positions [0, context_lens[r])
//   out          [rows, heads, D]                       q's dtype
//   lse          [rows, heads] float32: log-sum-exp of each head's scaled scores (to merge
//                with other partial results); returned when asked
//
// One task per (rows, kv head): the g = heads / kv_heads query heads of each of its rows share
// every K/V row read. Neighbouring rows (in row_order) whose tables start with the same blocks
// (robots of one type share a system prompt) form one task of up to 16 heads: the shared blocks
// are read once for all their heads, then each row's own blocks for its g heads. Keys are taken
// one block at a time: scores for the block's tokens, then one rescale of the running (max, sum,
// accumulator) per block, flash-decoding style. The arithmetic is a task type (TaskFor): bf16 on
// CPUs with AVX-512 BF16, float32 on CPUs with AVX2 and FMA, the portable loops elsewhere.
// A group of rows runs its kv_heads tasks side by side, block by block (decode_groups): a block's
// K (and V) for all KV heads lie together in either layout, and read at once they cost less than
// in kv_heads passes over the group's blocks, one head's part each (a decode step captured from
// the fleet trace, 256 rows on a 2-core AVX-512 EPYC, caches flushed between calls: 2.9-3.2 ms a
// layer against 3.4-3.7; a 2,048-row prompt step 13.0 against 13.7). The AMX task
// keeps one KV head's queries in its tile registers for the whole task, so its tasks run one
// after another (decode_tasks).

#include "amx_tiles.h"
#include "cpu_kernels.h"
#include "cpu_math.h"

#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>

namespace {

using fleetserve::exp_nonpositive;
using fleetserve::load;

// Blocks lie anywhere in the pool: the AMX task fetches its next span's rows while it computes,
// into L2 (locality 2: prefetcht1 on x86). Fetched into L1 instead (the default, prefetcht0), a
// block's 64 lines of K and V crowded out the lines in use (measured on the vector tasks, when
// they prefetched: on fleet-like steps 1.2x as long on the paired layout, 1.35-1.45x on tokens).
template <typename T, int64_t DIM>
inline void prefetch_rows(const T* rows, int64_t stride, int64_t count) {
  constexpr int64_t kLineElements = 64 / sizeof(T);
  for (int64_t t = 0; t < count; ++t)
    for (int64_t j = 0; j < DIM; j += kLineElements) __builtin_prefetch(rows + t * stride + j, 0, 2);
}

// A head's running maximum after a tile, and the factor its earlier sums take. Most tiles have
// no score above the maximum (`above` false): it stays, the factor is 1, and the tile's own
// maximum (`tile_max()`, a horizontal reduction) is never taken. A head's first tile always
// has one above: the maximum starts at -inf, and exp(-inf) = 0.
struct MaxUpdate {
  float max, correction;
};
template <typename TileMax>
inline MaxUpdate update_max(float run_max, bool above, TileMax tile_max) {
  if (!above) return {run_max, 1.f};
  const float new_max = tile_max();
  return {new_max, std::exp(run_max - new_max)};
}

// Where a block's keys and values lie: the tokens layout's rows of `stride` elements (one per
// key, starting at the block's first key for this KV head); the paired layout's slabs (this KV
// head's part of the block: K's pair rows of `stride` = block_size keys, V's key pairs of 2 x D).
template <typename T>
struct BlockRef {
  const T* k;
  const T* v;
  int64_t stride;
};


// A task's heads: up to kMaxHeads query heads of one KV head, from one or several rows. Every
// task type takes them the same way: begin() with each head's query, block() for a block's keys
// (or span() for several blocks': the AMX task) over a contiguous range of those heads (a shared
// prefix: all of them; a row's own blocks: its group), write() each head's result.
constexpr int64_t kMaxHeads = 16;

// The portable task: any dtype and head dim, loops the compiler vectorizes. DIM is the head
// dimension as a compile-time constant so every inner loop vectorizes whole.
template <typename T, int64_t DIM>
struct DecodeTask {
  static constexpr bool kPaired = false;  // reads the tokens layout
  // Partial sums per dot product: an AVX-512 register's 16 floats where DIM allows.
  static constexpr int64_t kLanes = DIM % 16 == 0 ? 16 : 8;
  static_assert(DIM % kLanes == 0, "head_dim must be a multiple of 8");
  alignas(32) float qf[kMaxHeads * DIM];   // scaled queries
  alignas(32) float acc[kMaxHeads * DIM];  // running weighted sums of V
  float scores[kMaxHeads * 64];   // [head][key of the block], block_size <= 64
  float run_max[kMaxHeads], run_sum[kMaxHeads];

  void begin(const T* const* queries, int64_t heads, float scale) {
    for (int64_t g = 0; g < heads; ++g)
      for (int64_t j = 0; j < DIM; ++j) qf[g * DIM + j] = load(queries[g], j) * scale;
    std::fill(acc, acc + heads * DIM, 0.f);
    std::fill(run_max, run_max + heads, -std::numeric_limits<float>::infinity());
    std::fill(run_sum, run_sum + heads, 0.f);
  }

  // Heads [h0, h1) over one block's first `count` keys: scores, online-softmax update, p . v.
  void block(BlockRef<T> b, int64_t count, int64_t h0, int64_t h1) {
    const T* __restrict__ k_block = b.k;
    const T* __restrict__ v_block = b.v;
    const int64_t stride = b.stride;
    for (int64_t g = h0; g < h1; ++g) {
      float* sg = scores + g * 64;
      for (int64_t t = 0; t < count; ++t) sg[t] = dot(g, k_block + t * stride);
      const float new_max = std::max(run_max[g], *std::max_element(sg, sg + count));
      const float correction = std::exp(run_max[g] - new_max);  // exp(-inf) = 0 at the start
      float sum = run_sum[g] * correction;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < count; ++t) {
        sg[t] = exp_nonpositive(sg[t] - new_max);
        sum += sg[t];
      }
      run_sum[g] = sum;
      run_max[g] = new_max;
      float a[DIM];  // a local copy the compiler keeps in registers across the block's keys
      for (int64_t j = 0; j < DIM; ++j) a[j] = acc[g * DIM + j] * correction;
      for (int64_t t = 0; t < count; ++t) {
        const float p = sg[t];
        const T* vt = v_block + t * stride;
        for (int64_t j = 0; j < DIM; ++j) a[j] += p * load(vt, j);
      }
      std::memcpy(acc + g * DIM, a, sizeof a);
    }
  }

  float dot(int64_t g, const T* __restrict__ kt) const {  // scaled q_g . k
    const float* qg = qf + g * DIM;
    float lanes[kLanes] = {};  // DIM is a multiple of kLanes: one vector register of partial sums
    for (int64_t j0 = 0; j0 < DIM; j0 += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) lanes[l] += qg[j0 + l] * load(kt, j0 + l);
    float s = 0.f;
    for (int64_t l = 0; l < kLanes; ++l) s += lanes[l];
    return s;
  }

  void write(int64_t g, T* __restrict__ out, float* lse) const {
    const float inv = 1.f / run_sum[g];
    for (int64_t j = 0; j < DIM; ++j) out[j] = static_cast<T>(acc[g * DIM + j] * inv);
    if (lse != nullptr) *lse = run_max[g] + std::log(run_sum[g]);
  }
};

#if defined(__AVX512BF16__)
// The bf16 task on CPUs with AVX-512 BF16, 16 keys at a time in vector registers:
//   q . k   the keys in (dimension pair) x (key) order, so one bf16 dot-product instruction
//           adds a query's pair of dimensions to all 16 scores at once (no horizontal sums);
//           every query head of the group reuses them. The paired layout stores them so; the
//           tokens layout's key rows are transposed in registers (128 shuffles a 16-key tile
//           at head_dim 64, which a row's own blocks pay for only its group's few heads);
//   softmax the 16 scores of a head as one vector: max, exp (a polynomial on 2^fraction,
//           scaled by 2^whole), sum;
//   p . v   two keys per bf16 dot-product instruction: each head's probabilities rounded to
//           bf16 pairs against the values of the two keys in pairs of one dimension (stored
//           so in the paired layout, two value rows interleaved in registers in the tokens
//           one), into the accumulators of up to kHeadsPerPass heads held in registers.
// Both layouts compute the same products in the same order: the same bits out.
// q . k products are exact bf16 x bf16 sums in float32; p . v rounds the probabilities to bf16
// first, as HF's eager attention in bf16 does (its softmax output is cast to bf16 for the matmul).

// In-register transpose of 16 rows of 16 dwords: on return r[c] holds dword c of every row.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[16];  // u[4i + j], 128-bit lane L: rows 4i..4i+3 of column 4L + j
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), x1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44), x3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
  }
}

template <int64_t DIM, bool PAIRED>
struct Bf16DecodeTask {
  static_assert(DIM % 32 == 0, "the bf16 task reads keys 32 dimensions (16 dword pairs) at a time");
  static constexpr bool kPaired = PAIRED;  // the layout it reads (its block_size a multiple of kTile)
  static constexpr int64_t kChunks = DIM / 32;       // 16-dword column chunks of a key row
  static constexpr int64_t kVecs = DIM / 16;         // float32 vectors per value row
  static constexpr int64_t kHeadsPerPass = DIM <= 32 ? 8 : DIM <= 64 ? 4 : 2;  // accumulators in registers
  static constexpr int64_t kTile = 16;
  const uint32_t* q_pairs[kMaxHeads];  // each head's query, read in place as bf16 pairs
  float scale_ = 1.f;
  alignas(64) float acc[kMaxHeads * DIM];      // running weighted sums of V, per head
  alignas(64) float probs[kMaxHeads * kTile];  // the tile's exp(score - max), per head
  __m512 run_sums[kMaxHeads];  // running sums of the probabilities, per head, lane by lane (added up in write())
  float correction[kMaxHeads];
  float run_max[kMaxHeads];

  void begin(const at::BFloat16* const* queries, int64_t heads, float scale) {
    for (int64_t g = 0; g < heads; ++g) q_pairs[g] = reinterpret_cast<const uint32_t*>(queries[g]);
    scale_ = scale;
    std::fill(acc, acc + heads * DIM, 0.f);
    std::fill(run_max, run_max + heads, -std::numeric_limits<float>::infinity());
    std::fill(run_sums, run_sums + heads, _mm512_setzero_ps());
  }

  // Heads [h0, h1) over one block's first `count` keys, kTile keys at a time.
  void block(BlockRef<at::BFloat16> b, int64_t count, int64_t h0, int64_t h1) {
    for (int64_t t0 = 0; t0 < count; t0 += kTile) {
      const int64_t tile = std::min(kTile, count - t0);
      tile_softmax(b, t0, tile, h0, h1);
      for (int64_t g0 = h0; g0 < h1; g0 += kHeadsPerPass) {
        switch (std::min(kHeadsPerPass, h1 - g0)) {
          case 1: accumulate<1>(g0, b, t0, tile); break;
          case 2: accumulate<2>(g0, b, t0, tile); break;
          case 3: accumulate<3>(g0, b, t0, tile); break;
          case 4: accumulate<4>(g0, b, t0, tile); break;
          case 5: accumulate<5>(g0, b, t0, tile); break;
          case 6: accumulate<6>(g0, b, t0, tile); break;
          case 7: accumulate<7>(g0, b, t0, tile); break;
          default: accumulate<8>(g0, b, t0, tile); break;
        }
      }
    }
  }

  // keys[p] = dimension pair c * 16 + p of the tile's keys t0 .. t0 + 15 (zeros or stale
  // values past `count`: their scores are masked out).
  static void load_key_pairs(BlockRef<at::BFloat16> b, int64_t t0, int64_t count, int64_t c, __m512i keys[16]) {
    if constexpr (PAIRED) {  // pair rows as they lie
      for (int64_t p = 0; p < 16; ++p) keys[p] = _mm512_loadu_si512(b.k + ((c * 16 + p) * b.stride + t0) * 2);
    } else {  // key rows, transposed in registers
      for (int64_t t = 0; t < kTile; ++t)
        keys[t] = t < count ? _mm512_loadu_si512(b.k + (t0 + t) * b.stride + c * 32) : _mm512_setzero_si512();
      transpose16x16(keys);
    }
  }

  // The values of keys t and t + 1 (block offsets; t + 1 only if below `end`, else zeros) in
  // 32-dimension chunk c, interleaved into pairs of one dimension: the dword lanes of
  // accumulator vectors 2c (lo) and 2c + 1 (hi), in the dimension order write() undoes.
  static void load_value_pairs(BlockRef<at::BFloat16> b, int64_t t, int64_t end, int64_t c, __m512i& lo, __m512i& hi) {
    if constexpr (PAIRED) {  // key pairs as they lie, dimensions in order; an odd last key's partner masked off
      const at::BFloat16* pairs = b.v + t * DIM + c * 64;
      const __mmask32 keys = t + 1 < end ? 0xFFFFFFFFu : 0x55555555u;
      lo = _mm512_maskz_loadu_epi16(keys, pairs);
      hi = _mm512_maskz_loadu_epi16(keys, pairs + 32);
    } else {  // two key rows, interleaved within 128-bit lanes
      const at::BFloat16* first = b.v + t * b.stride + c * 32;
      const __m512i x = _mm512_loadu_si512(first);
      const __m512i y = t + 1 < end ? _mm512_loadu_si512(first + b.stride) : _mm512_setzero_si512();
      lo = _mm512_unpacklo_epi16(x, y);
      hi = _mm512_unpackhi_epi16(x, y);
    }
  }

  // Scores of the tile's keys for every head, then each head's online-softmax update: probs
  // for the tile, the correction its accumulator takes before they are added. Always inlined,
  // as is accumulate(): called from decode_groups' loop GCC kept both out of line, and the
  // kernel ran 1.2x slower.
  [[gnu::always_inline]] void tile_softmax(BlockRef<at::BFloat16> b, int64_t t0, int64_t count, int64_t h0, int64_t h1) {
    __m512 scores[kMaxHeads];
    for (int64_t g = h0; g < h1; ++g) scores[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < kChunks; ++c) {
      __m512i keys[16];
      load_key_pairs(b, t0, count, c, keys);
      for (int64_t g = h0; g < h1; ++g) {
        // four independent sums: a row's own blocks have only its group's few heads, and one
        // chain of 16 dependent dot-product instructions per head left the unit waiting
        const uint32_t* qg = q_pairs[g] + c * 16;
        __m512 s[4] = {scores[g], _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t p = 0; p < 16; ++p)
          s[p % 4] = _mm512_dpbf16_ps(s[p % 4], (__m512bh)keys[p], (__m512bh)_mm512_set1_epi32(static_cast<int>(qg[p])));
        scores[g] = _mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3]));
      }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    for (int64_t g = h0; g < h1; ++g) {
      const __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid, scores[g],
                                          _mm512_set1_ps(scale_));
      const MaxUpdate m = update_max(run_max[g], _mm512_cmp_ps_mask(s, _mm512_set1_ps(run_max[g]), _CMP_GT_OQ) != 0,
                                     [&] { return _mm512_reduce_max_ps(s); });
      const __m512 e = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(m.max))));
      correction[g] = m.correction;
      run_sums[g] = _mm512_fmadd_ps(run_sums[g], _mm512_set1_ps(m.correction), e);
      run_max[g] = m.max;
      _mm512_store_ps(probs + g * kTile, e);
    }
  }

  // acc[g] = acc[g] * correction[g] + sum_t probs[g][t] v_t over the tile's keys t0 .. t0 +
  // count - 1 for heads g0 .. g0 + HEADS - 1, two keys per instruction: a head's probabilities
  // as bf16 pairs (t, t+1) against the values in pairs of one dimension (load_value_pairs).
  template <int64_t HEADS>
  [[gnu::always_inline]] void accumulate(int64_t g0, BlockRef<at::BFloat16> b, int64_t t0, int64_t count) {
    __m512 a[HEADS][kVecs];
    alignas(32) uint32_t pairs[HEADS][kTile / 2];
    for (int64_t g = 0; g < HEADS; ++g) {
      const __m512 corr = _mm512_set1_ps(correction[g0 + g]);
      for (int64_t j = 0; j < kVecs; ++j) a[g][j] = _mm512_mul_ps(_mm512_load_ps(acc + (g0 + g) * DIM + j * 16), corr);
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[g]),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(probs + (g0 + g) * kTile)));
    }
    for (int64_t t = 0; t < count; t += 2) {
      __m512i p[HEADS];
      for (int64_t g = 0; g < HEADS; ++g) p[g] = _mm512_set1_epi32(static_cast<int>(pairs[g][t / 2]));
      for (int64_t c = 0; c < kChunks; ++c) {
        __m512i lo, hi;
        load_value_pairs(b, t0 + t, t0 + count, c, lo, hi);
        for (int64_t g = 0; g < HEADS; ++g) {
          a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], (__m512bh)lo, (__m512bh)p[g]);
          a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], (__m512bh)hi, (__m512bh)p[g]);
        }
      }
    }
    for (int64_t g = 0; g < HEADS; ++g)
      for (int64_t j = 0; j < kVecs; ++j) _mm512_store_ps(acc + (g0 + g) * DIM + j * 16, a[g][j]);
  }

  // The dimension accumulator lane j holds: in order for the paired layout; for the tokens
  // layout's interleave within 128-bit lanes, lane k of the low (even j / 16) or high vector of
  // 32-dimension chunk c covers dimensions 8 * (k / 4) + k % 4, plus 4 in the high vector.
  static constexpr int64_t permuted_dim(int64_t j) {
    if (PAIRED) return j;
    const int64_t c = j / 32, high = (j / 16) % 2, k = j % 16;
    return c * 32 + 8 * (k / 4) + 4 * high + k % 4;
  }

  void write(int64_t g, at::BFloat16* __restrict__ out, float* lse) const {
    const float run_sum = _mm512_reduce_add_ps(run_sums[g]);
    const float inv = 1.f / run_sum;
    for (int64_t j = 0; j < DIM; ++j) out[permuted_dim(j)] = static_cast<at::BFloat16>(acc[g * DIM + j] * inv);
    if (lse != nullptr) *lse = run_max[g] + std::log(run_sum);
  }
};

#endif  // __AVX512BF16__

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The paired layout's task on the AMX tiles (Intel Xeon from Sapphire Rapids on), where the
// matrix unit does in one instruction what the bf16 task does in 16 dot products. The paired
// layout's slabs are the tiles' operands as they lie: K's dimension pairs by key are q . k's B
// (pair rows x keys x 2), V's key pairs by dimension are p . v's B (key pair rows x dims x 2).
// The task takes its keys a span at a time (up to kSpanKeys: several blocks), for all 16 query
// rows of the task at once (rows past the task's heads are zeros, computed and never read):
//   q . k   per 16-key tile, scores [16 heads x 16 keys] = Q [16 x 32 dims] . K pairs, DIM / 32
//           products against the query tiles, which stay in their registers for the whole task;
//   softmax each head's scores over the span: its maximum, one correction of the head's running
//           sums, the probabilities rounded to bf16 (as the bf16 task rounds them);
//   p . v   per 16 dimensions, [16 heads x 16 dims] = sum over the span's tiles of P [16 x 16
//           keys] . V pairs, summed in the unit's accumulator and stored once a span, then each
//           head's accumulator scaled by its correction plus that sum.
// A span rather than a tile at a time: one store of each product a span instead of a tile, one
// softmax update, and the unit's products of a span's tiles in a row rather than each waiting on
// the vector code. With the blocks in cache, 1.3x (rows sharing a prompt) to 1.7x (each row its
// own blocks) faster than tile by tile; on steps captured from a fleet trace, whose rows' own
// blocks come from memory, 5-25 %.
// The products are the bf16 task's (exact bf16 products summed in float32, the probabilities
// rounded to bf16 first), summed in the unit's order; the probabilities are scaled by the span's
// maximum, not a tile's, so they round differently: equal up to a bf16 rounding.
// Linux hands a process the tiles' state only when asked (arch_prctl); amx_tiles_ready() asks once.
bool amx_tiles_ready() {
  static const bool ready = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

template <int64_t DIM>
struct AmxDecodeTask {
  static_assert(DIM % 32 == 0 && DIM <= 128, "the tiles take 32 dimensions of q . k at a time, four query tiles");
  static constexpr bool kPaired = true;
  static constexpr int64_t kTile = 16;
  static constexpr int64_t kSpanKeys = 256;  // keys a span() takes at most
  static constexpr int64_t kSpanTiles = kSpanKeys / kTile;
  static constexpr int64_t kQueryTiles = DIM / 32;
  // tile registers (the intrinsics take them as literals): 0 .. kQueryTiles - 1 the queries,
  // 4 keys, 5 scores (then p . v), 6 probabilities, 7 values
  alignas(64) at::BFloat16 queries[kMaxHeads * DIM];  // row per head, zeros past the task's heads
  alignas(64) float scores[kMaxHeads * kSpanKeys];
  alignas(64) at::BFloat16 probs[kMaxHeads * kSpanKeys];
  alignas(64) float pv[kMaxHeads * DIM];
  alignas(64) float acc[kMaxHeads * DIM];
  alignas(64) at::BFloat16 tail[kTile * DIM];  // a partial tile's values, masked (masked_values)
  __m512 run_sums[kMaxHeads];  // running sums of the probabilities, per head, lane by lane (added up in write())
  float run_max[kMaxHeads], correction[kMaxHeads];
  float scale_ = 1.f;

  // The tiles' shapes, set in the thread that runs the task (each thread has its own tiles).
  AmxDecodeTask() {
    AmxTileConfig config;
    for (int t = 0; t < kQueryTiles; ++t) config.shape(t, 16, 64);  // 16 heads x 32 dims
    config.shape(4, 16, 64);  // 16 dimension pairs x 16 keys x 2
    config.shape(5, 16, 64);  // 16 heads x 16 keys (scores) or 16 dims (p . v), float32
    config.shape(6, 16, 32);  // 16 heads x 16 keys
    config.shape(7, 8, 64);   // 8 key pairs x 16 dims x 2
    _tile_loadconfig(&config);
  }
  ~AmxDecodeTask() { _tile_release(); }

  // The query tiles' registers (the intrinsics take a register as a literal, hence one line each).
  void load_queries() {
    constexpr int64_t bytes = DIM * sizeof(at::BFloat16);
    _tile_loadd(0, queries, bytes);
    if constexpr (kQueryTiles > 1) _tile_loadd(1, queries + 32, bytes);
    if constexpr (kQueryTiles > 2) _tile_loadd(2, queries + 64, bytes);
    if constexpr (kQueryTiles > 3) _tile_loadd(3, queries + 96, bytes);
  }

  // Tile 5 += the query tiles . a tile's key pairs (from its first key in a K slab of `stride` keys).
  static void score(const at::BFloat16* key_pairs, int64_t stride) {
    const int64_t bytes = stride * 2 * sizeof(at::BFloat16), chunk = 16 * stride * 2;  // 16 dimension pairs
    _tile_loadd(4, key_pairs, bytes);
    _tile_dpbf16ps(5, 0, 4);
    if constexpr (kQueryTiles > 1) { _tile_loadd(4, key_pairs + chunk, bytes); _tile_dpbf16ps(5, 1, 4); }
    if constexpr (kQueryTiles > 2) { _tile_loadd(4, key_pairs + 2 * chunk, bytes); _tile_dpbf16ps(5, 2, 4); }
    if constexpr (kQueryTiles > 3) { _tile_loadd(4, key_pairs + 3 * chunk, bytes); _tile_dpbf16ps(5, 3, 4); }
  }

  void begin(const at::BFloat16* const* q, int64_t heads, float scale) {
    for (int64_t g = 0; g < kMaxHeads; ++g) {
      if (g < heads) std::memcpy(queries + g * DIM, q[g], DIM * sizeof(at::BFloat16));
      else std::memset(queries + g * DIM, 0, DIM * sizeof(at::BFloat16));
    }
    load_queries();
    scale_ = scale;
    std::fill(acc, acc + heads * DIM, 0.f);
    std::fill(run_max, run_max + heads, -std::numeric_limits<float>::infinity());
    std::fill(run_sums, run_sums + heads, _mm512_setzero_ps());
  }

  // Heads [h0, h1) over `n` blocks' keys (the first `counts[i]` of block i; all but the last
  // block full), at most kSpanKeys in all. The `next_n` blocks of the next span are fetched
  // meanwhile, a block's keys beside each tile's scores and its values beside each tile's p . v
  // (the rest after them, where the next span has more blocks than this one tiles).
  void span(const BlockRef<at::BFloat16>* blocks, const int64_t* counts, int64_t n, const BlockRef<at::BFloat16>* next,
            int64_t next_n, int64_t h0, int64_t h1) {
    const at::BFloat16* key_pairs[kSpanTiles];  // each tile's first key in its block's K slab
    const at::BFloat16* value_pairs[kSpanTiles];
    const int64_t stride = blocks[0].stride;  // every block's: keys in a K slab's pair row
    int64_t tiles = 0, last = kTile;  // keys in the last tile
    for (int64_t i = 0; i < n; ++i)
      for (int64_t t0 = 0; t0 < counts[i]; t0 += kTile, ++tiles) {
        key_pairs[tiles] = blocks[i].k + t0 * 2;
        value_pairs[tiles] = blocks[i].v + t0 / 2 * DIM * 2;
        last = std::min(kTile, counts[i] - t0);
      }
    // the next span's blocks [from, to): their keys or their values
    auto fetch = [&](int64_t from, int64_t to, bool keys) {
      for (int64_t j = from; j < std::min(to, next_n); ++j)
        prefetch_rows<at::BFloat16, DIM>(keys ? next[j].k : next[j].v, DIM, next[j].stride);
    };
    for (int64_t j = 0; j < tiles; ++j) {
      fetch(j, j + 1, true);
      _tile_zero(5);
      score(key_pairs[j], stride);
      _tile_stored(5, scores + j * kTile, kSpanKeys * sizeof(float));
    }
    fetch(tiles, next_n, true);
    softmax(tiles, last, h0, h1);
    // a partial tile's slots past `last` may hold anything (NaN in a never-written slab): the
    // unit would add 0 x NaN, so their values are zeros in a copy
    if (last < kTile) value_pairs[tiles - 1] = masked_values(value_pairs[tiles - 1], last);
    for (int64_t d = 0; d < DIM / 16; ++d) {
      _tile_zero(5);
      for (int64_t j = 0; j < tiles; ++j) {
        if (d == 0) fetch(j, j + 1, false);
        _tile_loadd(6, probs + j * kTile, kSpanKeys * sizeof(at::BFloat16));
        _tile_loadd(7, value_pairs[j] + d * 16 * 2, DIM * 2 * sizeof(at::BFloat16));
        _tile_dpbf16ps(5, 6, 7);
      }
      _tile_stored(5, pv + d * 16, DIM * sizeof(float));
    }
    fetch(tiles, next_n, false);
    for (int64_t g = h0; g < h1; ++g) {
      const __m512 corr = _mm512_set1_ps(correction[g]);
      for (int64_t j = 0; j < DIM; j += 16)
        _mm512_store_ps(acc + g * DIM + j,
                        _mm512_fmadd_ps(_mm512_load_ps(acc + g * DIM + j), corr, _mm512_load_ps(pv + g * DIM + j)));
    }
  }

  // Each head's online-softmax update over the span's scores (`tiles` tiles, `last` keys in the
  // last): its new maximum, the correction its sums take, the probabilities as bf16.
  void softmax(int64_t tiles, int64_t last, int64_t h0, int64_t h1) {
    const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __mmask16 last_valid = static_cast<__mmask16>((1u << last) - 1);
    for (int64_t g = h0; g < h1; ++g) {
      const float* s = scores + g * kSpanKeys;
      __m512 top = minus_inf;
      for (int64_t j = 0; j + 1 < tiles; ++j) top = _mm512_max_ps(top, _mm512_load_ps(s + j * kTile));
      top = _mm512_mask_max_ps(top, last_valid, top, _mm512_load_ps(s + (tiles - 1) * kTile));
      const float new_max = std::max(run_max[g], _mm512_reduce_max_ps(top) * scale_);
      correction[g] = std::exp(run_max[g] - new_max);  // exp(-inf) = 0 at the start
      run_max[g] = new_max;
      const __m512 scale = _mm512_set1_ps(scale_), shift = _mm512_set1_ps(new_max);
      __m512 sum = _mm512_mul_ps(run_sums[g], _mm512_set1_ps(correction[g]));
      for (int64_t j = 0; j < tiles; ++j) {
        const __mmask16 valid = j + 1 < tiles ? static_cast<__mmask16>(0xFFFF) : last_valid;
        const __m512 e = _mm512_maskz_mov_ps(
            valid, exp_nonpositive(_mm512_sub_ps(_mm512_mul_ps(_mm512_load_ps(s + j * kTile), scale), shift)));
        sum = _mm512_add_ps(sum, e);
        _mm256_store_si256(reinterpret_cast<__m256i*>(probs + g * kSpanKeys + j * kTile), (__m256i)_mm512_cvtneps_pbh(e));
      }
      run_sums[g] = sum;
    }
  }

  // The tile's key pairs (8 rows of DIM x 2) with the values of keys `tile` and later zeroed.
  const at::BFloat16* masked_values(const at::BFloat16* pairs, int64_t tile) {
    for (int64_t r = 0; r < kTile / 2; ++r) {
      const __mmask32 keep = 2 * r + 1 < tile ? 0xFFFFFFFFu : 2 * r < tile ? 0x55555555u : 0u;
      for (int64_t j = 0; j < DIM * 2; j += 32)
        _mm512_store_si512(tail + r * DIM * 2 + j, _mm512_maskz_loadu_epi16(keep, pairs + r * DIM * 2 + j));
    }
    return tail;
  }

  void write(int64_t g, at::BFloat16* __restrict__ out, float* lse) const {
    const float run_sum = _mm512_reduce_add_ps(run_sums[g]);
    const float inv = 1.f / run_sum;
    for (int64_t j = 0; j < DIM; ++j) out[j] = static_cast<at::BFloat16>(acc[g * DIM + j] * inv);
    if (lse != nullptr) *lse = run_max[g] + std::log(run_sum);
  }
};
constexpr bool kAmxTilesBuilt = true;
#else
bool amx_tiles_ready() { return false; }
constexpr bool kAmxTilesBuilt = false;
#endif  // AMX

#if defined(__AVX2__) && defined(__FMA__)
// The float32 task on CPUs with AVX2 and FMA, a tile of 16 keys (two vectors of scores) at a time:
//   q . k   one vector of partial sums per key, 8 keys reduced together into one vector of 8
//           scores (a tree of horizontal adds: 9 instructions, where a horizontal sum per key
//           took 16 dependent scalar adds);
//   softmax a head's 16 scores as two vectors;
//   p . v   each key's probability broadcast into the head's DIM / 8 accumulators.
// A tile's keys are read by every head of the task: the rows' addresses are taken once per tile,
// then every head's scores and softmax, then every head's p . v (about 3 % faster than each
// head's p . v right after its softmax).
// NOTE: the accumulator loops are unrolled by pragma: left to itself GCC kept p . v's
// accumulators in a stack array (one store per FMA) and copied it out with memcpy, which made
// the whole kernel about 1.3x slower.
// Its state, begin() and write() are the portable task's; block() is its own.
template <int64_t DIM>
struct Fp32DecodeTask : DecodeTask<float, DIM> {
  static_assert(DIM % 8 == 0, "the float32 task reads 8 dimensions at a time");
  static constexpr int64_t kVecs = DIM / 8;
  static constexpr int64_t kTile = 16;
  using DecodeTask<float, DIM>::qf;
  using DecodeTask<float, DIM>::acc;
  using DecodeTask<float, DIM>::run_max;
  using DecodeTask<float, DIM>::run_sum;
  alignas(32) float probs[kMaxHeads * kTile];  // the tile's exp(score - max), per head
  float correction[kMaxHeads];                 // the factor each head's accumulator takes first

  // Heads [h0, h1) over one block's first `count` keys, kTile keys at a time.
  void block(BlockRef<float> b, int64_t count, int64_t h0, int64_t h1) {
    const float* __restrict__ k_block = b.k;
    const float* __restrict__ v_block = b.v;
    const int64_t stride = b.stride;
    for (int64_t t0 = 0; t0 < count; t0 += kTile) {
      const int64_t tile = std::min(kTile, count - t0);
      const float* k_rows = k_block + t0 * stride;
      const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256 valid_lo = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(tile)), _CMP_LT_OQ);
      const __m256 valid_hi = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(tile - 8)), _CMP_LT_OQ);
      const float* lo_rows[8];  // rows past the tile read key 0 again (their lanes are not keys)
      const float* hi_rows[8];
      for (int64_t t = 0; t < 8; ++t) {
        lo_rows[t] = k_rows + (t < tile ? t : 0) * stride;
        hi_rows[t] = k_rows + (8 + t < tile ? 8 + t : 0) * stride;
      }
      for (int64_t g = h0; g < h1; ++g) {
        const __m256 lo = scores(g, lo_rows);
        const __m256 hi = tile > 8 ? scores(g, hi_rows) : lo;
        softmax(g, lo, hi, valid_lo, valid_hi);
      }
      for (int64_t g = h0; g < h1; ++g) accumulate(g, v_block + t0 * stride, stride, tile);
    }
  }

  // Scaled q_g . k_t for 8 keys' rows, key t in lane t.
  __m256 scores(int64_t g, const float* const* rows) const {
    __m256 a[8];
    for (int64_t t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int64_t c = 0; c < kVecs; ++c) {
      const __m256 qc = _mm256_load_ps(qf + g * DIM + c * 8);
#pragma GCC unroll 8
      for (int64_t t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(rows[t] + c * 8), a[t]);
    }
    // hadd pairs lanes within 128-bit halves: after two rounds, half h of h0123 holds keys 0-3's
    // sums over dimensions 4h .. 4h + 3 of each 8, h4567 keys 4-7's
    const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
  }

  // Head g's online-softmax update for the tile's scores (keys 0-7 in lo, 8-15 in hi; lanes
  // outside `valid_*` are not keys): its probs, and the correction its accumulator takes.
  void softmax(int64_t g, __m256 lo, __m256 hi, __m256 valid_lo, __m256 valid_hi) {
    const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    lo = _mm256_blendv_ps(minus_inf, lo, valid_lo);
    hi = _mm256_blendv_ps(minus_inf, hi, valid_hi);
    const __m256 tile_max = _mm256_max_ps(lo, hi);
    const MaxUpdate u = update_max(
        run_max[g], _mm256_movemask_ps(_mm256_cmp_ps(tile_max, _mm256_set1_ps(run_max[g]), _CMP_GT_OQ)) != 0,
        [&] { return horizontal(tile_max, [](__m128 a, __m128 b) { return _mm_max_ps(a, b); }); });
    const __m256 m = _mm256_set1_ps(u.max);
    const __m256 e_lo = _mm256_and_ps(valid_lo, exp_nonpositive(_mm256_sub_ps(lo, m)));
    const __m256 e_hi = _mm256_and_ps(valid_hi, exp_nonpositive(_mm256_sub_ps(hi, m)));
    correction[g] = u.correction;
    run_sum[g] = run_sum[g] * u.correction +
                 horizontal(_mm256_add_ps(e_lo, e_hi), [](__m128 a, __m128 b) { return _mm_add_ps(a, b); });
    run_max[g] = u.max;
    _mm256_store_ps(probs + g * kTile, e_lo);
    _mm256_store_ps(probs + g * kTile + 8, e_hi);
  }

  // op (max or add) over the 8 lanes
  template <typename Op>
  static float horizontal(__m256 x, Op op) {
    __m128 h = op(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = op(h, _mm_movehl_ps(h, h));
    h = op(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
  }

  // acc[g] = acc[g] * correction[g] + sum_t probs[g][t] v_t over the tile's keys
  void accumulate(int64_t g, const float* __restrict__ v_rows, int64_t stride, int64_t tile) {
    __m256 a[kVecs];
    const __m256 corr = _mm256_set1_ps(correction[g]);
#pragma GCC unroll 16
    for (int64_t j = 0; j < kVecs; ++j) a[j] = _mm256_mul_ps(_mm256_load_ps(acc + g * DIM + j * 8), corr);
    for (int64_t t = 0; t < tile; ++t) {
      const __m256 pt = _mm256_broadcast_ss(probs + g * kTile + t);
#pragma GCC unroll 16
      for (int64_t j = 0; j < kVecs; ++j) a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v_rows + t * stride + j * 8), a[j]);
    }
#pragma GCC unroll 16
    for (int64_t j = 0; j < kVecs; ++j) _mm256_store_ps(acc + g * DIM + j * 8, a[j]);
  }
};
#endif  // __AVX2__ && __FMA__

// The task a (dtype, head_dim) runs on the tokens layout: a vector one where the CPU has the
// instructions. The paired layout has one task, PairedTask.
template <typename T, int64_t DIM, typename = void>
struct TaskFor { using type = DecodeTask<T, DIM>; };
#if defined(__AVX2__) && defined(__FMA__)
template <int64_t DIM>
struct TaskFor<float, DIM> { using type = Fp32DecodeTask<DIM>; };
#endif
#if defined(__AVX512BF16__)
template <int64_t DIM>
struct TaskFor<at::BFloat16, DIM, std::enable_if_t<DIM % 32 == 0>> { using type = Bf16DecodeTask<DIM, false>; };
template <int64_t DIM>
using PairedTask = Bf16DecodeTask<DIM, true>;
constexpr bool kPairedLayoutBuilt = true;
#else
constexpr bool kPairedLayoutBuilt = false;
#endif

// Rows sharing at least this many leading blocks (a system prompt) run as one task per KV head.
constexpr int64_t kMinSharedBlocks = 2;

// Consecutive rows of `order` whose block tables start alike: `size` rows from position `begin`,
// whose first `shared` blocks are the same (0 for a row alone).
struct RowGroup {
  int64_t begin, size, shared;
};

// Rows that share leading blocks go together, up to max_rows (their heads fill one task): a task
// then reads each shared block once, transposes its keys once, for every head of every row,
// then each row's own blocks for that row's heads. A shared block must lie wholly before each
// row's newest token (that block is the row's own). `order` sorts rows by block table, so what a
// run of consecutive rows shares is the least of its neighbours' common prefixes. The runs are
// chosen to read the fewest blocks in all (n rows sharing s blocks read (n - 1) * s fewer than
// alone; a dynamic program over the sorted rows), so that a robot's rows, which share its scene
// after the system prompt, stay together instead of being cut wherever a group fills up.
std::vector<RowGroup> group_rows(const int64_t* tables, const int64_t* lens, const int64_t* order, int64_t rows,
                                 int64_t max_blocks, int64_t block_size, int64_t max_rows) {
  auto shareable = [&](int64_t r) { return (lens[r] - 1) / block_size; };
  // common[k]: leading blocks rows order[k - 1] and order[k] share (k >= 1)
  std::vector<int64_t> common(rows, 0);
  for (int64_t k = 1; k < rows; ++k) {
    const int64_t a = order[k - 1], b = order[k];
    const int64_t limit = std::min(shareable(a), shareable(b));
    const int64_t *ta = tables + a * max_blocks, *tb = tables + b * max_blocks;
    int64_t c = 0;
    while (c < limit && ta[c] == tb[c]) ++c;
    common[k] = c;
  }
  // saved[j]: the most block reads saved over the first j rows; size[j], shared[j]: their last group
  std::vector<int64_t> saved(rows + 1, 0), size(rows + 1, 1), shared(rows + 1, 0);
  for (int64_t j = 1; j <= rows; ++j) {
    saved[j] = saved[j - 1];
    int64_t least = std::numeric_limits<int64_t>::max();
    for (int64_t n = 2; n <= max_rows && j - n >= 0; ++n) {
      least = std::min(least, common[j - n + 1]);
      if (least < kMinSharedBlocks) break;
      const int64_t gain = saved[j - n] + (n - 1) * least;
      if (gain > saved[j]) {
        saved[j] = gain;
        size[j] = n;
        shared[j] = least;
      }
    }
  }
  std::vector<RowGroup> groups;
  for (int64_t j = rows; j > 0; j -= size[j]) groups.push_back({j - size[j], size[j], shared[j]});
  std::reverse(groups.begin(), groups.end());
  return groups;
}

// KV head h of block `block`, in the layout the task reads.
template <bool PAIRED, typename T, int64_t DIM>
BlockRef<T> block_ref(const T* k_cache, const T* v_cache, int64_t block, int64_t h, int64_t kv_heads,
                      int64_t block_size) {
  if constexpr (PAIRED) {  // one slab of block_size * DIM elements per (block, KV head)
    const int64_t slab = (block * kv_heads + h) * block_size * DIM;
    return {k_cache + slab, v_cache + slab, block_size};
  } else {
    const int64_t first = (block * block_size * kv_heads + h) * DIM;
    return {k_cache + first, v_cache + first, kv_heads * DIM};
  }
}

// Keys a task takes in one call: a span of blocks, span() (up to Task::kSpanKeys), or one
// block, block() (tasks without kSpanKeys).
template <typename Task, typename = void>
struct SpanKeys : std::integral_constant<int64_t, 0> {};
template <typename Task>
struct SpanKeys<Task, std::void_t<decltype(Task::kSpanKeys)>> : std::integral_constant<int64_t, Task::kSpanKeys> {};
constexpr int64_t kMaxSpanBlocks = 16;

// Keys [first_block * block_size, end) of one row's block table, for KV head `kv_head`.
struct KeyRange {
  const int64_t* table;
  int64_t first_block, end, kv_head;
};

// One span task's keys in `range`, for heads [h0, h1): a call of the task per span of blocks,
// with the blocks of the call after it to fetch meanwhile (into L2: prefetch_rows); the last
// call's are the first of `after` (the task's next range, or the next task's first), so that a
// row's own blocks, read by no one else, are on their way before the row's turn.
template <typename Task, typename T, int64_t DIM>
void attend_blocks(Task& task, const T* k_cache, const T* v_cache, const KeyRange& range, const KeyRange* after,
                   int64_t kv_heads, int64_t block_size, int64_t h0, int64_t h1) {
  constexpr bool paired = Task::kPaired;
  constexpr int64_t span_keys = SpanKeys<Task>::value;
  static_assert(span_keys > 0 && span_keys <= kMaxSpanBlocks * 16, "a span task; its blocks hold at least 16 keys each");
  const int64_t per_call = std::clamp<int64_t>(span_keys / block_size, 1, kMaxSpanBlocks);
  // the blocks of `r` from key `first` on, up to per_call of them, and their keys' counts; how many
  auto take = [&](const KeyRange& r, int64_t first, BlockRef<T>* blocks, int64_t* counts) {
    int64_t n = 0;
    for (int64_t at = first; at < r.end && n < per_call; at += block_size, ++n) {
      blocks[n] = block_ref<paired, T, DIM>(k_cache, v_cache, r.table[at / block_size], r.kv_head, kv_heads, block_size);
      counts[n] = std::min(block_size, r.end - at);
    }
    return n;
  };
  BlockRef<T> blocks[kMaxSpanBlocks], next[kMaxSpanBlocks];
  int64_t counts[kMaxSpanBlocks], next_counts[kMaxSpanBlocks];
  int64_t n = take(range, range.first_block * block_size, blocks, counts);
  for (int64_t first = range.first_block * block_size; n > 0; first += per_call * block_size) {
    int64_t next_n = take(range, first + per_call * block_size, next, next_counts);
    const bool last = next_n == 0;
    if (last && after != nullptr) next_n = take(*after, after->first_block * block_size, next, next_counts);
    task.span(blocks, counts, n, next, next_n, h0, h1);
    if (last) break;
    std::copy(next, next + next_n, blocks);
    std::copy(next_counts, next_counts + next_n, counts);
    n = next_n;
  }
}

// Where a step's attention goes: the query rows, the pools, the rows' block tables and lengths,
// the order rows run in, the outputs (lse: null when not asked).
template <typename T>
struct DecodeArgs {
  const T *q, *k_cache, *v_cache;
  const int64_t *tables, *lens, *order;
  T* out;
  float* lse;
  int64_t rows, heads, kv_heads, block_size, max_blocks;
  float scale;
  int64_t dim;
  int64_t group() const { return heads / kv_heads; }  // query heads per KV head
  const T* query(int64_t row, int64_t head) const { return q + (row * heads + head) * dim; }
};

// Task `task` takes the queries of KV head h for the rows of group rg.
template <typename Task, typename T>
void begin_group(Task& task, const DecodeArgs<T>& a, const RowGroup& rg, int64_t h) {
  const int64_t group = a.group();
  const T* queries[kMaxHeads];
  for (int64_t i = 0; i < rg.size; ++i)
    for (int64_t j = 0; j < group; ++j) queries[i * group + j] = a.query(a.order[rg.begin + i], h * group + j);
  task.begin(queries, rg.size * group, a.scale);
}

// Row i of group rg is done in task `task` (KV head h): its heads' results out.
template <typename Task, typename T>
void write_row(const Task& task, const DecodeArgs<T>& a, const RowGroup& rg, int64_t i, int64_t h) {
  const int64_t group = a.group(), r = a.order[rg.begin + i];
  for (int64_t j = 0; j < group; ++j) {
    const int64_t head = r * a.heads + h * group + j;
    task.write(i * group + j, a.out + head * a.dim, a.lse == nullptr ? nullptr : a.lse + head);
  }
}

// The vector tasks: each group's kv_heads tasks side by side, block by block, every KV head's
// part of a block read together. No software prefetch: fetching the next block (or 2-3 ahead)
// into L2 measured the same as none on fleet steps, in this order and in the per-head one.
template <typename Task, typename T, int64_t DIM>
void decode_groups(const DecodeArgs<T>& a, const std::vector<RowGroup>& groups) {
  constexpr bool paired = Task::kPaired;
  const int64_t group = a.group(), bs = a.block_size, kv_heads = a.kv_heads;
  const T *k_cache = a.k_cache, *v_cache = a.v_cache;
  at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<std::unique_ptr<Task>> tasks;
    for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back(std::make_unique<Task>());
    // keys [first_block * bs, end_key) of `table`, for heads [h0, h1) of every KV head's task
    auto attend = [&](const int64_t* table, int64_t first_block, int64_t end_key, int64_t h0, int64_t h1) {
      for (int64_t at = first_block * bs; at < end_key; at += bs) {
        for (int64_t h = 0; h < kv_heads; ++h)
          tasks[h]->block(block_ref<paired, T, DIM>(k_cache, v_cache, table[at / bs], h, kv_heads, bs),
                          std::min(bs, end_key - at), h0, h1);
      }
    };
    for (int64_t w = begin; w < end; ++w) {
      const RowGroup& rg = groups[w];
      for (int64_t h = 0; h < kv_heads; ++h) begin_group(*tasks[h], a, rg, h);
      if (rg.shared > 0) attend(a.tables + a.order[rg.begin] * a.max_blocks, 0, rg.shared * bs, 0, rg.size * group);
      for (int64_t i = 0; i < rg.size; ++i) {
        const int64_t r = a.order[rg.begin + i];
        attend(a.tables + r * a.max_blocks, rg.shared, a.lens[r], i * group, (i + 1) * group);
        for (int64_t h = 0; h < kv_heads; ++h) write_row(*tasks[h], a, rg, i, h);
      }
    }
  });
}

// The span tasks (AMX): one task per (group, KV head), one after another (the tiles hold one KV
// head's queries for a whole task), a span of blocks per call; each range's last span fetches
// the range after it, or the next task's first.
template <typename Task, typename T, int64_t DIM>
void decode_tasks(const DecodeArgs<T>& a, const std::vector<RowGroup>& groups) {
  const int64_t group = a.group(), kv_heads = a.kv_heads;
  // task w's ranges: its rows' shared blocks (if any), then each row's own; how many
  auto ranges_of = [&](int64_t w, KeyRange* ranges) {
    const RowGroup& rg = groups[w / kv_heads];
    const int64_t h = w % kv_heads;
    int64_t n = 0;
    if (rg.shared > 0) ranges[n++] = {a.tables + a.order[rg.begin] * a.max_blocks, 0, rg.shared * a.block_size, h};
    for (int64_t i = 0; i < rg.size; ++i) {
      const int64_t r = a.order[rg.begin + i];
      ranges[n++] = {a.tables + r * a.max_blocks, rg.shared, a.lens[r], h};
    }
    return n;
  };
  at::parallel_for(0, static_cast<int64_t>(groups.size()) * kv_heads, 1, [&](int64_t begin, int64_t end) {
    auto task = std::make_unique<Task>();
    KeyRange ranges[kMaxHeads + 1], following[kMaxHeads + 1];
    int64_t count = ranges_of(begin, ranges);
    for (int64_t w = begin; w < end; ++w) {
      const RowGroup& rg = groups[w / kv_heads];
      const int64_t h = w % kv_heads;
      const int64_t next_count = w + 1 < end ? ranges_of(w + 1, following) : 0;
      // what each range's last span fetches: the range after it, or the next task's first
      auto after = [&](int64_t k) { return k + 1 < count ? &ranges[k + 1] : next_count > 0 ? following : nullptr; };
      begin_group(*task, a, rg, h);
      const int64_t own = count - rg.size;  // the first row's range: after the shared one, if any
      if (own > 0)
        attend_blocks<Task, T, DIM>(*task, a.k_cache, a.v_cache, ranges[0], after(0), kv_heads, a.block_size, 0,
                                    rg.size * group);
      for (int64_t i = 0; i < rg.size; ++i) {
        attend_blocks<Task, T, DIM>(*task, a.k_cache, a.v_cache, ranges[own + i], after(own + i), kv_heads,
                                    a.block_size, i * group, (i + 1) * group);
        write_row(*task, a, rg, i, h);
      }
      std::copy(following, following + next_count, ranges);
      count = next_count;
    }
  });
}

template <typename Task, typename T, int64_t DIM>
void decode_rows(const DecodeArgs<T>& a) {
  const std::vector<RowGroup> groups =
      group_rows(a.tables, a.lens, a.order, a.rows, a.max_blocks, a.block_size, kMaxHeads / a.group());
  if constexpr (SpanKeys<Task>::value > 0)
    decode_tasks<Task, T, DIM>(a, groups);
  else
    decode_groups<Task, T, DIM>(a, groups);
}

}  // namespace

namespace {

bool is_permutation(const torch::Tensor& order) {  // int64, contiguous
  const int64_t n = order.numel();
  const int64_t* p = order.data_ptr<int64_t>();
  std::vector<bool> seen(n, false);
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] < 0 || p[i] >= n || seen[p[i]]) return false;
    seen[p[i]] = true;
  }
  return true;
}

// The pools' layout and sizes, from their shapes (see the top of this file).
struct PoolShape {
  bool paired;
  int64_t kv_heads, block_size, head_dim;
};

PoolShape pool_shape(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  if (k_cache.dim() == 4) {
    TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "paged_decode: k_cache and v_cache shapes differ");
    return {false, k_cache.size(2), k_cache.size(1), k_cache.size(3)};
  }
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.dim() == 5 && k_cache.size(4) == 2 && v_cache.size(4) == 2 &&
                  v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1) &&
                  v_cache.size(3) == 2 * k_cache.size(2) && k_cache.size(3) == 2 * v_cache.size(2),
              "paged_decode: caches must be [blocks, block_size, kv_heads, D] (tokens) or k [blocks, kv_heads, D / 2, "
              "block_size, 2] and v [blocks, kv_heads, block_size / 2, D, 2] (paired)");
  return {true, k_cache.size(1), k_cache.size(3), v_cache.size(3)};
}

}  // namespace

bool paired_kv_layout_built() { return kPairedLayoutBuilt; }

bool amx_tiles_usable() { return kAmxTilesBuilt && amx_tiles_ready(); }

namespace {

std::tuple<torch::Tensor, torch::Tensor> paged_decode_with(bool tiles, torch::Tensor q, torch::Tensor k_cache,
                                                          torch::Tensor v_cache, torch::Tensor block_tables,
                                                          torch::Tensor context_lens, double scale, bool with_lse,
                                                          std::optional<torch::Tensor> row_order) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3, "paged_decode: q must be [rows, heads, head_dim]");
  const PoolShape pool = pool_shape(k_cache, v_cache);
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode: q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "paged_decode: block_tables and context_lens must be int64");
  TORCH_CHECK(q.size(1) % pool.kv_heads == 0 && q.size(2) == pool.head_dim, "paged_decode: head shapes");
  TORCH_CHECK(q.size(1) / pool.kv_heads <= 16 && pool.block_size <= 64, "paged_decode: at most 16 query heads per "
              "KV head and 64 tokens per block");
  TORCH_CHECK(!pool.paired || (kPairedLayoutBuilt && q.scalar_type() == torch::kBFloat16 && pool.block_size % 16 == 0 &&
                               pool.head_dim % 32 == 0),
              "paged_decode: the paired layout needs bfloat16 on a CPU with AVX-512 BF16, block_size a multiple of 16 "
              "and head_dim of 32");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "paged_decode: rows");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: caches must be contiguous");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(lens, lens + context_lens.numel(), [](int64_t n) { return n >= 1; }),
              "paged_decode: every row needs at least one key");
  // The order rows run in (a permutation; default: as given). The caller sorts rows that share
  // blocks next to each other once per step: they then run as one task (see group_rows).
  torch::Tensor order = row_order.has_value() ? row_order->contiguous() : torch::arange(q.size(0), torch::kInt64);
  TORCH_CHECK(order.scalar_type() == torch::kInt64 && order.numel() == q.size(0) && is_permutation(order),
              "paged_decode: row_order must be a permutation of the rows (int64)");
  auto out = torch::empty_like(q);
  auto lse = with_lse ? torch::empty({q.size(0), q.size(1)}, q.options().dtype(torch::kFloat32)) : torch::Tensor();
  const int64_t dim = q.size(2);
  auto run = [&](auto task, auto element, auto dim_constant) {
    using T = decltype(element);
    const DecodeArgs<T> args{q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                             block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), order.data_ptr<int64_t>(),
                             out.data_ptr<T>(), with_lse ? lse.data_ptr<float>() : nullptr, q.size(0), q.size(1),
                             pool.kv_heads, pool.block_size, block_tables.size(1), static_cast<float>(scale), dim};
    decode_rows<typename decltype(task)::type, T, decltype(dim_constant)::value>(args);
  };
  auto tokens = [&](auto element, auto dim_constant) {
    run(TaskFor<decltype(element), decltype(dim_constant)::value>{}, element, dim_constant);
  };
  auto by_dim = [&](auto element) {
    switch (dim) {  // keep in step with SUPPORTED_HEAD_DIMS in paged_decode_cpu.py
      case 8: return tokens(element, std::integral_constant<int64_t, 8>{});
      case 16: return tokens(element, std::integral_constant<int64_t, 16>{});
      case 32: return tokens(element, std::integral_constant<int64_t, 32>{});
      case 64: return tokens(element, std::integral_constant<int64_t, 64>{});
      case 80: return tokens(element, std::integral_constant<int64_t, 80>{});
      case 96: return tokens(element, std::integral_constant<int64_t, 96>{});
      case 128: return tokens(element, std::integral_constant<int64_t, 128>{});
      default: TORCH_CHECK(false, "paged_decode: head_dim ", dim, " is not compiled");
    }
  };
  if (!pool.paired) {
    fleetserve::dispatch_float_dtype(q.scalar_type(), "paged_decode", by_dim);
    return {out, lse};
  }
#if defined(__AVX512BF16__)
  auto paired = [&](auto dim_constant) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (tiles) {
      struct Tiles { using type = AmxDecodeTask<decltype(dim_constant)::value>; };
      return run(Tiles{}, at::BFloat16{}, dim_constant);
    }
#endif
    struct Paired { using type = PairedTask<decltype(dim_constant)::value>; };
    run(Paired{}, at::BFloat16{}, dim_constant);
  };
  switch (dim) {  // the paired layout's head sizes: multiples of 32
    case 32: paired(std::integral_constant<int64_t, 32>{}); break;
    case 64: paired(std::integral_constant<int64_t, 64>{}); break;
    case 96: paired(std::integral_constant<int64_t, 96>{}); break;
    case 128: paired(std::integral_constant<int64_t, 128>{}); break;
    default: TORCH_CHECK(false, "paged_decode: head_dim ", dim, " is not compiled for the paired layout");
  }
#endif
  return {out, lse};
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                                     double scale, bool with_lse,
                                                     std::optional<torch::Tensor> row_order) {
  return paged_decode_with(false, q, k_cache, v_cache, block_tables, context_lens, scale, with_lse, row_order);
}

std::tuple<torch::Tensor, torch::Tensor> paged_decode_tiles(torch::Tensor q, torch::Tensor k_cache,
                                                           torch::Tensor v_cache, torch::Tensor block_tables,
                                                           torch::Tensor context_lens, double scale, bool with_lse,
                                                           std::optional<torch::Tensor> row_order) {
  TORCH_CHECK(amx_tiles_usable(), "paged_decode_tiles: this CPU or build has no AMX tiles (amx_tiles_usable())");
  TORCH_CHECK(k_cache.dim() == 5, "paged_decode_tiles: the tiles read the paired KV layout only");
  return paged_decode_with(true, q, k_cache, v_cache, block_tables, context_lens, scale, with_lse, row_order);
}
