"""`hicache-cp bench-l3`: the L3 tier's put/get throughput against raw Mooncake Store calls.

One process on loopback: a `mooncake_master` on 127.0.0.1, a storage holder
in a child process (so bytes cross a real TCP connection rather than a
memcpy into this process's own segment), and an L2 `HostPool` of `--pages`
pages with deterministic content. Each repeat, on the same pages:

* ours: `L3Client.submit_put` then `submit_get` (into a second set of pages)
  of one object per `--pages-per-object` pages, i.e. the write-back and
  prefetch path: key planning, chunk lists from the layer-first arena,
  the existence check that skips stored keys, the worker threads;
* raw: `batch_put_from_multi_buffers` and `batch_get_into_multi_buffers`
  straight on the same client with the same chunk lists, precomputed, in
  the same calls (at most `MAX_CHUNKS_PER_CALL` transfers each: Mooncake's
  TCP transport rejects much larger batches to one peer).

Every repeat uses fresh keys (a put of a stored key is skipped). The bytes
read back are compared with what was written. Reports the median of each
over the repeats; ratio = ours / raw (GB/s). `--json PATH` writes the
numbers with the commit, the machine and the command.

    python -m hicache_harness.bench.l3 --json bench/results/l3-loopback-cpu.json
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from hicache_cp.presets import PRESETS
from hicache_harness import checks, integrity
from hicache_harness.errors import InputError, IntegrityFailure, require
from hicache_cp.errors import HiCacheError
from hicache_harness.l3_master import MooncakeMaster, holder_process
from hicache_cp.l3.store import reachable
from hicache_harness.outputs import write_json
from hicache_harness.provenance import command_line, git_commit, machine
from hicache_cp.l3.client import L3Client, Region, call_spans
from hicache_cp.l3.config import L3Config
from hicache_cp.l3.keys import KeyScheme, PositionHashes, chunk_list
from hicache_cp.l3.metrics import L3Metrics
from hicache_cp.l3.store import L3Error, MooncakeStore

WARMUP = 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=sorted(PRESETS), default="deepseek-v3.2")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--pages", type=int, default=32, help="pages put and got per repeat")
    p.add_argument("--pages-per-object", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="write the result as JSON here")
    p.add_argument("--l3-master", metavar="IP:PORT", default=None,
                   help="a running Mooncake master to measure against (default: start one on 127.0.0.1)")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from hicache_cp.pools import HostPool

    checks.in_range("--page-size", args.page_size, 1, 1 << 16)
    layout = PRESETS[args.model].layout(args.page_size)
    n, g = args.pages, args.pages_per_object
    if n < 1 or g < 1 or n % g:
        raise InputError("--pages must be a positive multiple of --pages-per-object")
    checks.in_range("--repeats", args.repeats, 1, 1000)
    checks.output_file("--json", args.json)
    require("mooncake.store", "pd", "bench-l3")
    pool = HostPool(layout, layout.bytes_per_page * (2 * n + 1), pin=False)
    src = np.arange(1, n + 1, dtype=np.int64)  # physical pages written, then read back into dst
    dst = np.arange(n + 1, 2 * n + 1, dtype=np.int64)
    hashes = np.random.default_rng(0).integers(0, 2**63, n, dtype=np.int64).astype(np.uint64)
    for p in layout.parts:
        for slot, layer in enumerate(p.layer_ids):
            pool.layer_view(p.part, slot)[src] = integrity.content(hashes, p.part, layer, p.page_bytes)
    segment = 4 * n * layout.bytes_per_page * (args.repeats + WARMUP) + (64 << 20)
    if args.l3_master is not None:
        try:
            L3Config(master=args.l3_master)  # the HOST:PORT form
            reachable(args.l3_master, L3Config().connect_timeout_s, "bench-l3")
        except HiCacheError as exc:
            raise InputError(f"--l3-master: {exc}") from None
    master_cm = contextlib.nullcontext(args.l3_master) if args.l3_master else _started_master()
    with master_cm as address, holder_process(address, segment):
        cfg = L3Config(backend="mooncake", master=address, pages_per_object=g, local_buffer_bytes=0,
                       lookup_timeout_s=60.0, prefetch_timeout_s=60.0)  # fmt: skip
        store = MooncakeStore.open(cfg, name="bench-l3")
        regions = [Region(p.part, pool.arenas[p.part].ptr, pool.arenas[p.part].nbytes) for p in layout.parts]
        try:
            result = _measure(args, layout, pool, store, cfg, regions, src, dst, hashes)
        finally:
            store.close()
            pool.close()
    _report(args, result)
    return 0


@contextlib.contextmanager
def _started_master() -> Iterator[str]:
    with MooncakeMaster() as master:
        yield master.address


def _measure(args, layout, pool, store, cfg, regions, src, dst, hashes) -> dict:  # type: ignore[no-untyped-def]
    n, g = args.pages, args.pages_per_object
    raw = store.client
    runs: dict[str, list[float]] = {"put_ours": [], "put_raw": [], "get_ours": [], "get_raw": []}
    nbytes = n * layout.bytes_per_page
    chunks = 0
    for rep in range(args.repeats + WARMUP):
        for path in (("ours", "raw") if rep % 2 == 0 else ("raw", "ours")):  # alternate: no order bias
            scheme = KeyScheme(layout, args.model, L3Config(namespace=f"bench{rep}{path}", pages_per_object=g), 1, 0)
            tokens = np.repeat(np.arange(n, dtype=np.int64) + rep * 1_000_003, layout.page_size)
            objects = scheme.objects(PositionHashes.of(tokens, layout.page_size), range(n // g))
            put_phys = [src[o.positions] for o in objects]
            get_phys = [dst[o.positions] for o in objects]
            _clear(pool, layout, dst)
            if path == "ours":
                client = L3Client(store, scheme, cfg, regions, pool.physical_pages, L3Metrics(), close_store=False)
                try:
                    t0 = time.perf_counter()
                    out = client.submit_put(objects, put_phys).result()
                    t1 = time.perf_counter()
                    got = client.submit_get(objects, get_phys).result()
                    t2 = time.perf_counter()
                finally:
                    client.close()
                if out.keys_put != len(objects) or got != nbytes:
                    raise IntegrityFailure(f"our path stored {out.keys_put}/{len(objects)} objects, read {got}/{nbytes} B")
            else:
                for r in regions:
                    store.register(r.ptr, r.nbytes)
                try:
                    plan_put = [chunk_list(o.parts, ph, {r.part: r.ptr for r in regions}, pool.physical_pages)
                                for o, ph in zip(objects, put_phys)]  # fmt: skip
                    plan_get = [chunk_list(o.parts, ph, {r.part: r.ptr for r in regions}, pool.physical_pages)
                                for o, ph in zip(objects, get_phys)]  # fmt: skip
                    keys = [o.key for o in objects]
                    spans = call_spans([p for p, _ in plan_put])  # the same calls our path makes
                    codes, read = [], []
                    t0 = time.perf_counter()
                    for lo, hi in spans:
                        codes += raw.batch_put_from_multi_buffers(keys[lo:hi], [p for p, _ in plan_put[lo:hi]],
                                                                  [s for _, s in plan_put[lo:hi]])  # fmt: skip
                    t1 = time.perf_counter()
                    for lo, hi in spans:
                        read += raw.batch_get_into_multi_buffers(keys[lo:hi], [p for p, _ in plan_get[lo:hi]],
                                                                 [s for _, s in plan_get[lo:hi]])  # fmt: skip
                    t2 = time.perf_counter()
                finally:
                    for r in regions:
                        store.unregister(r.ptr)
                if any(c != 0 for c in codes) or sum(read) != nbytes:
                    raise L3Error("bench", "raw put/get failed", details={"put": codes[:4], "read": read[:4]})
                chunks = sum(len(p) for p, _ in plan_put)
            _check(pool, layout, dst, hashes)
            if rep >= WARMUP:
                runs[f"put_{path}"].append(nbytes / (t1 - t0) / 1e9)
                runs[f"get_{path}"].append(nbytes / (t2 - t1) / 1e9)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "put_gbps_ours": round(med["put_ours"], 4), "put_gbps_raw": round(med["put_raw"], 4),
        "put_ratio": round(med["put_ours"] / med["put_raw"], 4),
        "get_gbps_ours": round(med["get_ours"], 4), "get_gbps_raw": round(med["get_raw"], 4),
        "get_ratio": round(med["get_ours"] / med["get_raw"], 4),
        "runs": {k: [round(x, 4) for x in v] for k, v in runs.items()},
        "bytes": nbytes, "pages": n, "pages_per_object": g, "objects": n // g, "chunks": chunks,
        "mean_chunk_bytes": nbytes // max(1, chunks), "repeats": args.repeats, "layout": layout.describe(),
        "transport": "tcp loopback, storage holder in a child process",
        "commit": git_commit(), "machine": machine(), "command": command_line("bench-l3"),
    }  # fmt: skip


def _clear(pool, layout, pages) -> None:  # type: ignore[no-untyped-def]
    for p in layout.parts:
        for slot in range(p.num_slots):
            pool.layer_view(p.part, slot)[pages] = 0


def _check(pool, layout, dst, hashes) -> None:  # type: ignore[no-untyped-def]
    for p in layout.parts:
        for slot, layer in enumerate(p.layer_ids):
            if not np.array_equal(pool.layer_view(p.part, slot)[dst], integrity.content(hashes, p.part, layer, p.page_bytes)):
                raise IntegrityFailure(f"bytes read back differ ({p.part.value} layer {layer})")


def _report(args: argparse.Namespace, r: dict) -> None:
    print(f"{'path':<6}{'put GB/s':>10}{'get GB/s':>10}   runs after {WARMUP} warm-up (put | get)")
    for path in ("raw", "ours"):
        runs = r["runs"]
        print(f"{path:<6}{r[f'put_gbps_{path}']:>10.3f}{r[f'get_gbps_{path}']:>10.3f}   "
              f"{' '.join(f'{x:.3f}' for x in runs[f'put_{path}'])} | {' '.join(f'{x:.3f}' for x in runs[f'get_{path}'])}")  # fmt: skip
    print(f"ratio ours/raw: put {r['put_ratio']:.3f}, get {r['get_ratio']:.3f}; {r['bytes'] / 2**20:.1f} MiB in "
          f"{r['objects']} objects, {r['chunks']} chunks ({r['mean_chunk_bytes']} B each); bytes verified")  # fmt: skip
    if args.json is not None:
        write_json(args.json, r)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache-cp bench-l3", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
