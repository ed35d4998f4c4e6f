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

// x @ W^T for a 4-bit Q4_1-form weight (a scale and a minimum per 32 columns), float
// activations, read in place (int4_matmul_cpu.cpp).
torch::Tensor int4_matmul(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor minimums);
// That weight dequantized to float32 [N, K] (int4_matmul_cpu.cpp).
torch::Tensor int4_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor minimums);
