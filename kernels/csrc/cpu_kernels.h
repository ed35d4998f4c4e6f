// The CPU kernels of the fleetserve_cpu_kernels extension (bound to Python in bindings.cpp).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>

// Paged decode attention read in place from the KV pools (paged_decode_cpu.cpp).
std::tuple<torch::Tensor, torch::Tensor> paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                                     double scale, bool with_lse,
                                                     std::optional<torch::Tensor> row_order);
// Whether this build reads the paired KV layout (bf16 on a CPU with AVX-512 BF16).
bool paired_kv_layout_built();
// paged_decode over the paired layout on the AMX tiles (a Xeon from Sapphire Rapids on);
// amx_tiles_usable() says whether this build and process have them.
std::tuple<torch::Tensor, torch::Tensor> paged_decode_tiles(torch::Tensor q, torch::Tensor k_cache,
                                                           torch::Tensor v_cache, torch::Tensor block_tables,
                                                           torch::Tensor context_lens, double scale, bool with_lse,
                                                           std::optional<torch::Tensor> row_order);
bool amx_tiles_usable();

// The paired KV layout's writes at slots and gathers of blocks into the tokens layout
// ([blocks * block_size, kv_heads, D]) (kv_layout_cpu.cpp).
void paired_write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
                     torch::Tensor slots);
torch::Tensor paired_gather(torch::Tensor cache, bool key, torch::Tensor blocks);

// Softmax of attention scores in place over each row's visible keys, with its log-sum-exp
// (softmax_lse_cpu.cpp).
torch::Tensor softmax_lse_(torch::Tensor scores, torch::Tensor visible, double scale);

// One token per row: greedy rows' first largest value, sampled rows' inverse-CDF draw from
// softmax(x / temperature) (sample_cpu.cpp).
torch::Tensor sample_rows(torch::Tensor x, torch::Tensor temperatures, torch::Tensor uniforms);

// A grammar's token bitmask applied to logits rows in place: forbidden tokens become -inf
// (token_bitmask_cpu.cpp).
void apply_token_bitmask_(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows);

// x @ W^T for a weight quantized in blocks of 32 columns (scale * code + minimum, 4- or 8-bit
// codes), float activations, read in place; and that weight dequantized to float32 [N, K]
// (block_matmul_cpu.cpp).
torch::Tensor block_matmul(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor minimums,
                           int64_t bits, bool bf16_products);
torch::Tensor block_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor minimums, int64_t bits);

// x @ W^T on the AMX tiles (else in AVX-512 BF16 vectors) for a few rows of bf16 x and a weight
// kept in 4- or 8-bit codes with a scale and minimum per group of 16 or 32 columns (int8 factors
// of float32 ones per super-group), in B-tile order (tile_quant_matmul_cpu.cpp);
// tile_quant_matmul_usable() says whether this build and process run it (tiles or vectors),
// tile_quant_matmul_on_tiles() whether on the tiles.
torch::Tensor tile_quant_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor group_scales,
                                torch::Tensor group_minimums, torch::Tensor super_scales, torch::Tensor super_minimums,
                                int64_t bits, int64_t group, int64_t super_columns, std::optional<torch::Tensor> bias,
                                bool vectors);
bool tile_quant_matmul_usable();
bool tile_quant_matmul_on_tiles();

// The passes around an int8 GEMM (int8_rows_cpu.cpp): rows of x as int8 codes with a scale each
// (largest magnitude / 127, rounded to nearest even), and the GEMM's int32 sums scaled back by
// their row's and column's scales, plus a bias, in dtype.
std::tuple<torch::Tensor, torch::Tensor> quantize_rows_int8(torch::Tensor x);
torch::Tensor scale_int32_rows(torch::Tensor sums, torch::Tensor row_scales, torch::Tensor column_scales,
                               std::optional<torch::Tensor> bias, c10::ScalarType dtype);

// A block weight as Python passes it: (packed, scales, minimums, bits), as block_matmul takes them.
using BlockWeightArgs = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, int64_t>;

// A decoder layer's dense halves over block weights for a few rows (block_layer_cpu.cpp):
// RMSNorm, the QKV projection and rotary; the output projection, residual, RMSNorm, SwiGLU MLP
// and residual. The block products in bfloat16 with bf16_products (block_weight.h's Products).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> block_attention_inputs(
    torch::Tensor x, torch::Tensor norm_weight, double eps, BlockWeightArgs qkv,
    std::optional<torch::Tensor> qkv_bias, torch::Tensor cos, torch::Tensor sin, int64_t num_heads,
    int64_t num_kv_heads, bool bf16_products);
torch::Tensor block_attention_outputs(torch::Tensor x, torch::Tensor attended, BlockWeightArgs o,
                                      torch::Tensor norm_weight, double eps, BlockWeightArgs gate_up,
                                      BlockWeightArgs down, bool bf16_products);
