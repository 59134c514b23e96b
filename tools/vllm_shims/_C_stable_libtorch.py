"""Shim for vLLM 0.33.0's compiled `vllm/_C_stable_libtorch.abi3.so` (tools/vllm_pack.py packs it as
`vllm/_C_stable_libtorch.py` on the device machine only; never installed here or in CI).

Why: `vllm/platforms/cuda.py` imports the compiled op library at module level
(`import vllm._C_stable_libtorch`, to register its CUDA kernels as `torch.ops._C.*`).
vLLM picks the CUDA platform on a GPU machine, so importing vLLM's scheduler and
config there imports it. The .so is built against torch 2.14's C++ ABI and cannot
load on the image's torch 2.11, and it is not packed.

What it stands in for: op registration only. The connector's tests never call a
vLLM kernel (the fake model runner writes KV with torch; the copies are hicache-cp's
engines), so nothing reaches `torch.ops._C`. Anything that does fails loudly
(AttributeError / "no such operator"), never silently: this module registers nothing.
"""
