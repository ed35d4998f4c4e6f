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

// Softmax of attention scores in place over each row's visible keys, with its log-sum-exp
// (softmax_lse_cpu.cpp).
torch::Tensor softmax_lse_(torch::Tensor scores, torch::Tensor visible, double scale);

// One token per row: greedy rows' first largest value, sampled rows' inverse-CDF draw from
// softmax(x / temperature) (sample_cpu.cpp).
torch::Tensor sample_rows(torch::Tensor x, torch::Tensor temperatures, torch::Tensor uniforms);

// x @ W^T for a weight quantized in blocks of 32 columns (scale * code + minimum, 4- or 8-bit
// codes), float activations, read in place; and that weight dequantized to float32 [N, K]
// (block_matmul_cpu.cpp).
torch::Tensor block_matmul(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor minimums,
                           int64_t bits);
torch::Tensor block_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor minimums, int64_t bits);
