"""Allocator microbenchmark: ``hicache-cp bench-alloc`` (or ``python -m hicache_cp.harness.bench.alloc``).

Measures what DOMAIN.md rule 6 asks to keep visible: the metadata cost of a
contiguity-preferring host page allocator on a fragmented pool of realistic
size (220 GiB of 41 KiB pages is about 5.6 million pages). Nothing is
allocated in memory beyond the allocators' own metadata.

Phases:

1. Fragment: an :class:`~hostmem.extents.ExtentAllocator` is filled through
   its own API with reserves of 1..256 pages, random allocations are freed
   until the pool is ~70 % used, then mixed reserve/free churn scatters the
   free space over thousands of extents.
2. Snapshot the free extents and the held allocations; every allocator
   starts from that identical state.
3. Replay one seeded op sequence (reserve ``--reserve-pages`` pages, or free a
   random held allocation, keeping usage near 70 %) against each allocator,
   timing each call with ``perf_counter_ns``:

   * ``ours``: :class:`~hostmem.extents.ExtentAllocator` (best fit over sorted
     free extents).
   * ``naive_scan``: a free bitmap scanned for the first run long enough on
     every reserve (``np.diff`` over the whole bitmap), falling back to
     gathering free pages in address order.
   * ``slot_list``: SGLang HostKVCache style, a torch int64 tensor of free
     slots; reserve slices the front, free concatenates with ``torch.cat``.

   The baselines are slow, so they replay only the first ``--naive-ops`` /
   ``--slot-ops`` ops of the same sequence (said in the output).

Speedups are baseline (median reserve + median free) / ours.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tqdm import tqdm

from hicache_cp.harness.provenance import git_commit, machine
from hostmem.extents import ExtentAllocator, Runs, pages_to_runs, runs_to_pages

logger = logging.getLogger(__name__)

__all__ = [
    "BenchConfig",
    "BenchInputError",
    "NaiveScanAllocator",
    "SlotListAllocator",
    "add_arguments",
    "main",
    "run",
]

#: Fraction of the pool kept in use during churn and the timed phase.
TARGET_USED = 0.70
#: Reserve sizes used to fragment the pool: uniform in [1, MAX_FRAGMENT_PAGES].
MAX_FRAGMENT_PAGES = 256

_RESERVE, _FREE = 0, 1


class BenchInputError(ValueError):
    """A bench-alloc argument is out of range; reported as one line, exit code 2."""


@dataclass(frozen=True)
class BenchConfig:
    """Validated bench-alloc parameters (see :func:`add_arguments`)."""

    pool_gib: float
    page_kib: float
    ops: int
    seed: int
    reserve_pages: int = 64
    naive_ops: int = 600
    slot_ops: int = 1500
    churn_ops: int | None = None
    json_path: Path | None = None
    command: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.pool_gib > 0:
            raise BenchInputError(f"--pool-gib must be positive, got {self.pool_gib}")
        if not self.page_kib > 0:
            raise BenchInputError(f"--page-kib must be positive, got {self.page_kib}")
        page_bytes = self.page_kib * 1024
        if page_bytes != int(page_bytes) or int(page_bytes) % 8:
            raise BenchInputError(
                f"--page-kib {self.page_kib} gives {page_bytes:g} bytes per page; "
                "the page size must be a whole multiple of 8 bytes"
            )
        for flag, value in (
            ("--ops", self.ops),
            ("--reserve-pages", self.reserve_pages),
            ("--naive-ops", self.naive_ops),
            ("--slot-ops", self.slot_ops),
        ):
            if value <= 0:
                raise BenchInputError(f"{flag} must be positive, got {value}")
        if self.churn_ops is not None and self.churn_ops < 0:
            raise BenchInputError(f"--churn-ops must be >= 0, got {self.churn_ops}")
        if self.num_pages < 1:
            raise BenchInputError(
                f"--pool-gib {self.pool_gib} is smaller than one page of {self.page_bytes} bytes"
            )
        if self.reserve_pages > self.num_pages * (1 - TARGET_USED) / 2:
            raise BenchInputError(
                f"--reserve-pages {self.reserve_pages} is too large for a pool of {self.num_pages} pages"
            )

    @property
    def page_bytes(self) -> int:
        return int(self.page_kib * 1024)

    @property
    def num_pages(self) -> int:
        return int(self.pool_gib * 2**30) // self.page_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the bench-alloc options to ``parser``."""
    parser.add_argument("--pool-gib", type=float, default=220.0, help="host pool size in GiB (default 220)")
    parser.add_argument("--page-kib", type=float, default=41.0, help="page size in KiB (default 41)")
    parser.add_argument(
        "--ops", type=int, default=200_000, help="timed ops for our allocator (default 200000)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the op sequence (default 0)")
    parser.add_argument("--reserve-pages", type=int, default=64, help="pages per timed reserve (default 64)")
    parser.add_argument(
        "--naive-ops", type=int, default=600, help="ops replayed by the naive scan baseline (default 600)"
    )
    parser.add_argument(
        "--slot-ops", type=int, default=1500, help="ops replayed by the slot list baseline (default 1500)"
    )
    parser.add_argument(
        "--churn-ops",
        type=int,
        default=None,
        help="fragmenting churn ops (default: half the pool's allocations)",
    )
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="write results as JSON to PATH"
    )


