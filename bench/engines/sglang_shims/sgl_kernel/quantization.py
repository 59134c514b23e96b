"""Stand-in for `sgl_kernel.quantization` (see `sgl_kernel._not_built`)."""

from sgl_kernel._not_built import export

export(globals(), __name__, {
    "unquantized": ("ggml_dequantize", "ggml_moe_a8", "ggml_moe_a8_vec", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8"),
})  # fmt: skip
