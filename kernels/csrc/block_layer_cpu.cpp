// A decoder layer's two dense halves for edged's few-row forwards on the CPU, weights in blocks
// of 32 columns (block_matmul_cpu.cpp), float32 activations: what shared.model.llama's
// attention_inputs and attention_outputs compute, each in one call, so that a one-token
// forward pays two calls a layer instead of ~40 torch ops (measured on a 2-core AVX2 EPYC with
// SmolLM2-135M: 18 of a 25 ms forward were not the projections).
//
//   attention_inputs:  h = RMSNorm(x); qkv = h @ Wqkv^T (+ bias); q, k rotated (rotate-half)
//   attention_outputs: x1 = x + attended @ Wo^T; h = RMSNorm(x1);
//                      x1 + (silu(h @ Wgate^T) * (h @ Wup^T)) @ Wdown^T   (gate rows first)
//
// Every row is computed by the same operations in the same order whatever the number of rows,
// so a row of a multi-token forward equals the one-token forward of that row bit for bit. The
// results differ from the torch ops' by rounding only (sums in another order, exp by
// cpu_math.h's polynomial).

#include "block_weight.h"
#include "cpu_kernels.h"
#include "cpu_math.h"

#include <cmath>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;  // partial sums of the RMSNorm's squares (a vector's width in float32)

BlockWeightView view_of(const BlockWeightArgs& weight) {
  const auto& [packed, scales, minimums, bits] = weight;
  return block_weight_view(packed, scales, minimums, bits);
}

void check_rows(const torch::Tensor& t, int64_t rows, int64_t dim, const char* what) {
  TORCH_CHECK_VALUE(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu() &&
                        t.numel() == rows * dim,
                    what, ": ", rows, " x ", dim, " float32, contiguous, on the CPU");
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight (HF's RMSNorm in float32).
void rms_norm_rows(const float* x, int64_t rows, int64_t dim, const float* weight, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * dim;
    float partial[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= dim; j += kLanes) {
      for (int64_t l = 0; l < kLanes; ++l) partial[l] += row[j + l] * row[j + l];
    }
    float sum = 0.f;
    for (; j < dim; ++j) sum += row[j] * row[j];
    for (int64_t l = 0; l < kLanes; ++l) sum += partial[l];
    const float inverse = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
    for (j = 0; j < dim; ++j) out[r * dim + j] = row[j] * inverse * weight[j];
  }
}

// Rotate `heads` consecutive heads of `head_dim` in place by one position's cos/sin [head_dim / 2].
void rotate_half(float* heads_start, int64_t heads, int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* first = heads_start + h * head_dim;
    float* second = first + half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = first[i], b = second[i];
      first[i] = a * cos[i] - b * sin[i];
      second[i] = b * cos[i] + a * sin[i];
    }
  }
}