# -- baselines ---------------------------------------------------------------


class _Allocator(Protocol):
    """What the timed loop needs; ``Handle`` is whatever ``reserve`` returns."""

    def reserve(self, n: int) -> Any: ...

    def free(self, handle: Any) -> None: ...


class NaiveScanAllocator:
    """Baseline: a free bitmap scanned for contiguous space on every reserve.

    Reserve: O(num_pages), whatever the request. Free: O(pages freed).
    """

    def __init__(self, num_pages: int, free_runs: Runs) -> None:
        self.free_map = np.zeros(num_pages, dtype=bool)
        self.free_map[runs_to_pages(free_runs)] = True
        self.free_count = int(free_runs[:, 1].sum()) if free_runs.size else 0

    def reserve(self, n: int) -> Runs | None:
        """First run of >= n free pages, else the first free pages in address order."""
        if n > self.free_count:
            return None
        edges = np.diff(np.concatenate(([0], self.free_map.view(np.int8), [0])))
        starts = np.flatnonzero(edges == 1)
        lengths = np.flatnonzero(edges == -1) - starts
        fits = np.flatnonzero(lengths >= n)
        if fits.size:
            start = int(starts[fits[0]])
            runs = np.array([[start, n]], dtype=np.int64)
        else:
            upto = int(np.searchsorted(np.cumsum(lengths), n))
            runs = np.stack((starts[: upto + 1], lengths[: upto + 1]), axis=1).astype(np.int64)
            runs[-1, 1] -= int(runs[:, 1].sum()) - n
        for start, length in runs.tolist():
            self.free_map[start : start + length] = False
        self.free_count -= n
        return runs

    def free(self, runs: Runs) -> None:
        for start, length in runs.tolist():
            self.free_map[start : start + length] = True
        self.free_count += int(runs[:, 1].sum())


class SlotListAllocator:
    """Baseline in the style of SGLang's HostKVCache: a tensor of free slots.

    Reserve: O(1) slicing of the front. Free: O(free pages), ``torch.cat``
    copies the whole free list.
    """

    def __init__(self, free_pages: np.ndarray) -> None:
        self.free_slots = torch.from_numpy(np.ascontiguousarray(free_pages, dtype=np.int64))

    def reserve(self, n: int) -> torch.Tensor | None:
        if n > self.free_slots.numel():
            return None
        selected = self.free_slots[:n]
        self.free_slots = self.free_slots[n:]
        return selected

    def free(self, pages: torch.Tensor) -> None:
        self.free_slots = torch.cat((self.free_slots, pages))


# -- phases ------------------------------------------------------------------


@dataclass
class _Pool:
    """The fragmented starting state shared by every allocator."""

    ours: ExtentAllocator
    held: dict[int, Runs]
    next_id: int


def _fragment(cfg: BenchConfig, rng: np.random.Generator) -> _Pool:
    """Fill, thin to ~70 % used, then churn, all through the allocator's API."""
    alloc = ExtentAllocator(cfg.num_pages)
    held: dict[int, Runs] = {}
    ids: list[int] = []
    next_id = 0
    with _progress(total=cfg.num_pages, desc="fragment: fill", unit="page") as bar:
        while True:
            runs = alloc.reserve(int(rng.integers(1, MAX_FRAGMENT_PAGES + 1)))
            if runs is None:
                break
            held[next_id] = runs
            ids.append(next_id)
            next_id += 1
            bar.update(int(runs[:, 1].sum()))

    def free_random() -> None:
        j = int(rng.integers(len(ids)))
        ids[j], ids[-1] = ids[-1], ids[j]
        alloc.free(held.pop(ids.pop()))

    target_free = cfg.num_pages - int(TARGET_USED * cfg.num_pages)
    with _progress(total=target_free, desc="fragment: thin", unit="page") as bar:
        while alloc.free_pages < target_free and ids:
            before = alloc.free_pages
            free_random()
            bar.update(alloc.free_pages - before)
    churn = len(ids) // 2 if cfg.churn_ops is None else cfg.churn_ops
    for _ in _progress(range(churn), desc="fragment: churn", unit="op"):
        used = alloc.used_pages / cfg.num_pages
        if ids and (used > TARGET_USED or rng.random() < 0.5):
            free_random()
        else:
            runs = alloc.reserve(int(rng.integers(1, MAX_FRAGMENT_PAGES + 1)))
            if runs is not None:
                held[next_id] = runs
                ids.append(next_id)
                next_id += 1
    return _Pool(alloc, held, next_id)


