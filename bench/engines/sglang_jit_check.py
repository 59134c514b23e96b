#!/usr/bin/env python3
"""SGLang 0.5.23's HiCache JIT kernels, built on the device by SGLang itself, and a byte-exact round trip.

    python3 bench/engines/sglang_jit_check.py --json $OUT/sglang-jit-h100.json     # on the device (bench/device/sglang.sh jit)

For each case, SGLang's own HiCache is built as `--enable-hierarchical-cache`
builds it (`create_unified_radix_cache`: `UnifiedRadixCache`,
`HybridCacheController`, the host pool, through
`hicache_harness.bench.sglang_race_server.RaceServer`). Building the host pool runs
SGLang's `can_use_hicache_jit_kernel` / `can_use_write_back_jit_kernel`,
which compile `kvcacheio/hicache.cuh` (or `hicache_tma.cuh`) and
`staged_write_back.cuh` with SGLang's `load_jit` (nvcc, apache-tvm-ffi) and
fall back to sgl-kernel's ops when a build fails (the stand-in then raises
naming the op). Then, through SGLang's controller as its tree cache calls it:

    random bytes in `pages` device pages (every layer; K and V for MHA; the DSA indexer's keys)
    write(device slots) + start_writing      D2H on SGLang's write stream (its kernels)
    load(host slots) + start_loading         H2D into newly allocated device slots
    every byte of the new slots == the original; the bytes of every other slot unchanged

Cases: MLA (DeepSeek's latent) and MHA (a Llama's K and V) with io backend
`kernel` on layouts `page_first` and `layer_first`. (DSA is not a case: its
indexer pool loads through sgl-kernel's transfer ops, which are not here; the
race's DSA row shows that through SGLang's own tree cache.) Each case is independent:
one that fails is recorded with its error and where, and the others run. The
JSON names each host pool's class, layout and whether SGLang took its JIT
paths (`can_use_jit`, `can_use_write_back_jit`), the build time (the first
case pays the compilation; SGLANG_JIT_CACHE_DIR keeps it for later steps) and
each direction's time.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hicache_harness.bench.sglang_race import failure_record  # noqa: E402
from hicache_harness.bench.sglang_race_server import RaceServer, RaceSpec  # noqa: E402
from hicache_harness.outputs import write_json  # noqa: E402
from hicache_harness.provenance import git_commit, machine  # noqa: E402
from hicache_harness.sglang.env import import_sglang  # noqa: E402

CASES = (("mla", "page_first"), ("mla", "layer_first"), ("mha", "page_first"), ("mha", "layer_first"))


def _buffers(pool: Any) -> list[torch.Tensor]:
    """Every device tensor of the pool a HiCache transfer moves, as uint8 rows per slot or page."""
    if hasattr(pool, "k_buffer") and not hasattr(pool, "kv_buffer"):
        bufs = [*pool.k_buffer, *pool.v_buffer]
    else:
        bufs = list(pool.kv_buffer)
    index = getattr(pool, "index_k_with_scale_buffer", None)
    bufs += list(index) if index is not None else []
    return [b.view(torch.uint8).view(b.shape[0], -1) for b in bufs]


def _rows(buf: torch.Tensor, slots: torch.Tensor, page_size: int, slot_rows: int) -> torch.Tensor:
    """The rows of `buf` holding `slots`: token rows, or page rows for the indexer's [pages, ...] buffer."""
    return buf[slots] if buf.shape[0] == slot_rows else buf[torch.unique(slots // page_size)]


def round_trip(pools: str, layout: str, pages: int, workdir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"pools": pools, "layout": layout, "io_backend": "kernel", "pages": pages}
    t0 = time.perf_counter()
    spec = RaceSpec(backend="sglang-hicache", pools=pools, device="cuda", device_pages=4 * pages + 8, layers=4,
                    sglang_layout=layout, tree_core="python", dim=64, check_bytes=False)  # fmt: skip
    server = RaceServer(spec, workdir)
    out["build_s"] = time.perf_counter() - t0
    try:
        ctrl = server.tree_cache.cache_controller
        host = ctrl.mem_pool_host
        anchor = getattr(host, "anchor_entry", None)
        pools_host = [e.host_pool for e in getattr(host, "entries", [])] or [host]
        out["host_pools"] = [{"class": type(p).__name__, "layout": p.layout, "can_use_jit": getattr(p, "can_use_jit", None),
                              "can_use_write_back_jit": getattr(p, "can_use_write_back_jit", None)}
                             for p in pools_host]  # fmt: skip
        out["anchor"] = type(anchor.host_pool).__name__ if anchor is not None else type(host).__name__
        ps, pool = spec.page_size, server.target
        slot_rows = pool.size + ps
        bufs = _buffers(pool)
        src = server.allocator.alloc(pages * ps)
        gen = torch.Generator(device="cuda").manual_seed(0)
        for b in bufs:
            b.copy_(torch.randint(0, 256, b.shape, device="cuda", dtype=torch.uint8, generator=gen))
        before = [b.clone() for b in bufs]
        torch.cuda.synchronize()
        t = time.perf_counter()
        host_slots = ctrl.write(src)
        if host_slots is None:
            raise RuntimeError("SGLang's host pool refused the backup (no room)")
        torch.cuda.synchronize()
        out["d2h_ms"] = (time.perf_counter() - t) * 1e3
        out["d2h_unchanged_device"] = all(torch.equal(b, c) for b, c in zip(bufs, before, strict=True))
        t = time.perf_counter()
        dst = ctrl.load(host_slots)
        if dst is None:
            raise RuntimeError("SGLang's allocator refused the load (no room)")
        ctrl.start_loading()
        torch.cuda.synchronize()
        out["h2d_ms"] = (time.perf_counter() - t) * 1e3
        mismatched = sum(int((_rows(b, dst, ps, slot_rows) != _rows(c, src, ps, slot_rows)).sum())
                         for b, c in zip(bufs, before, strict=True))  # fmt: skip
        touched = torch.zeros(slot_rows, dtype=torch.bool, device="cuda")
        touched[dst] = True
        outside = sum(int((b[~touched] != c[~touched]).sum()) for b, c in zip(bufs, before, strict=True)
                      if b.shape[0] == slot_rows)  # fmt: skip
        out.update(round_trip_bytes=sum(_rows(c, src, ps, slot_rows).numel() for c in before),
                   mismatched_bytes=mismatched, changed_outside_bytes=outside, ok=mismatched == 0 and outside == 0)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the outcome is the record
        out.update(ok=False, **failure_record(exc, "round trip"))
    finally:
        server.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--cases", nargs="+", default=[f"{p}:{lay}" for p, lay in CASES], help="pools:layout")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    import_sglang()
    command = " ".join(["bench/engines/sglang_jit_check.py", *sys.argv[1:]])
    result: dict[str, Any] = {"commit": git_commit(), "machine": machine(), "command": command,
                              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                              "cases": []}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="sglang-jit-") as tmp:
        for case in args.cases:
            pools, layout = case.split(":")
            try:
                row = round_trip(pools, layout, args.pages, Path(tmp) / case.replace(":", "-"))
            except Exception as exc:  # noqa: BLE001 - construction failed: recorded, the next case runs
                row = {"pools": pools, "layout": layout, "ok": False, **failure_record(exc, "construct")}
            result["cases"].append(row)
            print(json.dumps(row), flush=True)
            write_json(args.json, result)
    return 0 if result["cases"] and all(c["ok"] for c in result["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
