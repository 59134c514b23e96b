"""Allocator microbenchmark: ``hicache-cp bench-alloc`` (or ``python -m hicache_harness.bench.alloc``).

Measures what docs/invariants.md rule 6 asks to keep visible, the metadata cost of
the host page allocator on a pool of realistic size, against its peers, and
what each allocator's pages are worth to the copies (runs per reserve).
Nothing but the allocators' own metadata is allocated.

Method:

1. Page units: the pool (``--pool-gib``, default 220) is cut into pages of
   each ``--page-bytes`` (default: the ``--model`` layout at
   ``--page-tokens``: the DeepSeek-V3.2 logical page over all layers and
   parts, 3,126,784 B, about 75 thousand pages; and its per-layer target KV
   page, 41,984 B, about 5.6 million pages). Each unit is a separate run.
2. One operation sequence per unit (``alloc_workload``): reserve sizes from
   a trace's request sizes (``--trace``; an embedded copy of the shared
   trace's size distribution otherwise), LRU eviction with random hits and
   node splits, so frees come in non-FIFO order, as pieces, and the pool
   fragments. The pool fills, then at least ``--warmup-ops`` more run and
   until eviction has freed ``--turnover`` pools' worth of pages (so a pool
   of millions of pages reaches its steady state too), then ``--ops`` are
   timed. Token-slot allocators (64 int64 slots a page) are left out of units
   above ``--max-slots`` slots, and say so.
3. Every allocator (``alloc_peers``) replays the whole sequence: the same
   operations and the same count. They take turns in blocks of
   ``--block-ops`` operations so that a change of machine load touches all of
   them alike. Each reserve and free call is timed alone
   (``perf_counter_ns``; Python's cyclic GC off during the replay; torch on
   ``--torch-threads`` threads). After each block, untimed, every result is
   checked against a model of used pages (the right page count, no page
   handed out twice, every freed page held) and each reservation's runs are
   counted: maximal sequences of consecutive pages in position order, what
   one copy descriptor each covers.

Reported per allocator: p50 / p99 / max / mean of reserve and free, runs
per reserve (mean, p50, p99), a run-length histogram, and the runs of a
sample of reservations (the same reservations for every allocator) for
``bench-io`` to time copies on. Speedups are a baseline's (median reserve +
median free) over ours: ``speedup_vs_*`` for ``ours`` (the bare allocator,
runs in and out), ``lane_speedup_vs_*`` for ``ours_lane`` (page arrays in and
out, as the cache calls it).

The record (``--json``): the top-level ``allocators``, ``speedup_vs_*`` and
``lane_speedup_vs_*`` are the first page unit's, ``units`` holds every
unit's. ``sglang`` says whether ``slot_list_lazy`` ran SGLang's own code
(``impl: sglang``) or the labelled re-implementation, and why. Per
allocator, ``run_length_histogram`` maps power-of-two run lengths to
``[runs, pages]``, and ``sample_runs`` lists, for each sampled reservation,
its runs as ``[first page, pages]`` rows in position order: the page list a
copy of that reservation moves, one descriptor per row.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache_cp.presets import PRESETS
from hicache_harness.bench.alloc_peers import load_sglang_host_kv_cache, make_peers
from hicache_harness.bench.alloc_workload import FREE, RESERVE, SizeSource, Workload, make_workload
from hicache_harness import checks
from hicache_harness.errors import InputError
from hicache_harness.outputs import write_json
from hicache_harness.provenance import command_line, git_commit, machine
from hicache_cp.layout import Part

logger = logging.getLogger(__name__)

__all__ = ["BenchConfig", "BenchInputError", "add_arguments", "main", "run", "run_config"]

BASELINES = ("slot_list_lazy", "page_free_list", "slot_list_eager")


class BenchInputError(InputError, ValueError):
    """A bench-alloc argument is out of range; reported as one line, exit code 2."""


#: An upper estimate of the allocators' metadata per pool page, all of them together
#: (page-id tables, free lists, extent indexes): the pool itself is never allocated.
METADATA_BYTES_PER_PAGE = 64


@dataclass(frozen=True)
class BenchConfig:
    """Validated bench-alloc parameters (see :func:`add_arguments`)."""

    pool_gib: float
    page_bytes: tuple[int, ...]
    ops: int
    seed: int = 0
    page_tokens: int = 64
    warmup_ops: int = 5_000
    turnover: float = 1.0
    block_ops: int = 1_000
    free_room: float = 0.02
    hits: float = 1.0
    split: float = 0.3
    cp_size: int = 1
    torch_threads: int = 1
    max_slots: int = 1 << 26
    sample_reserves: int = 16
    trace: Path | None = None
    json_path: Path | None = None
    command: str = ""

    def __post_init__(self) -> None:
        if not (self.pool_gib > 0 and math.isfinite(self.pool_gib)):
            raise BenchInputError(f"--pool-gib must be a finite number > 0, got {self.pool_gib}")
        if self.seed < 0:  # numpy's generators take non-negative seeds only
            raise BenchInputError(f"--seed must be >= 0, got {self.seed}")
        if not self.page_bytes:
            raise BenchInputError("--page-bytes lists no page size")
        for flag, value in (
            ("--ops", self.ops),
            ("--page-tokens", self.page_tokens),
            ("--block-ops", self.block_ops),
            ("--cp-size", self.cp_size),
            ("--torch-threads", self.torch_threads),
            ("--max-slots", self.max_slots),
            *(("--page-bytes", b) for b in self.page_bytes),
        ):
            if value <= 0:
                raise BenchInputError(f"{flag} must be positive, got {value}")
        for flag, value in (("--warmup-ops", self.warmup_ops), ("--sample-reserves", self.sample_reserves)):
            if value < 0:
                raise BenchInputError(f"{flag} must be >= 0, got {value}")
        if not 0 <= self.free_room < 1:
            raise BenchInputError(f"--free-room must be in [0, 1), got {self.free_room}")
        if not (self.hits >= 0 and math.isfinite(self.hits)):
            raise BenchInputError(f"--hits must be a finite number >= 0, got {self.hits}")
        if not (self.turnover >= 0 and math.isfinite(self.turnover)):
            raise BenchInputError(f"--turnover must be a finite number >= 0, got {self.turnover}")
        if not 0 <= self.split <= 1:
            raise BenchInputError(f"--split must be in [0, 1], got {self.split}")
        for b in self.page_bytes:
            pages = self.pages(b)
            if pages < 2 or pages - math.ceil(self.free_room * pages) < 1:
                raise BenchInputError(
                    f"--pool-gib {self.pool_gib} holds {pages} pages of {b} B (per lane of --cp-size "
                    f"{self.cp_size}); need at least 2 and room beyond --free-room {self.free_room}"
                )
        if self.trace is not None and not self.trace.is_file():
            raise BenchInputError(f"--trace {self.trace}: no such file")
        pages = max(self.pages(b) for b in self.page_bytes)
        try:
            checks.fits_host_memory(f"--pool-gib {self.pool_gib:g} ({pages:,} pages of metadata)",
                                    pages * METADATA_BYTES_PER_PAGE)
        except InputError as exc:
            raise BenchInputError(str(exc)) from None

    def pages(self, page_bytes: int) -> int:
        """Pool pages for one page unit, a multiple of ``cp_size``."""
        return int(self.pool_gib * 2**30) // page_bytes // self.cp_size * self.cp_size


def default_page_bytes(model: str, page_tokens: int) -> tuple[int, ...]:
    """The model's logical page (all layers, all parts) and its per-layer target KV page."""
    layout = PRESETS[model].layout(page_tokens)
    return layout.bytes_per_page, layout.part(Part.TARGET_KV).page_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the bench-alloc options to ``parser``."""
    add = parser.add_argument
    add("--pool-gib", type=float, default=220.0, help="host pool size in GiB (default 220)")
    add("--model", default="deepseek-v3.2", choices=sorted(PRESETS), help="layout giving the default page units")
    add("--page-bytes", default=None, help="comma-separated page sizes in bytes, one run each "
        "(default: the model's logical page and its per-layer target KV page)")
    add("--page-tokens", type=int, default=64, help="tokens per page (default 64)")
    add("--trace", type=Path, default=None, help="Mooncake-format trace for request sizes (default: embedded sizes)")
    add("--ops", type=int, default=20_000, help="timed ops per allocator (default 20000)")
    add("--warmup-ops", type=int, default=5_000, help="untimed ops after the pool fills (default 5000)")
    add("--turnover", type=float, default=1.0,
        help="warm up also until eviction has freed this many pools' worth of pages (default 1)")
    add("--block-ops", type=int, default=1_000, help="ops an allocator runs before the next takes its turn")
    add("--free-room", type=float, default=0.02, help="free fraction eviction keeps (default 0.02)")
    add("--hits", type=float, default=1.0, help="mean random hits per request (default 1)")
    add("--split", type=float, default=0.3, help="probability a hit splits its entry (default 0.3)")
    add("--cp-size", type=int, default=1, help="lanes of the LanePageAllocator run (default 1)")
    add("--torch-threads", type=int, default=1,
        help="torch intra-op threads for the token-slot allocators (default 1: steady on shared cores)")
    add("--max-slots", type=int, default=1 << 26, help="skip token-slot allocators above this many slots")
    add("--sample-reserves", type=int, default=16, help="reservations whose runs the JSON lists (default 16)")
    add("--seed", type=int, default=0, help="seed of the op sequence (default 0)")
    add("--json", type=Path, default=None, metavar="PATH", help="write results as JSON to PATH")


# -- replay ------------------------------------------------------------------


@dataclass
class _Replay:
    """One allocator's pass over the sequence: timings, checks and run statistics."""

    name: str
    peer: Any
    workload: Workload
    sample_every: int
    pos: int = 0
    reserve_ns: list[int] = field(default_factory=list)
    free_ns: list[int] = field(default_factory=list)
    run_counts: list[int] = field(default_factory=list)
    run_lengths: list[np.ndarray] = field(default_factory=list)
    samples: list[list[list[int]]] = field(default_factory=list)
    pages_reserved: int = 0

    def __post_init__(self) -> None:
        self.rows: list[list[int]] = self.workload.ops.tolist()
        self.used = np.zeros(self.workload.pool_pages, dtype=bool)
        self.held: dict[int, Any] = {}
        self.size: dict[int, int] = {}  # pages of each live reservation
        self.left: dict[int, int] = {}  # of which not yet freed

    def run(self, upto: int) -> None:
        """Replay ops ``[pos, upto)``, then check them; ``AssertionError`` on any wrong answer.

        The timed loop only calls the allocator and keeps the handles; the
        checks and run counts follow over the same block, in op order, so
        they add no work (and no cache traffic) between the timed calls.
        """
        peer, clock, rows = self.peer, time.perf_counter_ns, self.rows
        reserve, free, piece = peer.reserve, peer.free, peer.piece
        held, size = self.held, self.size
        done: list[Any] = []
        times: list[int] = []
        for k in range(self.pos, upto):
            kind, ident, lo, hi = rows[k]
            if kind == RESERVE:
                t0 = clock()
                handle = reserve(hi)
                t1 = clock()
                if handle is None:
                    raise AssertionError(f"{self.name}: op {k}: reserve of {hi} pages failed with room modelled")
                held[ident] = handle
                size[ident] = hi
            else:
                whole = held[ident]
                handle = whole if lo == 0 and hi == size[ident] else piece(whole, lo, hi)
                t0 = clock()
                free(handle)
                t1 = clock()
            done.append(handle)
            times.append(t1 - t0)
        for k, handle, ns in zip(range(self.pos, upto), done, times):
            self._check(k, handle, ns)
        self.pos = upto

    def _check(self, k: int, handle: Any, ns: int) -> None:
        """Check op ``k``'s result against the model of used pages; record its time and runs."""
        kind, ident, lo, hi = self.rows[k]
        pages = self.peer.pages(handle)
        timed = k >= self.workload.timed_from
        if kind == RESERVE:
            if pages.shape[0] != hi or self.used[pages].any():
                raise AssertionError(
                    f"{self.name}: op {k}: reserve of {hi} pages returned {pages.shape[0]} pages or a used one"
                )
            self.used[pages] = True
            self.left[ident] = hi
            if timed:
                self.reserve_ns.append(ns)
                self._count_runs(handle)
            return
        if pages.shape[0] != hi - lo or not self.used[pages].all():
            raise AssertionError(f"{self.name}: op {k}: piece [{lo}, {hi}) of entry {ident} is wrong")
        self.used[pages] = False
        if timed:
            self.free_ns.append(ns)
        self.left[ident] -= hi - lo
        if not self.left[ident]:
            del self.held[ident], self.size[ident], self.left[ident]

    def _count_runs(self, handle: Any) -> None:
        runs = self.peer.runs(handle)
        self.run_counts.append(runs.shape[0])
        self.run_lengths.append(runs[:, 1])
        self.pages_reserved += int(runs[:, 1].sum())
        if self.sample_every and (len(self.run_counts) - 1) % self.sample_every == 0:
            self.samples.append(runs.tolist())

    def summary(self) -> dict[str, Any]:
        res, fre = np.array(self.reserve_ns) / 1e3, np.array(self.free_ns) / 1e3
        counts = np.array(self.run_counts)
        lengths = np.concatenate(self.run_lengths) if self.run_lengths else np.zeros(0, dtype=np.int64)
        return {
            "label": self.peer.label,
            "ops": len(self.reserve_ns) + len(self.free_ns),
            "reserves": len(self.reserve_ns),
            "frees": len(self.free_ns),
            "pages_reserved": self.pages_reserved,
            "reserve_p50_us": _pct(res, 50),
            "reserve_p99_us": _pct(res, 99),
            "reserve_max_us": _pct(res, 100),
            "free_p50_us": _pct(fre, 50),
            "free_p99_us": _pct(fre, 99),
            "free_max_us": _pct(fre, 100),
            "median_total_us": round(_pct(res, 50) + _pct(fre, 50), 3),
            "reserve_mean_us": round(float(res.mean()), 3) if res.size else math.nan,
            "free_mean_us": round(float(fre.mean()), 3) if fre.size else math.nan,
            "runs_per_reserve": round(float(counts.mean()), 3) if counts.size else math.nan,
            "runs_per_reserve_p50": _pct(counts, 50, 1),
            "runs_per_reserve_p99": _pct(counts, 99, 1),
            "multi_run_reserve_fraction": round(float(np.mean(counts > 1)), 4) if counts.size else math.nan,
            "pages_per_run": round(float(lengths.mean()), 2) if lengths.size else math.nan,
            "run_length_histogram": _histogram(lengths),
            "sample_runs": self.samples,
        }


