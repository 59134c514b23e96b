"""Shim for vLLM 0.33.0's compiled `vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so` (packed by bench/engines/vllm_pack.py
for the device machine only).

Why: on the CUDA platform `vllm/v1/attention/backends/fa_utils.py` imports
`vllm.vllm_flash_attn` at module level, and that package raises ImportError
unless one of its compiled extensions imports. Every model module imports
fa_utils (through `vllm.model_executor.layers.attention`), and vLLM's
`ModelConfig` imports the model's module to inspect its architecture, so the
scheduler's config cannot be built without it. The .so is built for torch
2.14's ABI and is not packed.

What it stands in for: the import only. No flash-attention kernel runs in the
connector's tests (the fake model runner writes KV with torch). A call would
reach `torch.ops._vllm_fa2_C.*`, which this module does not register: it fails
loudly ("no such operator"), never computes anything.
"""
