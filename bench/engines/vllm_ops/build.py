"""Build the vLLM 0.33.0 ops that vLLM's V2 GPU model runner and its OffloadingConnector run,
from the vLLM sdist's own CUDA sources, as `vllm._C_stable_libtorch` (on the device machine).

    python3 bench/engines/vllm_ops/build.py --csrc .vllm/csrc --site /tmp/vllm-site [--jobs 16] [--json OUT]

The vLLM wheel's compiled library (92 MB) is too large to carry; vLLM's sdist has the sources.
This compiles, with torch.utils.cpp_extension (ninja, `--jobs` in parallel) against the
image's torch (vLLM's own flags: C++20, `TORCH_TARGET_VERSION` 2.11, USE_CUDA, ENABLE_FP8,
sm_90), the vLLM source files `SOURCES` and `bindings.cpp` beside this file (hicache-cp's: it
registers the subset of ops those files define, with vLLM's schemas), and installs the
library as `<site>/vllm/_C_stable_libtorch.abi3.so`, replacing the packed import shim. It
then imports it in a fresh process and lists the registered ops. Writes a JSON report
(commit, machine, command, sources, seconds, ops, errors) whatever happens; exit status 0
only if the library loads.

`.vllm/csrc` is packed by bench/engines/vllm_pack.py (`--sdist`): the closure of the includes of
`SOURCES` in the sdist's csrc, and of `cutlass/cutlass.h` in the nvidia-cutlass wheel's
headers (scaled_mm_entry.cu includes it for CUTLASS's status type; no CUTLASS kernel is
built, so the capability queries answer as vLLM does in a build without them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository: hicache_harness.provenance

#: vLLM 0.33.0 csrc files compiled (paths under csrc/); bindings.cpp says which op each defines.
SOURCES = [
    "cuda_view.cu",
    "layernorm_kernels.cu",
    "activation_kernels.cu",
    "cache_kernels.cu",
    "quantization/w8a8/cutlass/scaled_mm_entry.cu",
    "quantization/fp4/nvfp4_scaled_mm_entry.cu",
]

#: The ops a working build registers (checked after the import).
EXPECTED_OPS = {
    "_C": ["get_cuda_view_from_cpu_tensor", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "weak_ref_tensor",
           "cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8",
           "cutlass_group_gemm_supported", "cutlass_scaled_mm_supports_fp4"],
    "_C_cache_ops": ["swap_blocks", "swap_blocks_batch"],
}

#: vLLM's CMake flags for this library (CMakeLists.txt, cmake/utils.cmake) that differ from
#: torch.utils.cpp_extension's defaults.
CXX_FLAGS = ["-std=c++20", "-O2", "-DUSE_CUDA", "-DTORCH_TARGET_VERSION=0x020B000000000000ULL"]
CUDA_FLAGS = [*CXX_FLAGS, "-DENABLE_FP8", "--expt-relaxed-constexpr", "--expt-extended-lambda",
              "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"]


def blas_include_dirs(build_dir: Path, report: dict) -> list[str]:
    """Folders holding cublas_v2.h (vLLM's torch_utils.h includes it for the type of one
    inline helper, `get_current_cuda_blas_handle`, that none of the built ops calls): the
    CUDA toolkit's, else the nvidia pip packages' beside torch, else a one-line
    declaration of that opaque handle type written into the build folder (recorded in
    the report: it declares a type, it runs nothing)."""
    import torch.utils.cpp_extension as ext

    roots = [Path(ext.CUDA_HOME or "/usr/local/cuda") / "include"]
    import torch

    site = Path(torch.__file__).resolve().parent.parent
    roots += sorted(site.glob("nvidia/*/include"))
    found = [str(r) for r in roots if (r / "cublas_v2.h").exists()]
    report["cublas_header"] = found[0] if found else "declaration of cublasHandle_t (no cuBLAS headers here)"
    if found:
        return found[:1]
    decl = build_dir / "cublas-decl"
    decl.mkdir(parents=True, exist_ok=True)
    (decl / "cublas_v2.h").write_text("#pragma once\ntypedef struct cublasContext* cublasHandle_t;\n")
    return [str(decl)]


def driver_link_flags() -> list[str]:
    """Link flags for the CUDA driver library (cache_kernels.cu's swap_blocks_batch reaches
    cuMemcpyBatchAsync through cuGetProcAddress): the toolkit's stub, else the driver's own."""
    import torch.utils.cpp_extension as ext

    home = Path(ext.CUDA_HOME or "/usr/local/cuda")
    for d in (home / "lib64" / "stubs", home / "targets" / "x86_64-linux" / "lib" / "stubs"):
        if (d / "libcuda.so").exists():
            return [f"-L{d}", "-lcuda"]
    dirs = [d for d in ("/usr/lib/x86_64-linux-gnu", "/usr/local/nvidia/lib64", "/usr/lib64")
            if Path(d, "libcuda.so.1").exists()]
    if not dirs:
        raise RuntimeError("no CUDA driver library (libcuda.so stub or libcuda.so.1) to link")
    return [f"-L{dirs[0]}", "-l:libcuda.so.1"]


def build(csrc: Path, build_dir: Path, jobs: int, report: dict) -> Path:
    import torch.utils.cpp_extension as ext

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    os.environ["MAX_JOBS"] = str(jobs)
    missing = [s for s in SOURCES if not (csrc / s).is_file()]
    if missing:
        raise FileNotFoundError(f"vLLM sources missing under {csrc}: {missing} (bench/engines/vllm_pack.py --sdist packs them)")
    build_dir.mkdir(parents=True, exist_ok=True)
    includes = [str(csrc), str(csrc.parent / "cutlass" / "include"), *blas_include_dirs(build_dir, report)]
    sources = [str(HERE / "bindings.cpp"), *(str(csrc / s) for s in SOURCES)]
    return Path(ext.load(
        name="_C_stable_libtorch", sources=sources, extra_cflags=CXX_FLAGS, extra_cuda_cflags=CUDA_FLAGS,
        extra_include_paths=includes, extra_ldflags=driver_link_flags(), build_directory=str(build_dir),
        is_python_module=False, verbose=True,
    ))


CHECK = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import vllm._C_stable_libtorch  # noqa: F401 - registers the ops
out = {ns: sorted(n for n in names if hasattr(getattr(torch.ops, ns), n)) for ns, names in json.loads(sys.argv[2]).items()}
x = torch.arange(6, dtype=torch.float32).reshape(2, 3).pin_memory()
view = torch.ops._C.get_cuda_view_from_cpu_tensor(x)
out["uva_view_ok"] = bool(view.is_cuda and torch.equal(view.cpu(), x))
out["supports_fp8_sm90"] = bool(torch.ops._C.cutlass_scaled_mm_supports_fp8(90))
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> int:
    from hicache_harness.provenance import git_commit, machine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csrc", type=Path, required=True, help="the packed vLLM csrc folder")
    ap.add_argument("--site", type=Path, required=True, help="where vllm/ is (the library goes into vllm/)")
    ap.add_argument("--build-dir", type=Path, default=Path("/tmp/vllm-ops-build"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    command = ["python3", "bench/engines/vllm_ops/build.py", *(sys.argv[1:] if argv is None else argv)]
    report: dict = {"commit": git_commit(), "machine": machine(), "command": " ".join(command),
                    "sources": SOURCES, "ok": False}
    t0 = time.perf_counter()
    try:
        lib = build(args.csrc, args.build_dir, args.jobs, report)
        report["build_s"] = round(time.perf_counter() - t0, 1)
        dest = args.site / "vllm" / "_C_stable_libtorch.abi3.so"
        shim = args.site / "vllm" / "_C_stable_libtorch.py"
        if shim.exists():
            shim.unlink()  # the import shim stood in for this library
        shutil.copy2(lib, dest)
        report["library"] = {"path": str(dest), "bytes": dest.stat().st_size}
        check = subprocess.run([sys.executable, "-c", CHECK, str(args.site), json.dumps(EXPECTED_OPS)],
                               capture_output=True, text=True, timeout=120)
        if check.returncode:
            raise RuntimeError(f"import check failed: {check.stderr[-3000:]}")
        report["ops"] = json.loads(check.stdout.strip().splitlines()[-1])
        missing = {ns: sorted(set(n) - set(report["ops"].get(ns, []))) for ns, n in EXPECTED_OPS.items()}
        report["missing_ops"] = {ns: m for ns, m in missing.items() if m}
        report["ok"] = not report["missing_ops"] and report["ops"]["uva_view_ok"]
    except BaseException as exc:  # noqa: BLE001 - a build step: record what stopped it
        report["error"] = f"{type(exc).__name__}: {str(exc)[-3000:]}"
        report["traceback_tail"] = traceback.format_exc()[-4000:]
        traceback.print_exc()
    report["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "traceback_tail"}, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