def _pct(a: np.ndarray, q: float, digits: int = 3) -> float:
    return round(float(np.percentile(a, q)), digits) if a.size else math.nan


def _histogram(lengths: np.ndarray) -> dict[str, list[int]]:
    """Run lengths in power-of-two buckets: ``{"4-7": [runs, pages], ...}``."""
    if lengths.size == 0:
        return {}
    bucket = np.floor(np.log2(lengths)).astype(np.int64)
    out: dict[str, list[int]] = {}
    for b in np.unique(bucket).tolist():
        sel = lengths[bucket == b]
        lo, hi = 1 << b, (1 << (b + 1)) - 1
        out[str(lo) if lo == hi else f"{lo}-{hi}"] = [int(sel.size), int(sel.sum())]
    return out


# -- one page unit -----------------------------------------------------------


def _run_unit(cfg: BenchConfig, page_bytes: int, sizes: SizeSource, sglang: tuple[Any, dict[str, str]]) -> dict[str, Any]:
    """Generate the unit's sequence, replay it through every allocator, summarise."""
    t0 = time.perf_counter()
    pages = cfg.pages(page_bytes)
    workload = make_workload(
        pool_pages=pages,
        sizes=sizes,
        page_tokens=cfg.page_tokens,
        timed_ops=cfg.ops,
        warmup_ops=cfg.warmup_ops,
        free_room=cfg.free_room,
        hits=cfg.hits,
        split=cfg.split,
        seed=cfg.seed,
        turnover=cfg.turnover,
    )
    logger.info("unit %d B: %d pages, %d ops generated in %.1f s", page_bytes, pages, workload.ops.shape[0],
                time.perf_counter() - t0)
    peers, skipped = make_peers(pages, cp_size=cfg.cp_size, max_slots=cfg.max_slots,
                                page_tokens=cfg.page_tokens, sglang=sglang)
    timed_reserves = int(np.count_nonzero(workload.ops[workload.timed_from :, 0] == RESERVE))
    every = max(1, timed_reserves // cfg.sample_reserves) if cfg.sample_reserves else 0
    replays = [_Replay(name, peer, workload, every) for name, peer in peers.items()]
    total = workload.ops.shape[0]
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for start in range(0, total, cfg.block_ops):
            for r in replays:
                r.run(min(start + cfg.block_ops, total))
    finally:
        if gc_was_enabled:
            gc.enable()
    for r in replays:
        r.peer.check()
        if r.samples and len(r.samples) > cfg.sample_reserves:
            del r.samples[cfg.sample_reserves :]
    allocators = {r.name: r.summary() for r in replays}
    ours_total = allocators["ours"]["median_total_us"]
    lane_total = allocators.get("ours_lane", {}).get("median_total_us")
    result: dict[str, Any] = {
        "page_bytes": page_bytes,
        "pages": pages,
        "workload": workload.describe(),
        "allocators": allocators,
        "skipped": skipped,
    }
    for base in BASELINES:
        if base in allocators:
            result[f"speedup_vs_{base}"] = round(allocators[base]["median_total_us"] / ours_total, 2)
            if lane_total:
                result[f"lane_speedup_vs_{base}"] = round(allocators[base]["median_total_us"] / lane_total, 2)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def run_config(cfg: BenchConfig) -> dict[str, Any]:
    """Run the benchmark described by ``cfg`` and return the result record.

    The top-level ``allocators`` and ``speedup_*`` keys are those of the first
    page unit; ``units`` holds every unit's record.
    """
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.torch_threads)
    try:
        return _run_config(cfg, t0, load_before)
    finally:
        torch.set_num_threads(threads_before)


