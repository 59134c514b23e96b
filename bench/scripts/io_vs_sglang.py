"""Race SGLang 0.5.23's own HiCache copy kernels against this project's copy engines (issue 28).

Run on a CUDA machine from the repository root, with SGLang's kernel sources
extracted from its wheel (never committed) and apache-tvm-ffi importable:

    python3 bench/scripts/io_vs_sglang.py --sglang-src .sglang_src/sglang/kernels/jit --json bench/results/io-vs-sglang-h200.json

`.sglang_src/` holds, from the sglang 0.5.23 wheel, `sglang/kernels/jit/include/`
and `sglang/kernels/jit/csrc/kvcacheio/hicache.cuh`, `hicache_tma.cuh`.

Build: SGLang's own loader (`sglang.kernels.jit.utils.load_jit`) imports most
of sglang's server stack (transformers, pydantic, zmq, ...), which the device
image lacks. This tool does what that loader does for these two modules and
nothing else: the same wrapper source (tvm-ffi headers, the .cuh, one
`TVM_FFI_DLL_EXPORT_TYPED_FUNC` per entry point), the same template arguments
as `sglang/kernels/ops/kvcache/hicache.py` (register kernel
`HiCacheKernel<row, unroll, 2 blocks, 1024 threads>`, TMA kernel
`HiCacheTmaKernel<32 KB stages, 6 stages, 4 store warps, 4 CTAs>`), the same
flags (`-DSGL_CUDA_ARCH=900 -std=c++20 -O3 --expt-relaxed-constexpr`, sm_90a), linked against
libtvm_ffi and libcudart, loaded with `tvm_ffi.load_module`.

Contestants, all on the same pages (random, scattered on both sides) of one
MLA layer per call, row 1152 B (576 bf16: the 128-byte multiple the register
kernel needs on CUDA), 64-token pages (73,728 B):

    sglang-register   its register kernel, `launch_one_mla`, host page-first
                      ([token][layer][row]: SGLang's kernel layout) and layer-first
    sglang-tma        its TMA kernel, the same two host layouts
    sglang-direct     its direct path's shape: one cudaMemcpyAsync per page
                      (a page's layer slice is contiguous in page_first_direct),
                      issued here from a Python loop (SGLang loops in C++: its
                      submit time is lower than this row's; the GPU side is the same)
    ours-<backend>    this project's engines (`--ours`), the cache's planned path

Each SGLang call runs on a copy stream ordered after the caller's stream by an
event and records an event after itself, as SGLang's controller does; token
indices live on the device, made once per op. Measured per contestant: GB/s
both ways against the contiguous peak (link ratio), the host time of one
layer's submission (median, p99), and the exposure beside the same
compute-bound forward as bench-io's (`exposed_load_fraction`,
`exposed_backup_fraction`). Every failure is recorded in the JSON, never
skipped silently.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hicache_harness.bench.io import _Gate, _gbps, _median_ms, measure_overlap, measure_peak  # noqa: E402
from hicache_harness.outputs import write_json  # noqa: E402
from hicache_harness.provenance import git_commit, machine  # noqa: E402
from hicache_cp.io.base import Direction, TicketState, make_engine  # noqa: E402
from hicache_cp.layout import KVLayout, Part  # noqa: E402

SGLANG_VERSION = "0.5.23"
ROW = 1152
PAGE_TOKENS = 64
TMA_ARGS = (32 * 1024, 6, 4, 4)  # TMA_STAGE_BYTES, TMA_NUM_STAGES, TMA_STORE_WARPS, TMA_BLOCK_QUOTA
REGISTER_QUOTA = 2  # DEFAULT_BLOCK_QUOTA on CUDA
_WRAPPER_HEADERS = (
    "#include <tvm/ffi/container/tensor.h>",
    "#include <tvm/ffi/dtype.h>",
    "#include <tvm/ffi/error.h>",
    "#include <tvm/ffi/extra/c_env_api.h>",
    "#include <tvm/ffi/function.h>",
)


def _default_unroll(row: int) -> int:  # sglang's _default_unroll
    return 4 if row <= 512 else 2 if row <= 1024 else 1


def build(src: Path, out: Path, name: str, cuh: str, kernel: str, exports: list[str]) -> Any:
    """Compile one SGLang module as its loader would; returns the tvm-ffi module."""
    import tvm_ffi
    from tvm_ffi.libinfo import find_dlpack_include_path, find_include_path, find_libtvm_ffi

    out.mkdir(parents=True, exist_ok=True)
    wrapper = out / f"{name}.cu"
    lines = [*_WRAPPER_HEADERS, f'#include "{(src / "csrc" / "kvcacheio" / cuh).resolve()}"', "namespace sglang {"]
    lines += [f"TVM_FFI_DLL_EXPORT_TYPED_FUNC({e}, (&{kernel}::{m}));" for e, m in (x.split("=") for x in exports)]
    lines.append("}  // namespace sglang")  # as sglang's _wrapper_source: the kernels live in namespace sglang
    wrapper.write_text("\n".join(lines) + "\n")
    lib = Path(find_libtvm_ffi())
    includes = [find_include_path(), find_dlpack_include_path(), str((src / "include").resolve())]
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    obj, so = out / f"{name}.o", out / f"{name}.so"
    major, minor = torch.cuda.get_device_capability()
    nvcc = [f"{cuda_home}/bin/nvcc", "-Xcompiler", "-fPIC", f"-gencode=arch=compute_{major}{minor}a,code=sm_{major}{minor}a",
            f"-DSGL_CUDA_ARCH={major * 100 + minor * 10}", "-std=c++20", "-O3", "--expt-relaxed-constexpr", *[f"-I{p}" for p in dict.fromkeys(includes)], "-c", str(wrapper), "-o", str(obj)]
    t0 = time.perf_counter()
    subprocess.run(nvcc, check=True, capture_output=True, text=True)
    link = ["g++", str(obj), "-shared", f"-L{lib.parent}", f"-l{lib.stem.removeprefix('lib')}", f"-L{cuda_home}/lib64",
            "-lcudart", "-o", str(so)]
    subprocess.run(link, check=True, capture_output=True, text=True)
    print(f"[io-vs-sglang] built {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return tvm_ffi.load_module(str(so))


class SglangCopier:
    """One SGLang kernel module driven like SGLang's controller: per layer one
    `launch_one_mla` on a copy stream, ordered after compute by an event."""

    def __init__(self, module: Any, layers: int, pages: int, page_first: bool) -> None:
        tokens = pages * PAGE_TOKENS
        self.module = module
        self.layers = layers
        self.page_first = page_first
        self.device = [torch.empty(tokens, ROW, dtype=torch.uint8, device="cuda") for _ in range(layers)]
        shape = (tokens, layers, ROW) if page_first else (layers, tokens, ROW)
        self.host = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        self.streams = {d: torch.cuda.Stream() for d in Direction}

    def host_layer(self, layer: int) -> torch.Tensor:
        return self.host[:, layer, :] if self.page_first else self.host[layer]

    def plan(self, direction: Direction, dev_pages: np.ndarray, host_pages: np.ndarray) -> tuple[Direction, torch.Tensor, torch.Tensor]:
        tok = np.arange(PAGE_TOKENS)
        d = torch.from_numpy((dev_pages[:, None] * PAGE_TOKENS + tok).reshape(-1)).cuda()
        h = torch.from_numpy((host_pages[:, None] * PAGE_TOKENS + tok).reshape(-1)).cuda()
        return direction, d, h

    def submit(self, plan: tuple[Direction, torch.Tensor, torch.Tensor], layer: int) -> Any:
        direction, d_idx, h_idx = plan
        stream = self.streams[direction]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if direction is Direction.D2H:
                self.module.launch_one_mla(self.host_layer(layer), h_idx, self.device[layer], d_idx)
            else:
                self.module.launch_one_mla(self.device[layer], d_idx, self.host_layer(layer), h_idx)
            ev = torch.cuda.Event()
            ev.record(stream)
        return _EventTicket(ev)


class DirectCopier(SglangCopier):
    """SGLang's direct path's shape: one cudaMemcpyAsync per page (page_first_direct)."""

    def __init__(self, layers: int, pages: int) -> None:
        from hicache_cp.io.cudadrv import driver

        self.drv = driver()
        self.layers = layers
        self.page_bytes = PAGE_TOKENS * ROW
        self.device = [torch.empty(pages, self.page_bytes, dtype=torch.uint8, device="cuda") for _ in range(layers)]
        self.host = torch.empty(pages, layers, self.page_bytes, dtype=torch.uint8, pin_memory=True)  # [page][layer][page]
        self.streams = {d: torch.cuda.Stream() for d in Direction}

    def plan(self, direction: Direction, dev_pages: np.ndarray, host_pages: np.ndarray) -> Any:
        return direction, dev_pages.tolist(), host_pages.tolist()

    def submit(self, plan: Any, layer: int) -> Any:
        direction, dev_pages, host_pages = plan
        stream = self.streams[direction]
        stream.wait_stream(torch.cuda.current_stream())
        dev0, host0, pb = self.device[layer].data_ptr(), self.host.data_ptr() + layer * self.page_bytes, self.page_bytes
        hstride, handle, copy = self.layers * pb, stream.cuda_stream, self.drv.memcpy_async
        if direction is Direction.D2H:
            for d, h in zip(dev_pages, host_pages):
                copy(host0 + h * hstride, dev0 + d * pb, pb, handle)
        else:
            for d, h in zip(dev_pages, host_pages):
                copy(dev0 + d * pb, host0 + h * hstride, pb, handle)
        ev = torch.cuda.Event()
        ev.record(stream)
        return _EventTicket(ev)


class _EventTicket:
    def __init__(self, ev: torch.cuda.Event) -> None:
        self.ev = ev

    def make_compute_wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.ev)

    def query(self) -> TicketState:
        return TicketState.DONE if self.ev.query() else TicketState.PENDING

    def wait(self) -> None:
        self.ev.synchronize()


class _AsEngine:
    """Gives a copier the two calls bench-io's overlap test makes of an engine."""

    def __init__(self, copier: Any, pages: int) -> None:
        self.copier = copier
        self.layout = KVLayout.build(page_size=1, num_layers=copier.layers, kv_bytes_per_token=ROW * PAGE_TOKENS)
        self.device_pool = type("P", (), {"physical_pages": pages})()
        self.host_pool = self.device_pool

    def plan(self, direction: Direction, d: np.ndarray, h: np.ndarray) -> Any:
        return self.copier.plan(direction, d, h)

    def submit_layer(self, plan: Any, parts: tuple[Part, ...], layer: int) -> list[Any]:
        return [self.copier.submit(plan, layer)]

    def submit_layers(self, plan: Any, jobs: list[tuple[tuple[Part, ...], int]]) -> list[list[Any]]:
        """A load's every layer at once (bench-io's overlap test): one call per layer, as SGLang."""
        return [self.submit_layer(plan, parts, layer) for parts, layer in jobs]