// out[r] = silu(gate_up[r, :width]) * gate_up[r, width:].
void silu_times_up(const float* gate_up, int64_t rows, int64_t width, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * 2 * width;
    const float* up = gate + width;
    for (int64_t j = 0; j < width; ++j) {
      const float g = gate[j];
      const float e = fleetserve::exp_nonpositive(-std::abs(g));  // exp(-|g|), never overflows
      const float sigmoid = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
      out[r * width + j] = g * sigmoid * up[j];
    }
  }
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> block_attention_inputs(
    torch::Tensor x, torch::Tensor norm_weight, double eps, BlockWeightArgs qkv,
    std::optional<torch::Tensor> qkv_bias, torch::Tensor cos, torch::Tensor sin, int64_t num_heads,
    int64_t num_kv_heads, bool bf16_products) {
  const Products products = products_of(bf16_products);
  TORCH_CHECK_VALUE(x.dim() == 2, "x: [T, hidden]");
  const int64_t rows = x.size(0), hidden = x.size(1), heads = num_heads + 2 * num_kv_heads;
  const BlockWeightView w = view_of(qkv);
  // the weight's rows are the heads' (q, k and v): the head size follows from them
  TORCH_CHECK_VALUE(heads > 0 && w.k == hidden && w.n % heads == 0 && (w.n / heads) % 2 == 0,
                    "qkv weight: [", num_heads, " + 2 x ", num_kv_heads, " heads of an even size, ", hidden,
                    "], got [", w.n, ", ", w.k, "]");
  const int64_t width = w.n, head_dim = width / heads, half = head_dim / 2;
  check_rows(x, rows, hidden, "x");
  check_rows(norm_weight, 1, hidden, "norm_weight");
  check_rows(cos, rows, half, "cos");
  check_rows(sin, rows, half, "sin");
  if (qkv_bias) check_rows(*qkv_bias, 1, width, "qkv_bias");

  std::vector<float> normed(rows * hidden);
  rms_norm_rows(x.data_ptr<float>(), rows, hidden, norm_weight.data_ptr<float>(), static_cast<float>(eps),
                normed.data());
  auto out = torch::empty({rows, width}, x.options());
  float* y = out.data_ptr<float>();
  block_matmul_into(normed.data(), rows, w, y, products);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = y + r * width;
    if (qkv_bias) {
      const float* bias = qkv_bias->data_ptr<float>();
      for (int64_t j = 0; j < width; ++j) row[j] += bias[j];
    }
    // q and k sit side by side at the row's start: one rotation for both
    rotate_half(row, num_heads + num_kv_heads, head_dim, cos.data_ptr<float>() + r * half,
                sin.data_ptr<float>() + r * half);
  }
  const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  return {out.narrow(1, 0, q_width).view({rows, num_heads, head_dim}),
          out.narrow(1, q_width, kv_width).view({rows, num_kv_heads, head_dim}),
          out.narrow(1, q_width + kv_width, kv_width).view({rows, num_kv_heads, head_dim})};
}

torch::Tensor block_attention_outputs(torch::Tensor x, torch::Tensor attended, BlockWeightArgs o,
                                      torch::Tensor norm_weight, double eps, BlockWeightArgs gate_up,
                                      BlockWeightArgs down, bool bf16_products) {
  const Products products = products_of(bf16_products);
  TORCH_CHECK_VALUE(x.dim() == 2, "x: [T, hidden]");
  const int64_t rows = x.size(0), hidden = x.size(1);
  const BlockWeightView wo = view_of(o), wgu = view_of(gate_up), wd = view_of(down);
  const int64_t inner = wgu.n / 2;
  check_rows(x, rows, hidden, "x");
  check_rows(attended, rows, wo.k, "attended");
  check_rows(norm_weight, 1, hidden, "norm_weight");
  TORCH_CHECK_VALUE(wo.n == hidden && wgu.k == hidden && wgu.n % 2 == 0 && wd.k == inner && wd.n == hidden,
                    "weights: o [", hidden, ", heads x head_dim], gate_up [2 x inner, ", hidden, "], down [", hidden,
                    ", inner], got o [", wo.n, ", ", wo.k, "], gate_up [", wgu.n, ", ", wgu.k, "], down [", wd.n,
                    ", ", wd.k, "]");

  auto out = torch::empty({rows, hidden}, x.options());
  float* residual = out.data_ptr<float>();
  const float* xs = x.data_ptr<float>();
  block_matmul_into(attended.data_ptr<float>(), rows, wo, residual, products);
  for (int64_t j = 0; j < rows * hidden; ++j) residual[j] = xs[j] + residual[j];

  std::vector<float> normed(rows * hidden), projected(rows * wgu.n), activated(rows * inner), mlp(rows * hidden);
  rms_norm_rows(residual, rows, hidden, norm_weight.data_ptr<float>(), static_cast<float>(eps), normed.data());
  block_matmul_into(normed.data(), rows, wgu, projected.data(), products);
  silu_times_up(projected.data(), rows, inner, activated.data());
  block_matmul_into(activated.data(), rows, wd, mlp.data(), products);
  for (int64_t j = 0; j < rows * hidden; ++j) residual[j] += mlp[j];
  return out;
}