def _op_sequence(cfg: BenchConfig, pool: _Pool, rng: np.random.Generator) -> np.ndarray:
    """Seeded ``(kind, allocation id)`` rows, independent of any allocator.

    A model of the free-page count keeps usage near ``TARGET_USED`` and
    guarantees every reserve fits, so all allocators serve the same pages.
    """
    ids = list(pool.held)
    sizes = {i: int(r[:, 1].sum()) for i, r in pool.held.items()}
    free = pool.ours.free_pages
    next_id = pool.next_id
    ops = np.empty((cfg.ops, 2), dtype=np.int64)
    for k in range(cfg.ops):
        used = 1 - free / cfg.num_pages
        p_reserve = 0.6 if used < TARGET_USED else 0.4
        if free >= cfg.reserve_pages and (not ids or rng.random() < p_reserve):
            ops[k] = (_RESERVE, next_id)
            sizes[next_id] = cfg.reserve_pages
            ids.append(next_id)
            free -= cfg.reserve_pages
            next_id += 1
        else:
            j = int(rng.integers(len(ids)))
            ids[j], ids[-1] = ids[-1], ids[j]
            victim = ids.pop()
            ops[k] = (_FREE, victim)
            free += sizes.pop(victim)
    return ops


@dataclass
class _Timing:
    ops: int
    reserve_ns: np.ndarray
    free_ns: np.ndarray
    runs_per_reserve: np.ndarray
    pages_reserved: int

    def summary(self) -> dict[str, float | int]:
        def pct(a: np.ndarray, q: float) -> float:
            return round(float(np.percentile(a, q)) / 1e3, 3) if a.size else float("nan")

        return {
            "ops": self.ops,
            "reserves": int(self.reserve_ns.size),
            "frees": int(self.free_ns.size),
            "pages_reserved": self.pages_reserved,
            "reserve_p50_us": pct(self.reserve_ns, 50),
            "reserve_p99_us": pct(self.reserve_ns, 99),
            "free_p50_us": pct(self.free_ns, 50),
            "free_p99_us": pct(self.free_ns, 99),
            "runs_per_reserve_mean": round(float(self.runs_per_reserve.mean()), 3)
            if self.runs_per_reserve.size
            else float("nan"),
        }

    @property
    def median_total_ns(self) -> float:
        return float(np.median(self.reserve_ns) + np.median(self.free_ns))


def _replay(
    name: str,
    alloc: _Allocator,
    ops: np.ndarray,
    pool: _Pool,
    reserve_pages: int,
    to_handle: Any,
    to_runs: Any,
) -> _Timing:
    """Run ``ops`` against ``alloc``, timing each reserve and free call alone."""
    held: dict[int, Any] = {}
    reserve_ns: list[int] = []
    free_ns: list[int] = []
    runs_count: list[int] = []
    pages = 0
    clock = time.perf_counter_ns
    for kind, ident in _progress(ops.tolist(), desc=f"timing {name}", unit="op"):
        if kind == _RESERVE:
            t0 = clock()
            handle = alloc.reserve(reserve_pages)
            t1 = clock()
            if handle is None:
                raise AssertionError(f"{name}: reserve of {reserve_pages} pages failed with room modelled")
            reserve_ns.append(t1 - t0)
            runs = to_runs(handle)
            got = int(runs[:, 1].sum())
            if got != reserve_pages:
                raise AssertionError(f"{name}: reserve returned {got} pages, asked {reserve_pages}")
            runs_count.append(runs.shape[0])
            pages += got
            held[ident] = handle
        else:
            handle = held.pop(ident) if ident in held else to_handle(pool.held[ident])
            t0 = clock()
            alloc.free(handle)
            t1 = clock()
            free_ns.append(t1 - t0)
    return _Timing(
        ops=len(ops),
        reserve_ns=np.array(reserve_ns, dtype=np.int64),
        free_ns=np.array(free_ns, dtype=np.int64),
        runs_per_reserve=np.array(runs_count, dtype=np.int64),
        pages_reserved=pages,
    )