def measure(gate: _Gate, engine: Any, n: int, pages: int, rng: np.random.Generator, layers: int) -> dict[str, float]:
    """GB/s and submit host time per layer, both directions, over `n` scattered pages."""
    out: dict[str, float] = {}
    dev = rng.permutation(np.arange(1, pages))[:n].astype(np.int64)
    host = rng.permutation(np.arange(1, pages))[:n].astype(np.int64)
    for label, direction in (("d2h", Direction.D2H), ("h2d", Direction.H2D)):
        plan = engine.plan(direction, dev, host)
        times: list[float] = []

        def enqueue() -> None:
            t = None
            for layer in range(layers):
                t0 = time.perf_counter()
                t = engine.submit_layer(plan, (Part.TARGET_KV,), layer)[0]
                times.append((time.perf_counter() - t0) * 1e6)
            t.make_compute_wait()

        ms, _ = _median_ms(gate, enqueue)
        out[f"{label}_gbps"] = _gbps(n * PAGE_TOKENS * ROW * layers, ms)
        warm = times[layers:]  # the first batch is _median_ms's warm-up
        out[f"{label}_submit_us"] = float(np.median(warm))
        out[f"{label}_submit_us_p99"] = float(np.percentile(warm, 99))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang-src", type=Path, default=Path(".sglang_src/sglang/kernels/jit"),
                    help="the wheel's sglang/kernels/jit folder (csrc/ and include/)")
    ap.add_argument("--build-dir", type=Path, default=Path("/tmp/sglang_jit"))
    ap.add_argument("--pages", type=int, default=1024, help="pages per layer")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ours", default="direct,direct-inline,hybrid", help="bench-io variants of ours")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("io-vs-sglang: needs CUDA", file=sys.stderr)
        return 2
    from hicache_harness.bench.io_variants import VARIANTS

    pool_pages = 2 * args.pages + 1
    rng = np.random.default_rng(0)
    gate = _Gate()
    result: dict[str, Any] = {
        "command": "python3 bench/scripts/io_vs_sglang.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": git_commit(), "machine": torch.cuda.get_device_name(), "host": machine(),
        "sglang_version": SGLANG_VERSION, "row_bytes": ROW, "page_tokens": PAGE_TOKENS,
        "page_bytes": ROW * PAGE_TOKENS, "pages": args.pages, "layers": args.layers,
        "pattern": "random pages, scattered on both sides", "contestants": {},
    }
    result.update(measure_peak(gate, 1 << 30))
    write_json(args.json, result)

    def run(label: str, make: Any) -> None:
        try:
            engine = make()
            row = measure(gate, engine, args.pages, pool_pages, rng, args.layers)
            row.update(measure_overlap(gate, engine, args.pages, rng))
            for d in ("d2h", "h2d"):
                row[f"{d}_ratio"] = row[f"{d}_gbps"] / result[f"peak_{d}_gbps"]
            if hasattr(engine, "close"):
                engine.close()
        except Exception as exc:  # noqa: BLE001 - one failing contestant must not hide the others
            row = {"error": repr(exc)}
        result["contestants"][label] = row
        print(f"[io-vs-sglang] {label}: {json.dumps(row)}", flush=True)
        write_json(args.json, result)

    from concurrent.futures import ThreadPoolExecutor

    specs = {
        "register": ("hicache_register", "hicache.cuh", f"HiCacheKernel<{ROW}, {_default_unroll(ROW)}, {REGISTER_QUOTA}, 1024>",
                     ["launch_one_mla=run_one_mla"]),
        "tma": ("hicache_tma", "hicache_tma.cuh", f"HiCacheTmaKernel<{', '.join(map(str, TMA_ARGS))}>",
                ["launch_one_mla=run_one_mla", "fits_device=fits_device"]),
    }
    modules: dict[str, Any] = {}
    with ThreadPoolExecutor(2) as pool:  # the two nvcc builds at once
        futures = {kind: pool.submit(build, args.sglang_src, args.build_dir, *spec) for kind, spec in specs.items()}
    for kind, fut in futures.items():
        try:
            modules[kind] = fut.result()
        except Exception as exc:  # noqa: BLE001
            result[f"build_error_{kind}"] = getattr(exc, "stderr", None) or repr(exc)
    if "tma" in modules:
        try:
            result["tma_fits_device"] = bool(modules["tma"].fits_device(torch.cuda.current_device()))
        except Exception as exc:  # noqa: BLE001
            result["tma_fits_device"] = repr(exc)
    write_json(args.json, result)
    for kind, module in modules.items():
        for page_first in (True, False):
            layout = "page_first" if page_first else "layer_first"
            run(f"sglang-{kind}-{layout}", lambda m=module, pf=page_first: _AsEngine(SglangCopier(m, args.layers, pool_pages, pf), pool_pages))
            torch.cuda.empty_cache()
    run("sglang-direct", lambda: _AsEngine(DirectCopier(args.layers, pool_pages), pool_pages))
    torch.cuda.empty_cache()
    from hicache_cp.pools import DevicePool, HostPool

    layout = KVLayout.build(page_size=PAGE_TOKENS, num_layers=args.layers, kv_bytes_per_token=ROW)
    dev = DevicePool(layout, pool_pages, device="cuda")
    host = HostPool(layout, pool_pages * layout.bytes_per_page, pin=True)
    host.wait_ready()
    for name in [x for x in args.ours.split(",") if x]:
        backend, options = VARIANTS[name]
        run(f"ours-{name}", lambda b=backend, o=options: make_engine(b, dev, host, **o))
    host.close()
    write_json(args.json, result)
    print(json.dumps({k: {kk: round(vv, 3) for kk, vv in v.items() if kk.endswith(("ratio", "_us", "fraction"))}
                      for k, v in result["contestants"].items() if "error" not in v}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
