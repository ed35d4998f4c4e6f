// Python bindings of the CPU kernels: one extension module, built once (kernels/cpu_extension.py).
#include "block_weight.h"
#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over KV pools read in place (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("with_lse"), py::arg("row_order") = py::none());
  m.def("paged_decode_tiles", &paged_decode_tiles, "paged_decode over the paired layout on the AMX tiles (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("with_lse"), py::arg("row_order") = py::none());
  m.def("amx_tiles_usable", &amx_tiles_usable, "whether paged_decode_tiles runs here (AMX built and granted)");
  m.def("paired_kv_layout_built", &paired_kv_layout_built,
        "whether paged_decode reads the paired KV layout here (bf16 on a CPU with AVX-512 BF16)");
  m.def("paired_write_kv", &paired_write_kv, "the new tokens' K/V stored at their slots of paired-layout pools (CPU)",
        py::arg("k_cache"), py::arg("v_cache"), py::arg("k"), py::arg("v"), py::arg("slots"));
  m.def("paired_gather", &paired_gather, "blocks of a paired-layout K (key) or V pool in the tokens layout (CPU)",
        py::arg("cache"), py::arg("key"), py::arg("blocks"));
  m.def("softmax_lse_", &softmax_lse_, "in-place softmax of scaled scores over visible keys, returning the lse (CPU)",
        py::arg("scores"), py::arg("visible"), py::arg("scale"));
  m.def("sample_rows", &sample_rows, "one token per row: first largest (temperature 0) or drawn from softmax(x / temperature) (CPU)", py::arg("x"),
        py::arg("temperatures"), py::arg("uniforms"));
  m.def("apply_token_bitmask_", &apply_token_bitmask_,
        "a grammar's token bitmask applied to logits rows in place: forbidden tokens become -inf (CPU)",
        py::arg("logits"), py::arg("bitmask"), py::arg("rows"));
  m.def("block_matmul", &block_matmul,
        "x @ W^T for a weight in blocks of 32 columns (scale * code + minimum), read in place, float activations (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("minimums"), py::arg("bits"),
        py::arg("bf16_products") = false);
  m.def("block_products_bf16_built", &bf16_products_built,
        "whether block_matmul has bfloat16 products here (a CPU with AVX-512 BF16)");
  m.def("block_dequantize", &block_dequantize, "a weight in blocks of 32 columns dequantized to float32 (CPU)",
        py::arg("packed"), py::arg("scales"), py::arg("minimums"), py::arg("bits"));
  m.def("block_attention_inputs", &block_attention_inputs,
        "a layer's RMSNorm, QKV projection (block weight) and rotary for a few rows (CPU)", py::arg("x"),
        py::arg("norm_weight"), py::arg("eps"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("cos"), py::arg("sin"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("bf16_products") = false);
  m.def("block_attention_outputs", &block_attention_outputs,
        "a layer's output projection, residual, RMSNorm, SwiGLU MLP and residual (block weights) for a few rows (CPU)",
        py::arg("x"), py::arg("attended"), py::arg("o"), py::arg("norm_weight"), py::arg("eps"), py::arg("gate_up"),
        py::arg("down"), py::arg("bf16_products") = false);
  m.def("tile_quant_matmul", &tile_quant_matmul,
        "x @ W^T on the AMX tiles (else AVX-512 BF16 vectors) for a weight in 4- or 8-bit codes, a scale and "
        "minimum per group of columns (CPU)",
        py::arg("x"), py::arg("codes"), py::arg("group_scales"), py::arg("group_minimums"), py::arg("super_scales"),
        py::arg("super_minimums"), py::arg("bits"), py::arg("group"), py::arg("super_columns"),
        py::arg("bias") = py::none(), py::arg("vectors") = false);
  m.def("quantize_rows_int8", &quantize_rows_int8,
        "rows as int8 codes with one scale a row (largest magnitude / 127, nearest even) (CPU)", py::arg("x"));
  m.def("scale_int32_rows", &scale_int32_rows,
        "an int8 GEMM's int32 sums times their row's and column's scales, plus bias, in dtype (CPU)",
        py::arg("sums"), py::arg("row_scales"), py::arg("column_scales"), py::arg("bias"), py::arg("dtype"));
  m.def("tile_quant_matmul_usable", &tile_quant_matmul_usable,
        "whether tile_quant_matmul runs here (AMX built and granted, or AVX-512 BF16 built)");
  m.def("tile_quant_matmul_on_tiles", &tile_quant_matmul_on_tiles,
        "whether tile_quant_matmul runs on the AMX tiles here (else in AVX-512 BF16 vectors)");
}
