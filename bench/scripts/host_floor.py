"""The Python floor of the `direct` engine's host calls, measured on CPU (no GPU needed).

bench-overhead times the cache's calls on the H200: Python, driver calls and
waits for the driver together. This tool takes the driver out, to see what the
Python alone costs, and what a change to it saves, on a machine without a GPU:

* `table`: `Runs.of` and `DescriptorTable` (the plan of one op, `io.plans`) for
  DeepSeek-V3.2 ops of a few shapes: pure numpy, nothing faked;
* `cache`: the cache's calls (`load_back`, the layer hook) over the `direct`
  engine's own Python. The engine is built around a driver double that does
  nothing, and its issue workers issue on the caller's thread at once. So
  driver time, driver-lock waits and the worker's GIL share are absent by
  construction. These numbers are a lower bound for analysis, never a
  benchmark of the GPU path;
* `replay`: bench-overhead's own replay (`hicache_harness.bench.overhead.serve`, its
  options and pool sizing) over that engine, so that its table of every call
  compares line by line with an `overhead-<gpu>.json` of the same options.

    python bench/scripts/host_floor.py [--requests 300] [--hook-worker-above 0] [--json P]
    python bench/scripts/host_floor.py replay [bench-overhead's options] [--hook-worker-above 0] [--runs 3] [--json P]

Host speed matters: compare runs on one machine (bench-overhead's `match`
time gives the ratio between hosts).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from hicache_cp.cache import HiCache
from hicache_cp.config import Config
from hicache_harness.bench import overhead
from hicache_harness.errors import InputError
from hicache_harness.outputs import write_json
from hicache_harness.provenance import git_commit, machine
from hicache_harness.replay.setup import tokens_per_block
from hicache_harness.trace import request_tokens
from hicache_cp.io.base import CopyEngine, Direction
from hicache_cp.io.cuda import PartInfo
from hicache_cp.io.engine_sync import EngineSync
from hicache_cp.io.dma import HOOK_SPAN_INLINE, HOOK_WORKER_ABOVE, WORKER_ABOVE, DirectCopyEngine
from hicache_cp.io.issue import CHUNK, IssueWorker
from hicache_cp.io.plans import MAX_TABLE_DESCRIPTORS, DescriptorTable, PartGeometry, Runs, TableShape
from hicache_cp.layout import KVLayout, Model

_REPEATS = 300


class _NoDriver:
    """The driver calls the direct engine's Python makes, doing nothing."""

    def stream_wait_event(self, stream: int, event: int) -> None: ...
    def memcpy_batch_ptrs(self, *args: int) -> None: ...
    def memcpy_async(self, *args: int) -> None: ...
    def event_record(self, event: int, stream: int) -> None: ...
    def event_synchronize(self, event: int) -> None: ...
    def event_query(self, event: int) -> bool:
        return True

    def event_create(self) -> int:
        return 1


class _NoIssuer:
    batch = True

    def issue_table_row(self, *args: Any) -> None: ...
    def issue(self, *args: Any) -> None: ...


class _Arena:
    register_chunk_bytes = 1 << 30


def _layout() -> KVLayout:
    return Config(model="deepseek-v3.2", page_size=64, io_backend="cpu").layout()


def _geometries(layout: KVLayout, host_pages: int) -> list[PartGeometry]:
    return [
        PartGeometry(p.part, p.page_bytes, {layer: p.slot(layer) for layer in p.layer_ids},
                     tuple((1 << 40) + (i << 36) + s * (1 << 30) for s in range(p.num_slots)),
                     1 << 44, host_pages * p.page_bytes, _Arena.register_chunk_bytes)
        for i, p in enumerate(layout.parts)
    ]  # fmt: skip


