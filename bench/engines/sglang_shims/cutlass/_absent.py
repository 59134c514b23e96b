"""The one mechanism of the `cutlass` stand-in: names that import and never run.

SGLang 0.5.23's Llama MLP builds a `DualGemm` (`sglang/srt/layers/dual_gemm.py`).
On CUDA its mode selection imports `sglang.kernels.ops.gemm.cutedsl_dual_gemm`,
an SM100 (Blackwell) kernel written in the CUTLASS DSL (the `nvidia-cutlass-dsl`
package, not on the device image). That module imports the DSL and decorates
its kernels with `cute.experimental.jit` / `cute.experimental.kernel` when it
loads; then SGLang's own `can_use_dual_gemm` requires `is_sm100_supported()`,
false on the H100 and H200 of the device runs, so `DualGemm`'s mode is None and
nothing of the DSL ever runs: the MLP takes its unfused path.

Every name of this package is an `Absent`: it can be imported, kept, and have
attributes taken (chained names are Absent too); used as a decorator of a
function (`@cute.experimental.jit`) it gives that function's Absent; calling it
any other way raises `NotImplementedError` naming it. A wrong expectation fails
loudly at the first call, never silently. Packed for the device machine only
(`bench/engines/sglang_pack.py`), never installed here or in CI.
"""

from __future__ import annotations

import inspect

WHY = ("the CUTLASS DSL is not on this machine; this import-only stand-in (bench/engines/sglang_shims/cutlass) "
       "expected it never to run: SGLang's DualGemm uses it on SM100 only (can_use_dual_gemm), the device runs "
       "Hopper")


class Absent:
    """One name of the CUTLASS DSL; see the module docstring."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> Absent:
        if len(args) == 1 and not kwargs and inspect.isfunction(args[0]):  # a decorator, at import
            return Absent(f"{self._name}({args[0].__qualname__})")
        raise NotImplementedError(f"{self._name}: {WHY}")

    def __getattr__(self, attr: str) -> Absent:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Absent(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<absent: {self._name}>"


def module_getattr(module: str):  # type: ignore[no-untyped-def]
    """A module's `__getattr__`: every public name an `Absent`."""

    def getattr_(name: str) -> Absent:
        if name.startswith("__"):
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return Absent(f"{module}.{name}")

    return getattr_
