"""Shim for vLLM 0.33.0's compiled `vllm/_C_stable_libtorch.abi3.so` (bench/engines/vllm_pack.py packs it as
`vllm/_C_stable_libtorch.py` on the device machine only; never installed here or in CI).

Why: `vllm/platforms/cuda.py` imports the compiled op library at module level
(`import vllm._C_stable_libtorch`, to register its CUDA kernels as `torch.ops._C.*`).
vLLM picks the CUDA platform on a GPU machine, so importing vLLM's scheduler and
config there imports it. The .so is built against torch 2.14's C++ ABI and cannot
load on the image's torch 2.11, and it is not packed.

What it registers: the CUTLASS capability queries that vLLM *runs at import time*
(`vllm/model_executor/layers/quantization/utils/w8a8_utils.py` sets
`CUTLASS_BLOCK_FP8_SUPPORTED = cutlass_block_fp8_supported()` when a model module is
imported, which `ModelConfig` does to inspect the architecture). Each answers False:
the truth for this build, which has no CUTLASS kernel at all. These are the only
compiled vLLM functions the tests execute, and they compute nothing: capability
flags. No kernel is registered: the connector's tests never call one (the fake model
runner writes KV with torch; the copies are hicache-cp's engines), and anything that
does fails loudly ("no such operator _C::..."), never silently.
"""

import torch

#: op name -> schema; every one a capability query answered False (no CUTLASS kernels packed).
_CAPABILITY_QUERIES = {
    "cutlass_scaled_mm_supports_fp4": "(int cuda_device_capability) -> bool",
    "cutlass_scaled_mm_supports_fp8": "(int cuda_device_capability) -> bool",
    "cutlass_scaled_mm_supports_block_fp8": "(int cuda_device_capability) -> bool",
    "cutlass_group_gemm_supported": "(int cuda_device_capability) -> bool",
}

_lib = torch.library.Library("_C", "FRAGMENT")


def _unsupported(cuda_device_capability: int) -> bool:
    return False


for _name, _schema in _CAPABILITY_QUERIES.items():
    if not hasattr(torch.ops._C, _name):
        _lib.define(_name + _schema)
        _lib.impl(_name, _unsupported, "CompositeExplicitAutograd")
