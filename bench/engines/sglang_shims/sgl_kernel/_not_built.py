"""The one mechanism of the `sgl_kernel` stand-in: names that import and never run.

`bench/engines/sglang_pack.py` packs this package as `sgl_kernel/` for the device
machine only (never installed here or in CI); `bench/engines/sglang_shims/README.md`
says why sgl-kernel 0.4.10 itself cannot be there and, for each reason below,
why the names it covers never execute in the runs of `bench/device/sglang.sh`.

Every exported name is a `NotBuilt`: SGLang can import it, keep it in a
table, take attributes of it (`scalar_types.uint4b8`: chained names are
NotBuilt too), but calling it raises `NotImplementedError` naming the op and
the reason it was expected never to run. A wrong reason therefore fails
loudly at the first call, never silently.

Names SGLang imports only inside `try`/`except ImportError` are left out, so
SGLang takes its own fallback for them (a missing name raises AttributeError,
which `from sgl_kernel import NAME` turns into ImportError).
"""

from __future__ import annotations

from collections.abc import Mapping

#: Why a group of names never executes in the device runs (keys of each module's `NAMES`).
REASONS: dict[str, str] = {
    "fused-op-torch": "SGLANG_FORCE_FUSED_OP_BACKEND=torch: norms, activations and rope run their forward_native",
    "sampling-pytorch": "--sampling-backend pytorch, greedy requests",
    "attention-triton": "--attention-backend triton (or torch_native): other attention backends' kernels",
    "dense-model": "a dense model (first_k_dense_replace = num_hidden_layers): no MoE routing or expert kernels",
    "unquantized": "bf16 weights and KV: no quantization method runs",
    "no-speculative": "no speculative decoding",
    "other-platform": "kernels of SGLang's CPU, XPU or MUSA platforms; the device runs are CUDA",
    "other-model": "model families not run here (DSA/DeepSeek-V4 indexer and compression, hyper-connections, "
    "linear attention, MiniCPM sparse attention, vision towers, Qwen3 fused q/k norm)",
    "no-cuda-graph": "--disable-cuda-graph: weak references serve graph capture only",
    "no-grammar": "no request carries a grammar (constrained decoding)",
    "no-pd-multiplexing": "PD multiplexing is off",
    "hicache-transfer": "SGLang's HiCache io backend `kernel` with MLA pools runs SGLang's own JIT kernels "
    "(kvcacheio/hicache.cuh, staged_write_back.cuh); the DSA indexer host pool and the `direct` backend DO "
    "call these: those runs raise here and are reported as not runnable",
    "no-hisparse": "hierarchical sparse attention (HiSparse) is off",
}


class NotBuilt:
    """One sgl_kernel name of a build that is not on this machine; calling it raises."""

    __slots__ = ("_name", "_reason")

    def __init__(self, name: str, reason: str) -> None:
        self._name = name
        self._reason = reason

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"{self._name}: sgl-kernel is not on this machine (its 0.4.10 binary does not load on torch 2.11); "
            f"this import-only stand-in (bench/engines/sglang_shims) expected it never to run: {REASONS[self._reason]}"
        )

    def __getattr__(self, attr: str) -> NotBuilt:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return NotBuilt(f"{self._name}.{attr}", self._reason)

    def __repr__(self) -> str:
        return f"<not built: {self._name}>"


def export(namespace: dict[str, object], module: str, names: Mapping[str, tuple[str, ...]]) -> None:
    """Bind every name of `names` (reason -> names) in `namespace` as a NotBuilt of `module`."""
    for reason, group in names.items():
        if reason not in REASONS:
            raise KeyError(f"{module}: unknown reason {reason!r} (one of {sorted(REASONS)})")
        for name in group:
            namespace[name] = NotBuilt(f"{module}.{name}", reason)
