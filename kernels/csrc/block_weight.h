// A weight quantized in blocks of 32 input columns (w = scale * code + minimum, 4- or 8-bit
// codes) as the block kernels read it, shared by block_matmul_cpu.cpp and block_layer_cpu.cpp.
#pragma once

#include <torch/extension.h>

#include <cstdint>

struct BlockWeightView {
  const uint8_t* packed;   // [n, k * bits / 8]
  const float* scales;     // [n, k / 32]
  const float* minimums;   // [n, k / 32]
  int64_t n;               // outputs
  int64_t k;               // inputs, a multiple of 32
  int64_t bits;            // 4 or 8
};

// The view of a block weight's tensors; ValueError (TORCH_CHECK_VALUE) unless packed is
// [N, K * bits / 8] uint8 and scales and minimums [N, K / 32] float32, contiguous, on the CPU.
BlockWeightView block_weight_view(const torch::Tensor& packed, const torch::Tensor& scales,
                                  const torch::Tensor& minimums, int64_t bits);

// The precision of the products: float32, or x and the widened weights rounded to bfloat16 and
// multiplied into float32 sums (VDPBF16PS, a CPU with AVX-512 BF16; about twice the products a
// cycle of float FMAs).
enum class Products { kFloat32, kBFloat16 };

// The products a caller's flag asks for (the Python and ONNX attributes are a bool / an int).
inline Products products_of(bool bf16) { return bf16 ? Products::kBFloat16 : Products::kFloat32; }

// Whether this build has the bfloat16 products (compiled for a CPU with AVX-512 BF16).
bool bf16_products_built();

// y [rows, w.n] = x [rows, w.k] @ W^T (x and y float32, contiguous). A row's result is the same
// bit for bit whatever `rows` is. ValueError (TORCH_CHECK_VALUE) for bf16 products where
// bf16_products_built() is false.
void block_matmul_into(const float* x, int64_t rows, const BlockWeightView& w, float* y,
                       Products products = Products::kFloat32);
