"""Where the direct backend's exposure comes from (issue 28): one H200 run, one JSON.

bench-io's `direct` leaves 0.07 / 0.15 (load / backup) of a layer-by-layer
copy exposed beside a compute-bound forward, against 0.05 / 0.10 wanted and
a floor of one layer's copy (1/24). This probe separates the suspects, on
the same pages (1024 scattered 41,984 B pages a layer, 24 layers, both sides
permuted, or in runs of 128), with every descriptor issued on this thread
behind a GPU sleep (so the host's pace is out of the GPU figures):

* host: driver time per descriptor of cuMemcpyBatchAsync, from 1, 2 and 4
  threads on their own streams, by chunk size and attribute hints;
* GPU: the copy alone and beside the forward (exposed load / backup, as
  bench-io computes them) with a layer's descriptors split over 1, 2 or 4
  streams (the copy engines), with and without location hints, and with
  one more matmul per layer (is it the "compute equals copy" edge?);
* the forward alone with 24 cross-stream waits on finished events (the
  cost of waiting at all).

    python bench/experiments/dma_probe.py --json bench/results/dma-probe-h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache_harness.bench.io import _Gate, _median_ms
from hicache_harness.outputs import write_json
from hicache_harness.provenance import git_commit, machine
from hicache_cp.io.cudadrv import MEMCPY_ATTRIBUTES_BYTES, SRC_ACCESS_ORDER_STREAM, driver

PAGE_BYTES = 41984
LAYERS = 24
# CUmemLocationType
_LOC_DEVICE, _LOC_HOST = 1, 2


def attributes(hints: bool, d2h: bool, device: int = 0) -> np.ndarray:
    """One CUmemcpyAttributes: stream order; with `hints`, where source and destination live."""
    attrs = np.zeros(MEMCPY_ATTRIBUTES_BYTES, dtype=np.uint8)
    w = attrs.view(np.uint32)
    w[0] = SRC_ACCESS_ORDER_STREAM
    if hints:
        dev, host = (_LOC_DEVICE, device), (_LOC_HOST, 0)
        (w[1], w[2]), (w[3], w[4]) = (dev, host) if d2h else (host, dev)
    return attrs


class Buffers:
    """LAYERS x P pages on the device and in pinned host memory."""

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.dev = torch.empty(LAYERS * pages * PAGE_BYTES, dtype=torch.uint8, device="cuda")
        self.host = torch.empty(LAYERS * pages * PAGE_BYTES, dtype=torch.uint8, pin_memory=True)

    def layer_descs(self, d2h: bool, dev_pages: np.ndarray, host_pages: np.ndarray) -> list[tuple[np.ndarray, ...]]:
        """Per layer (dst, src, sizes) uint64 arrays, one descriptor per run consecutive on both sides."""
        order = np.argsort(dev_pages, kind="stable")
        d, h = dev_pages[order], host_pages[order]
        cut = np.flatnonzero((np.diff(d) != 1) | (np.diff(h) != 1)) + 1
        starts = np.concatenate(([0], cut))
        lengths = np.diff(np.concatenate((starts, [len(d)])))
        out = []
        for layer in range(LAYERS):
            base = layer * self.pages * PAGE_BYTES
            dv = (self.dev.data_ptr() + base + d[starts] * PAGE_BYTES).astype(np.uint64)
            hv = (self.host.data_ptr() + base + h[starts] * PAGE_BYTES).astype(np.uint64)
            sizes = (lengths * PAGE_BYTES).astype(np.uint64)
            dst, src = (hv, dv) if d2h else (dv, hv)
            out.append((np.ascontiguousarray(dst), np.ascontiguousarray(src), sizes))
        return out


def pages(rng: np.random.Generator, n: int, total: int, run: int) -> np.ndarray:
    if run == 1:
        return rng.permutation(np.arange(1, total))[:n].astype(np.int64)
    starts = 1 + run * rng.permutation((total - 1) // run)[: -(-n // run)]
    return (starts[:, None] + np.arange(run)).reshape(-1)[:n].astype(np.int64)


def issue(drv: Any, desc: tuple[np.ndarray, ...], stream: int, attrs: np.ndarray, idx: np.ndarray, chunk: int) -> None:
    dst, src, sizes = desc
    n = len(sizes)
    for lo in range(0, n, chunk):
        k = min(chunk, n - lo)
        if k == 1:
            drv.memcpy_async(int(dst[lo]), int(src[lo]), int(sizes[lo]), stream)
        else:
            off = lo * 8
            drv.memcpy_batch_ptrs(dst.ctypes.data + off, src.ctypes.data + off, sizes.ctypes.data + off, k,
                                  attrs.ctypes.data, idx.ctypes.data, stream)


def split(desc: tuple[np.ndarray, ...], k: int) -> list[tuple[np.ndarray, ...]]:
    return [tuple(np.ascontiguousarray(a) for a in parts) for parts in zip(*(np.array_split(a, k) for a in desc))]


def host_cost(drv: Any, descs: list[tuple[np.ndarray, ...]], threads: int, chunk: int, attrs: np.ndarray) -> dict[str, float]:
    """us of driver time per descriptor, `threads` threads each on its own stream issuing
    its share of every layer."""
    idx = np.zeros(1, dtype=np.uint64)
    streams = [torch.cuda.Stream() for _ in range(threads)]
    shares = [split(d, threads) for d in descs]
    ctx = drv.current_context()
    barrier = threading.Barrier(threads + 1)
    spent = [0.0] * threads

    def work(i: int) -> None:
        drv.set_context(ctx)
        handle = streams[i].cuda_stream
        barrier.wait()
        t0 = time.perf_counter()
        for layer in shares:
            issue(drv, layer[i], handle, attrs, idx, chunk)
        spent[i] = time.perf_counter() - t0

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    wall = time.perf_counter() - t0
    torch.cuda.synchronize()
    n = sum(len(d[2]) for d in descs)
    return {"wall_us_per_desc": wall * 1e6 / n, "thread_us_per_desc": max(spent) * 1e6 / (n / threads), "descriptors": n}


class Forward:
    """The bench-io forward: `per_layer` 4096^2 bf16 matmuls a layer."""

    def __init__(self, gate: _Gate, copy_ms: float) -> None:
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn_like(self.a)
        self.c = torch.empty_like(self.a)
        mm_ms, _ = _median_ms(gate, lambda: [torch.matmul(self.a, self.b, out=self.c) for _ in range(20)])
        self.mm_ms = mm_ms / 20
        self.per_layer = max(1, math.ceil(copy_ms / LAYERS / self.mm_ms))

    def layer(self, extra: int = 0) -> None:
        for _ in range(self.per_layer + extra):
            torch.matmul(self.a, self.b, out=self.c)


def overlap(
    gate: _Gate, fwd: Forward, drv: Any, loads: list[Any], backups: list[Any], k: int, hints: bool, extra: int = 0
) -> dict[str, float]:
    """Exposed load / backup with each layer's descriptors split over `k` copy streams."""
    idx = np.zeros(1, dtype=np.uint64)
    streams = [torch.cuda.Stream() for _ in range(k)]
    la, ba = attributes(hints, False), attributes(hints, True)
    lsh, bsh = [split(d, k) for d in loads], [split(d, k) for d in backups]
    chunk = 1 << 14

    def copies(shares: list[Any], attrs: np.ndarray, after_compute: bool) -> list[list[torch.cuda.Event]]:
        main = torch.cuda.current_stream()
        done: list[list[torch.cuda.Event]] = []
        for i, layer in enumerate(shares):
            if after_compute:
                fwd.layer(extra)
            evs = []
            for s, part in zip(streams, layer):
                s.wait_stream(main)
                issue(drv, part, s.cuda_stream, attrs, idx, chunk)
                e = torch.cuda.Event()
                e.record(s)
                evs.append(e)
            done.append(evs)
        return done

    def copy_only(shares: list[Any], attrs: np.ndarray) -> None:
        for evs in copies(shares, attrs, False):
            for e in evs:
                torch.cuda.current_stream().wait_event(e)

    def with_loads() -> None:
        done = copies(lsh, la, False)
        for evs in done:
            for e in evs:
                torch.cuda.current_stream().wait_event(e)
            fwd.layer(extra)

    def with_backups() -> None:
        for evs in copies(bsh, ba, True):
            for e in evs:
                torch.cuda.current_stream().wait_event(e)

    compute_ms, _ = _median_ms(gate, lambda: [fwd.layer(extra) for _ in range(LAYERS)])
    load_ms, _ = _median_ms(gate, lambda: copy_only(lsh, la))
    backup_ms, _ = _median_ms(gate, lambda: copy_only(bsh, ba))
    wl, _ = _median_ms(gate, with_loads)
    wb, _ = _median_ms(gate, with_backups)
    return {
        "streams": k, "hints": hints, "extra_matmuls": extra, "compute_ms": compute_ms, "load_copy_ms": load_ms,
        "backup_copy_ms": backup_ms, "with_loads_ms": wl, "with_backups_ms": wb,
        "exposed_load_fraction": max(0.0, (wl - compute_ms) / load_ms),
        "exposed_backup_fraction": max(0.0, (wb - compute_ms) / backup_ms),
    }


