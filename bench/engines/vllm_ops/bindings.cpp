// Registers the vLLM 0.33.0 ops that vLLM's V2 GPU model runner (TRITON_ATTN, native custom
// ops) and its OffloadingConnector's CUDA worker execute, from vLLM's own sources, as the
// module `vllm._C_stable_libtorch` (what vllm/platforms/cuda.py imports).
//
// This file is hicache-cp's; every function it registers is vLLM's, compiled from the
// vLLM 0.33.0 sdist's csrc by bench/engines/vllm_ops/build.py:
//
//   op (namespace)                               vLLM source
//   _C::get_cuda_view_from_cpu_tensor            csrc/cuda_view.cu
//   _C::rms_norm, _C::fused_add_rms_norm         csrc/layernorm_kernels.cu
//   _C::silu_and_mul                             csrc/activation_kernels.cu
//   _C::weak_ref_tensor                          csrc/ops.h (inline; CUDA-graph capture)
//   _C::cutlass_scaled_mm_supports_fp8,          csrc/quantization/w8a8/cutlass/scaled_mm_entry.cu
//       cutlass_scaled_mm_supports_block_fp8,    (capability queries; no CUTLASS kernel is built,
//       cutlass_group_gemm_supported             so no scaled-mm op is registered)
//   _C::cutlass_scaled_mm_supports_fp4           csrc/quantization/fp4/nvfp4_scaled_mm_entry.cu
//   _C_cache_ops::swap_blocks, swap_blocks_batch csrc/cache_kernels.cu (the OffloadingConnector)
//
// The schemas are vLLM's (csrc/torch_bindings.cpp); only the subset above is registered, so
// any other op vLLM might call fails loudly ("no such operator"), never silently.

#include "ops.h"
#include "core/registration.h"

#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY_FRAGMENT(_C, ops) {
  ops.def("get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor");
  ops.def(
      "rms_norm(Tensor! result, Tensor input, Tensor? weight, float epsilon) "
      "-> ()");
  ops.def(
      "fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor? weight, "
      "float epsilon) -> ()");
  ops.def("silu_and_mul(Tensor! result, Tensor input) -> ()");
  ops.def("weak_ref_tensor(Tensor input) -> Tensor");
  ops.def("cutlass_scaled_mm_supports_fp8(int cuda_device_capability) -> bool");
  ops.def(
      "cutlass_scaled_mm_supports_block_fp8(int cuda_device_capability) -> "
      "bool");
  ops.def("cutlass_group_gemm_supported(int cuda_device_capability) -> bool");
  ops.def("cutlass_scaled_mm_supports_fp4(int cuda_device_capability) -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(_C, CUDA, ops) {
  ops.impl("rms_norm", TORCH_BOX(&rms_norm));
  ops.impl("fused_add_rms_norm", TORCH_BOX(&fused_add_rms_norm));
  ops.impl("silu_and_mul", TORCH_BOX(&silu_and_mul));
  ops.impl("weak_ref_tensor", TORCH_BOX(&weak_ref_tensor));
}

STABLE_TORCH_LIBRARY_IMPL(_C, CPU, ops) {
  ops.impl("get_cuda_view_from_cpu_tensor",
           TORCH_BOX(&get_cuda_view_from_cpu_tensor));
}

STABLE_TORCH_LIBRARY_IMPL(_C, CompositeExplicitAutograd, ops) {
  ops.impl("cutlass_scaled_mm_supports_fp8",
           TORCH_BOX(&cutlass_scaled_mm_supports_fp8));
  ops.impl("cutlass_scaled_mm_supports_block_fp8",
           TORCH_BOX(&cutlass_scaled_mm_supports_block_fp8));
  ops.impl("cutlass_group_gemm_supported",
           TORCH_BOX(&cutlass_group_gemm_supported));
  ops.impl("cutlass_scaled_mm_supports_fp4",
           TORCH_BOX(&cutlass_scaled_mm_supports_fp4));
}

STABLE_TORCH_LIBRARY_FRAGMENT(_C_cache_ops, ops) {
  ops.def(
      "swap_blocks(Tensor src, Tensor! dst,"
      "            int block_size_in_bytes, Tensor block_mapping) -> ()");
  ops.def(
      "swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs,"
      "                  Tensor sizes,"
      "                  bool is_src_access_order_any=False) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(_C_cache_ops, CPU, ops) {
  ops.impl("swap_blocks_batch", TORCH_BOX(&swap_blocks_batch));
}

STABLE_TORCH_LIBRARY_IMPL(_C_cache_ops, CUDA, ops) {
  ops.impl("swap_blocks", TORCH_BOX(&swap_blocks));
}

REGISTER_EXTENSION(_C_stable_libtorch)