def _progress(iterable: Any = None, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr that disappears when done and is off when stderr is not a tty."""
    return tqdm(iterable, unit_scale=True, leave=False, disable=None, **kwargs)


def _identity(x: Any) -> Any:
    return x


def _pages_tensor(runs: Runs) -> torch.Tensor:
    return torch.from_numpy(runs_to_pages(runs))


def _tensor_runs(pages: torch.Tensor) -> Runs:
    return pages_to_runs(pages.numpy())


# -- reporting ---------------------------------------------------------------


def _print_table(results: dict[str, dict[str, Any]], total_ops: int) -> None:
    header = (
        f"{'allocator':<12}{'ops':>9}{'reserve p50':>13}{'p99':>10}"
        f"{'free p50':>11}{'p99':>10}{'runs/reserve':>14}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(
            f"{name:<12}{r['ops']:>9}{r['reserve_p50_us']:>13.2f}{r['reserve_p99_us']:>10.2f}"
            f"{r['free_p50_us']:>11.2f}{r['free_p99_us']:>10.2f}{r['runs_per_reserve_mean']:>14.2f}"
        )
    print("(times in microseconds per call)")
    for name, r in results.items():
        if r["ops"] < total_ops:
            print(
                f"note: {name} replayed the first {r['ops']} of the {total_ops} ops "
                "(same sequence); it is slow"
            )


def run_config(cfg: BenchConfig) -> dict[str, Any]:
    """Run the benchmark described by ``cfg`` and return the result record."""
    rng = np.random.default_rng(cfg.seed)
    t0 = time.perf_counter()
    pool = _fragment(cfg, rng)
    stats = pool.ours.stats()
    free_runs = pool.ours.free_runs()
    logger.info("fragmented %d pages in %.1f s: %s", cfg.num_pages, time.perf_counter() - t0, stats)
    ops = _op_sequence(cfg, pool, rng)

    timings: dict[str, _Timing] = {}
    timings["ours"] = _replay("ours", pool.ours, ops, pool, cfg.reserve_pages, _identity, _identity)
    pool.ours.check_invariants()
    naive = NaiveScanAllocator(cfg.num_pages, free_runs)
    naive_ops = ops[: min(cfg.naive_ops, cfg.ops)]
    timings["naive_scan"] = _replay(
        "naive_scan", naive, naive_ops, pool, cfg.reserve_pages, _identity, _identity
    )
    slots = SlotListAllocator(runs_to_pages(free_runs))
    slot_ops = ops[: min(cfg.slot_ops, cfg.ops)]
    timings["slot_list"] = _replay(
        "slot_list", slots, slot_ops, pool, cfg.reserve_pages, _pages_tensor, _tensor_runs
    )

    ours_ns = timings["ours"].median_total_ns
    return {
        "pool_gib": cfg.pool_gib,
        "page_kib": cfg.page_kib,
        "pages": cfg.num_pages,
        "reserve_pages": cfg.reserve_pages,
        "seed": cfg.seed,
        "used_fraction": round(stats.used_pages / cfg.num_pages, 4),
        "free_extents": stats.num_free_extents,
        "largest_free_run": stats.largest_free_run,
        "fragmentation": round(stats.fragmentation, 6),
        "allocators": {name: t.summary() for name, t in timings.items()},
        "speedup_vs_naive_scan": round(timings["naive_scan"].median_total_ns / ours_ns, 1),
        "speedup_vs_slot_list": round(timings["slot_list"].median_total_ns / ours_ns, 1),
        "wall_s": round(time.perf_counter() - t0, 2),
        "commit": git_commit(),
        "machine": machine(),
        "command": cfg.command,
    }


def run(args: argparse.Namespace) -> int:
    """Entry point behind ``hicache-cp bench-alloc``; returns the exit code.

    Bad input prints one ``error:`` line on stderr and returns 2.
    """
    try:
        cfg = BenchConfig(
            pool_gib=args.pool_gib,
            page_kib=args.page_kib,
            ops=args.ops,
            seed=args.seed,
            reserve_pages=args.reserve_pages,
            naive_ops=args.naive_ops,
            slot_ops=args.slot_ops,
            churn_ops=args.churn_ops,
            json_path=args.json,
            command=list(sys.argv),
        )
    except BenchInputError as exc:
        print(f"hicache-cp bench-alloc: error: {exc}", file=sys.stderr)
        return 2
    result = run_config(cfg)
    print(
        f"pool {cfg.pool_gib:g} GiB / {cfg.page_kib:g} KiB pages = {result['pages']} pages; "
        f"{result['used_fraction']:.0%} used, {result['free_extents']} free extents, "
        f"largest {result['largest_free_run']} pages, fragmentation {result['fragmentation']:.4f}"
    )
    _print_table(result["allocators"], cfg.ops)
    print(
        f"speedup (median reserve+free): {result['speedup_vs_naive_scan']}x vs naive_scan, "
        f"{result['speedup_vs_slot_list']}x vs slot_list"
    )
    if cfg.json_path is not None:
        cfg.json_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.json_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {cfg.json_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hicache_cp.harness.bench.alloc``: parse ``argv`` and :func:`run`."""
    parser = argparse.ArgumentParser(prog="hicache-cp bench-alloc", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