def _run_config(cfg: BenchConfig, t0: float, load_before: tuple[float, float, float]) -> dict[str, Any]:
    sizes = SizeSource.from_trace(cfg.trace) if cfg.trace is not None else SizeSource.builtin()
    sglang = load_sglang_host_kv_cache()
    if sglang[0] is None:
        logger.warning("bench-alloc: SGLang's allocator is not importable (%s); using the labelled "
                       "re-implementation", sglang[1]["reason"])
    units = [_run_unit(cfg, b, sizes, sglang) for b in cfg.page_bytes]
    head = units[0]
    return {
        "pool_gib": cfg.pool_gib,
        "page_bytes": head["page_bytes"],
        "pages": head["pages"],
        "cp_size": cfg.cp_size,
        "seed": cfg.seed,
        "sglang": sglang[1],
        "workload": head["workload"],
        "allocators": head["allocators"],
        **{k: v for k, v in head.items() if k.startswith(("speedup_", "lane_speedup_"))},
        "units": units,
        "timing": "perf_counter_ns around each call; cyclic GC off during replays; allocators take "
                  f"turns every {cfg.block_ops} ops; checks run after each block; torch threads "
                  f"{cfg.torch_threads}",
        "load_average": [round(x, 2) for x in (*load_before, *os.getloadavg())],
        "wall_s": round(time.perf_counter() - t0, 1),
        "commit": git_commit(),
        "machine": machine(),
        "command": cfg.command,
    }