def table_floor() -> list[dict[str, Any]]:
    """Median us of `Runs.of`, of the `DescriptorTable` build, and of every layer's
    descriptors all told (the build plus a `get` of each (parts, layer) row: what the
    issuer pays for one op), for ops of a few shapes. A scattered 8,192-page op is
    over `MAX_TABLE_DESCRIPTORS`, so it is also timed with a cap that tabulates it."""
    layout = _layout()
    layers = [(layer, tuple(p.part for p in layout.parts_of(m) if p.has_layer(layer)))
              for m in (Model.TARGET, Model.DRAFT) for layer in range(layout.num_layers(m))]  # fmt: skip
    layers = [(layer, parts) for layer, parts in layers if parts]
    shape = TableShape(_geometries(layout, 10000), layers)
    rng = np.random.default_rng(0)
    rows = []
    shapes = ((35, False, MAX_TABLE_DESCRIPTORS), (35, True, MAX_TABLE_DESCRIPTORS), (1024, True, MAX_TABLE_DESCRIPTORS),
              (8192, True, MAX_TABLE_DESCRIPTORS), (8192, True, 1 << 21))  # fmt: skip
    for pages, scattered, cap in shapes:
        if scattered:
            span = 4000 if pages <= 1024 else 9000  # the rows before 8,192 pages drew from 4,000: comparable
            dev, host = rng.choice(span, pages, replace=False), rng.choice(span, pages, replace=False)
        else:  # two runs, as the allocators hand out
            dev = np.concatenate([np.arange(100, 100 + pages // 2), np.arange(500, 500 + pages - pages // 2)])
            host = np.arange(7, 7 + pages)
        dev, host = dev.astype(np.int64), host.astype(np.int64)
        runs_us, table_us, all_us = [], [], []
        for _ in range(_REPEATS if pages <= 1024 else 10):
            t0 = time.perf_counter_ns()
            runs = Runs.of(dev, host)
            t1 = time.perf_counter_ns()
            table = DescriptorTable(True, shape, runs, cap)
            t2 = time.perf_counter_ns()
            for layer, parts in layers:
                table.get(parts, layer)
            t3 = time.perf_counter_ns()
            runs_us.append((t1 - t0) / 1e3)
            table_us.append((t2 - t1) / 1e3)
            all_us.append((t3 - t1) / 1e3)
        rows.append({"pages": pages, "runs": len(runs), "max_descriptors": cap, "tabulated": table.tabulated,
                     "runs_of_us": float(np.median(runs_us)), "table_us": float(np.median(table_us)),
                     "all_layers_us": float(np.median(all_us))})  # fmt: skip
    return rows


def _python_only_engine(cache: HiCache, options: dict[str, Any]) -> DirectCopyEngine:
    """A `DirectCopyEngine` over the cache's CPU pools whose driver does nothing and whose
    workers issue on the caller's thread at once (built field by field: the real
    constructor needs CUDA)."""
    e = DirectCopyEngine.__new__(DirectCopyEngine)
    CopyEngine.__init__(e, cache.device_pool, cache.host_pool)
    drv = _NoDriver()
    sync = EngineSync(drv, 0, 0)  # type: ignore[arg-type]
    sync._free, sync.guard, sync._raw_stream = collections.deque(range(1 << 20)), False, None
    sync.current_stream = lambda: 7  # type: ignore[method-assign]
    e._drv, e._sync, e._handle, e._order, e._keep = drv, sync, (1, 2), (3, 4), collections.deque()
    e._issuer = _NoIssuer()
    e._device_limit, e._host_limit = cache.device_pool.physical_pages, cache.host_pool.physical_pages
    e._table_shape = None
    geoms = _geometries(cache.layout, cache.host_pool.physical_pages)
    e._info = {g.part: PartInfo(g.part, g.page_bytes, g.slots, list(g.device_layers), g.host_base,
                                g.host_layer_bytes, _Arena(), True) for g in geoms}  # type: ignore[arg-type]
    e.worker_above = WORKER_ABOVE
    e.hook_worker_above = options.get("hook_worker_above", HOOK_WORKER_ABOVE)
    e.hook_span_inline = options.get("hook_span_inline", HOOK_SPAN_INLINE)
    e.chunks = e.wholes = {Direction.D2H: CHUNK, Direction.H2D: CHUNK}
    e.counts = {"deferred": 0}
    workers = []
    for _ in Direction:
        worker, cond = IssueWorker(drv, 0, 0), threading.Condition()

        def put(*jobs: Any, cond: threading.Condition = cond) -> None:
            for job in jobs:
                job.bind(cond)
                job.finish(job.count)

        worker.put = put  # type: ignore[method-assign]
        workers.append(worker)
    e._workers = tuple(workers)
    return e


def cache_floor(requests: int, options: dict[str, Any]) -> dict[str, Any]:
    """`load_back` and layer-hook us over the Python-only engine: requests drawn from 60
    prompts of 20-60 pages, L1 emptied after each so that repeats load from L2."""
    config = Config(model="deepseek-v3.2", page_size=64, l1_pages=3000, host_budget_bytes=3 << 30, io_backend="cpu")
    load_us: list[float] = []
    hook_us: list[float] = []
    load_pages: list[int] = []
    with HiCache(config, device="cpu") as cache:
        cpu_engine = cache.engine
        engine = _python_only_engine(cache, options)
        cache._state.engine = engine  # noqa: SLF001 - the point of the tool
        try:
            rng = np.random.default_rng(0)
            prompts = [rng.integers(0, 1 << 30, 64 * int(rng.integers(20, 60))) for _ in range(60)]
            for _ in range(requests):
                m = cache.match_prefix(prompts[int(rng.integers(0, len(prompts)))])
                t0 = time.perf_counter_ns()
                load = cache.load_back(m)
                if load is not None:
                    load_us.append((time.perf_counter_ns() - t0) / 1e3)
                    load_pages.append(load.num_pages)
                new = cache.alloc_device(m.num_pages - m.matched_pages, m.matched_pages)
                if new is None:
                    cache.settle()
                    cache.release(m.last_node)
                    continue
                backup = cache.reserve_backup(new, m.matched_pages)
                for model in (Model.TARGET, Model.DRAFT):
                    for layer in range(cache.layout.num_layers(model)):
                        t0 = time.perf_counter_ns()
                        cache.on_layer_end(model, layer, [backup])
                        hook_us.append((time.perf_counter_ns() - t0) / 1e3)
                node = cache.insert(m, new, backup)
                cache.poll()
                cache.settle()
                cache.release(node)
                cache.ensure_free()
                cache._evictor.make_room("l1", config.l1_pages - 100, 0)  # noqa: SLF001 - repeats load from L2
        finally:
            cache._state.engine = cpu_engine  # noqa: SLF001 - closed by the cache
    return {
        "options": options, "requests": requests, "loads": len(load_us),
        "load_pages_mean": float(np.mean(load_pages)) if load_pages else 0.0,
        "load_back_us_p50": float(np.percentile(load_us, 50)) if load_us else None,
        "load_back_us_p99": float(np.percentile(load_us, 99)) if load_us else None,
        "layer_hook_us_p50": float(np.percentile(hook_us, 50)), "layer_hook_us_p99": float(np.percentile(hook_us, 99)),
        "deferred": engine.counts["deferred"],
    }  # fmt: skip


def replay_floor(argv: list[str], options: dict[str, Any]) -> dict[str, Any]:
    """bench-overhead's result for `argv` (its options; L1 on CPU) over the Python-only engine."""
    parser = argparse.ArgumentParser(prog="host_floor.py replay")
    overhead.add_arguments(parser)
    args = parser.parse_args([*argv, "--device", "cpu"])
    if args.io_backend or args.io_variant:
        parser.error("the engine is the direct engine's Python; give --hook-worker-above instead")
    try:
        resolved, requests, _ = overhead.prepare(args)
    except InputError as exc:
        parser.error(str(exc))
    config = dataclasses.replace(resolved.config, io_backend="cpu")
    all_tokens = [request_tokens(r, tokens_per_block(args, config)) for r in requests]
    timings = overhead.Timings()
    with HiCache(config, device="cpu") as cache:
        cpu_engine = cache.engine
        engine = _python_only_engine(cache, options)
        cache._state.engine = engine  # noqa: SLF001 - the point of the tool
        try:
            for tokens in all_tokens:
                overhead.serve(cache, tokens, timings)
            cache.drain()
            stats = cache.stats()
        finally:
            cache._state.engine = cpu_engine  # noqa: SLF001 - closed by the cache
    calls = {name: timings.summary(name) for name in (*overhead.REQUEST_CALLS, "own_per_request", "layer_hook")}
    return {"argv": argv, "options": options, "requests": len(requests), "hit_rate": stats.get("hit_rate"),
            "loads": stats.get("loads_started"), "deferred": engine.counts["deferred"], "calls": calls}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["replay"]:
        return _main_replay(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--hook-worker-above", type=int, default=HOOK_WORKER_ABOVE,
                   help="the direct engine's option (0, the default: every hook layer deferred)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    table = table_floor()
    print("plan of one op (median us):")
    for row in table:
        print(f"  {row['pages']:5d} pages, {row['runs']:5d} runs, cap {row['max_descriptors']:8d}: Runs.of "
              f"{row['runs_of_us']:7.1f}  table {row['table_us']:8.1f} ({'built' if row['tabulated'] else 'per layer'})"
              f"  every layer {row['all_layers_us']:9.1f}")  # fmt: skip
    floor = cache_floor(args.requests, {"hook_worker_above": args.hook_worker_above})
    print(f"cache over the direct engine's Python (no driver), hook_worker_above={args.hook_worker_above}: "
          f"{floor['loads']} loads of {floor['load_pages_mean']:.0f} pages, load_back p50 {floor['load_back_us_p50']:.0f} "
          f"p99 {floor['load_back_us_p99']:.0f} us; layer hook p50 {floor['layer_hook_us_p50']:.1f} "
          f"p99 {floor['layer_hook_us_p99']:.1f} us")  # fmt: skip
    if args.json is not None:
        write_json(args.json, {"command": " ".join(["python", *sys.argv]), "commit": git_commit(), "machine": machine(),
                               "table": table, "cache": floor})  # fmt: skip
    return 0


def _main_replay(argv: list[str]) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--hook-worker-above", type=int, default=HOOK_WORKER_ABOVE)
    own.add_argument("--runs", type=int, default=1, help="replays; the table gives each figure's median over them")
    own.add_argument("--json", type=Path)
    args, rest = own.parse_known_args(argv)
    if args.runs < 1:
        own.error(f"--runs must be >= 1, got {args.runs}")
    runs = [replay_floor(rest, {"hook_worker_above": args.hook_worker_above}) for _ in range(args.runs)]
    floor = runs[0]
    median = {name: {stat: float(np.median([r["calls"][name][stat] for r in runs])) for stat in ("cpu_mean", "cpu_p50", "cpu_p99")}
              for name in floor["calls"]}  # fmt: skip
    print(f"bench-overhead's replay over the direct engine's Python (no driver), hook_worker_above="
          f"{args.hook_worker_above}: {floor['requests']} requests, {floor['loads']} loads, hit rate {floor['hit_rate']:.4f}, "
          f"median of {args.runs} run(s)")
    print(f"{'call':<18}{'count':>9}{'mean':>10}{'p50':>10}{'p99':>10}   (thread CPU time, us)")
    for name, c in median.items():
        print(f"{name:<18}{floor['calls'][name]['count']:>9}{c['cpu_mean']:>10.1f}{c['cpu_p50']:>10.1f}{c['cpu_p99']:>10.1f}")
    if args.json is not None:
        write_json(args.json, {"command": " ".join(["python", *sys.argv]), "commit": git_commit(), "machine": machine(),
                               "median": median, "runs": runs})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