def copy_only_ms(gate: _Gate, drv: Any, descs: list[Any]) -> float:
    """GPU ms of every layer's copy on one stream (sizes the forward)."""
    idx, attrs, s = np.zeros(1, dtype=np.uint64), attributes(False, False), torch.cuda.Stream()

    def run() -> None:
        s.wait_stream(torch.cuda.current_stream())
        for d in descs:
            issue(drv, d, s.cuda_stream, attrs, idx, 1 << 14)
        torch.cuda.current_stream().wait_stream(s)

    return _median_ms(gate, run)[0]


def wait_cost(gate: _Gate, fwd: Forward) -> dict[str, float]:
    """The forward with a cross-stream wait on a finished event before every layer."""
    side = torch.cuda.Stream()
    ev = torch.cuda.Event()
    ev.record(side)
    torch.cuda.synchronize()

    def waited() -> None:
        for _ in range(LAYERS):
            torch.cuda.current_stream().wait_event(ev)
            fwd.layer()

    alone, _ = _median_ms(gate, lambda: [fwd.layer() for _ in range(LAYERS)])
    with_waits, _ = _median_ms(gate, waited)
    return {"compute_ms": alone, "with_waits_ms": with_waits, "us_per_wait": (with_waits - alone) * 1e3 / LAYERS}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=1024)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    drv = driver()
    rng = np.random.default_rng(0)
    total = 2 * args.pages + 1
    buf = Buffers(total)
    gate = _Gate()
    out: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "commit": git_commit(),
                           "machine": f"{torch.cuda.get_device_name()}; {machine()}", "pages": args.pages,
                           "page_bytes": PAGE_BYTES, "layers": LAYERS, "host_cost": [], "overlap": {}}
    shapes = {"scattered": 1, "runs": 128}
    descs = {}
    for shape, run in shapes.items():
        d, h = pages(rng, args.pages, total, run), pages(rng, args.pages, total, run)
        descs[shape] = (buf.layer_descs(False, d, h), buf.layer_descs(True, d, h))
    loads, backups = descs["scattered"]
    for threads in (1, 2, 4):
        for chunk in (64, 1024):
            for hints in (False, True):
                r = host_cost(drv, backups, threads, chunk, attributes(hints, True))
                r.update(threads=threads, chunk=chunk, hints=hints)
                out["host_cost"].append(r)
                print(f"host  threads {threads} chunk {chunk:>4} hints {hints!s:<5}: "
                      f"{r['wall_us_per_desc']:.3f} us/desc wall, {r['thread_us_per_desc']:.3f} per thread")
    fwd = Forward(gate, copy_only_ms(gate, drv, loads))
    out["matmul_ms"], out["matmuls_per_layer"] = fwd.mm_ms, fwd.per_layer
    out["wait_cost"] = wait_cost(gate, fwd)
    print(f"wait  {json.dumps(out['wait_cost'])}")
    for shape, (ld, bk) in descs.items():
        rows = []
        for k, hints, extra in ((1, False, 0), (1, True, 0), (2, False, 0), (4, False, 0), (2, True, 0), (1, False, 1), (2, False, 1)):
            r = overlap(gate, fwd, drv, ld, bk, k, hints, extra)
            rows.append(r)
            print(f"{shape:<9} streams {k} hints {hints!s:<5} +{extra} mm: load {r['exposed_load_fraction']:.3f} "
                  f"backup {r['exposed_backup_fraction']:.3f} (copy {r['load_copy_ms']:.2f}/{r['backup_copy_ms']:.2f} ms, "
                  f"compute {r['compute_ms']:.2f}, with {r['with_loads_ms']:.2f}/{r['with_backups_ms']:.2f})")
        out["overlap"][shape] = rows
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