# -- reporting ---------------------------------------------------------------


def _print_unit(unit: dict[str, Any]) -> None:
    w = unit["workload"]
    print(
        f"\npage unit {unit['page_bytes']} B: {unit['pages']} pages; {w['timed_ops']} timed ops "
        f"({w['timed_reserves']} reserves of {w['reserve_pages_p50']:g} pages p50, "
        f"{w['reserve_pages_p99']:g} p99, {w['reserve_pages_max']} max; {w['timed_frees']} frees, "
        f"{w['timed_split_frees']} of split entries); sizes: {w['sizes']}"
    )
    header = (
        f"{'allocator':<16}{'reserve p50':>12}{'p99':>9}{'free p50':>10}{'p99':>9}"
        f"{'p50 sum':>9}{'runs/reserve':>13}{'p99':>6}{'multi-run':>10}"
    )
    print(header)
    print("-" * len(header))
    for name, r in unit["allocators"].items():
        print(
            f"{name:<16}{r['reserve_p50_us']:>12.2f}{r['reserve_p99_us']:>9.2f}{r['free_p50_us']:>10.2f}"
            f"{r['free_p99_us']:>9.2f}{r['median_total_us']:>9.2f}{r['runs_per_reserve']:>13.2f}"
            f"{r['runs_per_reserve_p99']:>6.0f}{r['multi_run_reserve_fraction']:>10.1%}"
        )
    print("(times in microseconds per call; every allocator ran the same ops)")
    for name, why in unit["skipped"].items():
        print(f"skipped {name}: {why}")
    speedups = [f"{v}x vs {k[len('speedup_vs_'):]}" for k, v in unit.items() if k.startswith("speedup_vs_")]
    lane = [f"{v}x vs {k[len('lane_speedup_vs_'):]}" for k, v in unit.items() if k.startswith("lane_speedup_vs_")]
    print("ours (median reserve+free): " + ", ".join(speedups))
    if lane:
        print("ours_lane: " + ", ".join(lane))


