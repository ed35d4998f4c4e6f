// The paired KV layout's writes and gathers on the CPU (kernels/kv_layout.py has the layout and
// the plain-torch twins these are tested against):
//   k [num_blocks, kv_heads, D / 2, block_size, 2]   dimension pairs by key
//   v [num_blocks, kv_heads, block_size / 2, D, 2]   key pairs by dimension
// A token's K is D / 2 pair stores (one 2-element unit each), its V D single-element stores; a
// gather turns a block's slabs back into the tokens layout's rows. Elements are moved as raw
// bits (2 or 4 bytes), so any dtype of those sizes works.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cstring>

namespace {

struct PairedShape {
  int64_t kv_heads, block_size, dim;
};

// A K (`key`) or V pool's sizes.
PairedShape paired_shape(const torch::Tensor& cache, bool key) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(4) == 2,
              "paired KV: k must be [blocks, kv_heads, D / 2, block_size, 2] and v [blocks, kv_heads, "
              "block_size / 2, D, 2]");
  TORCH_CHECK(cache.is_contiguous() && cache.device().is_cpu() &&
                  (cache.element_size() == 2 || cache.element_size() == 4),
              "paired KV: contiguous CPU pools of a 2- or 4-byte dtype");
  return key ? PairedShape{cache.size(1), cache.size(3), 2 * cache.size(2)}
             : PairedShape{cache.size(1), 2 * cache.size(2), cache.size(3)};
}

template <typename E>  // raw element bits
void write_tokens(E* k_cache, E* v_cache, const E* k, const E* v, const int64_t* slots, int64_t tokens,
                  PairedShape s) {
  const int64_t slab = s.block_size * s.dim;  // elements of one (block, head) slab
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t block = slots[i] / s.block_size, offset = slots[i] % s.block_size;
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        const E* key = k + (i * s.kv_heads + h) * s.dim;
        const E* value = v + (i * s.kv_heads + h) * s.dim;
        E* k_slab = k_cache + (block * s.kv_heads + h) * slab + offset * 2;
        E* v_slab = v_cache + (block * s.kv_heads + h) * slab + (offset / 2) * 2 * s.dim + offset % 2;
        for (int64_t p = 0; p < s.dim / 2; ++p) std::memcpy(k_slab + p * 2 * s.block_size, key + 2 * p, 2 * sizeof(E));
        for (int64_t d = 0; d < s.dim; ++d) v_slab[2 * d] = value[d];
      }
    }
  });
}

template <typename E>
void gather_blocks(const E* cache, bool key, const int64_t* blocks, int64_t count, E* out, PairedShape s) {
  const int64_t slab = s.block_size * s.dim, row = s.kv_heads * s.dim;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      E* rows = out + j * s.block_size * row;  // the block's tokens, [block_size, kv_heads, dim]
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        const E* src = cache + (blocks[j] * s.kv_heads + h) * slab;
        E* dst = rows + h * s.dim;  // key o's row: dst + o * row
        if (key) {  // each pair row (a pair of dimensions, every key) read in order
          for (int64_t p = 0; p < s.dim / 2; ++p)
            for (int64_t o = 0; o < s.block_size; ++o)
              std::memcpy(dst + o * row + 2 * p, src + (p * s.block_size + o) * 2, 2 * sizeof(E));
        } else {  // each key pair's row split into its two keys' rows
          for (int64_t o = 0; o < s.block_size; o += 2) {
            const E* pair = src + o * s.dim;
            E *first = dst + o * row, *second = first + row;
            for (int64_t d = 0; d < s.dim; ++d) {
              first[d] = pair[2 * d];
              second[d] = pair[2 * d + 1];
            }
          }
        }
      }
    }
  });
}

template <typename F>
void by_element_size(int64_t size, F&& f) {
  if (size == 2) f(uint16_t{});
  else f(uint32_t{});
}

}  // namespace

void paired_write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
                     torch::Tensor slots) {
  const PairedShape s = paired_shape(k_cache, true), sv = paired_shape(v_cache, false);
  TORCH_CHECK(sv.kv_heads == s.kv_heads && sv.block_size == s.block_size && sv.dim == s.dim &&
                  v_cache.size(0) == k_cache.size(0) && v_cache.scalar_type() == k_cache.scalar_type(),
              "paired_write_kv: k_cache and v_cache disagree");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == s.kv_heads && k.size(2) == s.dim &&
                  k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type(),
              "paired_write_kv: k and v must be [tokens, kv_heads, D] in the pools' dtype");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 1 && slots.size(0) == k.size(0),
              "paired_write_kv: one int64 slot per token");
  k = k.contiguous();
  v = v.contiguous();
  slots = slots.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0) * s.block_size;
  for (int64_t i = 0; i < slots.size(0); ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < capacity, "paired_write_kv: slot ", slot[i], " is outside the pool");
  by_element_size(k.element_size(), [&](auto element) {
    using E = decltype(element);
    write_tokens<E>(static_cast<E*>(k_cache.data_ptr()), static_cast<E*>(v_cache.data_ptr()),
                    static_cast<const E*>(k.data_ptr()), static_cast<const E*>(v.data_ptr()), slot, k.size(0), s);
  });
}

torch::Tensor paired_gather(torch::Tensor cache, bool key, torch::Tensor blocks) {
  const PairedShape s = paired_shape(cache, key);
  TORCH_CHECK(blocks.scalar_type() == torch::kInt64, "paired_gather: int64 block ids");
  blocks = blocks.contiguous();
  const int64_t* ids = blocks.data_ptr<int64_t>();
  for (int64_t j = 0; j < blocks.numel(); ++j)
    TORCH_CHECK(ids[j] >= 0 && ids[j] < cache.size(0), "paired_gather: block ", ids[j], " is outside the pool");
  auto out = torch::empty({blocks.numel() * s.block_size, s.kv_heads, s.dim}, cache.options());
  by_element_size(cache.element_size(), [&](auto element) {
    using E = decltype(element);
    gather_blocks<E>(static_cast<const E*>(cache.data_ptr()), key, ids, blocks.numel(), static_cast<E*>(out.data_ptr()),
                     s);
  });
  return out;
}