def _page_bytes(args: argparse.Namespace) -> tuple[int, ...]:
    """--page-bytes as given (an empty list is refused by BenchConfig, not
    taken as unset), or the model's defaults at a valid --page-tokens."""
    if args.page_bytes is None:
        if args.page_tokens <= 0:  # checked here, before the layout is built at that page size
            raise BenchInputError(f"--page-tokens must be positive, got {args.page_tokens}")
        return default_page_bytes(args.model, args.page_tokens)
    try:
        return tuple(int(x) for x in args.page_bytes.split(",") if x.strip())
    except ValueError:
        raise BenchInputError(f"--page-bytes {args.page_bytes!r}: expected comma-separated integers") from None


def run(args: argparse.Namespace) -> int:
    """Entry point behind ``hicache-cp bench-alloc``; returns the exit code.

    Bad input raises BenchInputError (an InputError): the CLI prints one line and exits 2.
    """
    checks.output_file("--json", args.json)
    cfg = BenchConfig(  # validates every flag (BenchInputError: exit 2, through the CLI)
        pool_gib=args.pool_gib,
        page_bytes=_page_bytes(args),
        ops=args.ops,
        seed=args.seed,
        page_tokens=args.page_tokens,
        warmup_ops=args.warmup_ops,
        turnover=args.turnover,
        block_ops=args.block_ops,
        free_room=args.free_room,
        hits=args.hits,
        split=args.split,
        cp_size=args.cp_size,
        torch_threads=args.torch_threads,
        max_slots=args.max_slots,
        sample_reserves=args.sample_reserves,
        trace=args.trace,
        json_path=args.json,
        command=command_line("bench-alloc"),
    )
    result = run_config(cfg)
    info = result["sglang"]
    print(f"pool {cfg.pool_gib:g} GiB; slot_list_lazy: "
          + (info["code"] if info["impl"] == "sglang" else f"RE-IMPLEMENTATION ({info['reason']})"))
    for unit in result["units"]:
        _print_unit(unit)
    if cfg.json_path is not None:
        write_json(cfg.json_path, result)
        print(f"wrote {cfg.json_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hicache_harness.bench.alloc``: the ``hicache-cp bench-alloc`` command."""
    from hicache_harness.cli import main as cli_main

    return cli_main(["bench-alloc", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
