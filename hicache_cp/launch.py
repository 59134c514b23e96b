"""Run CP ranks as real processes on one machine, and combine their reports.

Runs in: the parent process (`run_ranks`, `spawn_ranks`) and one spawned
child per rank (`_rank_main`). The protocol:

    parent: pick a free port, spawn N children (multiprocessing 'spawn')
    child r: init_process_group(r, N, port)    # gloo on CPU, NCCL on CUDA
             agreement = cp_agreement()         # one MIN all-reduce per poll
             result = fn(RankContext, *args)    # e.g. replay_rank(...)
             queue.put(("ok", r, result))  or  queue.put(("error", r, traceback))
    parent: collect N results; the first error or a rank that died without
            reporting terminates every other rank and raises RankFailed with
            that rank's traceback. Every wait has a deadline: no hang.

`run_ranks` is what `hicache-cp replay --cp-size N` calls: every rank replays
the same requests with the same calls (DOMAIN.md rule 7, see
`hicache_cp.cp`) and the parent checks that the replicated decisions (hit
tokens, commits, evictions) agree on every rank - a divergence is a bug and
raises `ConsistencyError` with both values - and sums the per-rank byte and
integrity counters.

PD hook (`--pd`): the decode peer is another engineer's module. When
`hicache_cp.pd.sender` and `hicache_cp.pd.launch_hooks` exist, the parent
calls ``launch_hooks.start_decode_peer(args, config, requests) -> peer``
(``peer.rank_info`` is picklable and handed to every rank; ``peer.stop() ->
dict`` goes to report["pd"]) and each rank passes
``lambda cache: launch_hooks.make_sink(rank_info, cache) -> RequestSink`` to
`replay_rank` as its sink factory (the cache carries rank, cp_size and the
pools to register); the ranks' ``pd_*`` counters go to their per-rank
entries, ``pd_*bytes`` are also summed. Without them `--pd` fails with a
one-line error.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hicache_cp import cp
from hicache_cp.agreement import DistributedAgreement
from hicache_cp.config import Config
from hicache_cp.errors import ConsistencyError, HiCacheError
from hicache_cp.trace import TraceRequest

logger = logging.getLogger(__name__)

# Whole-run deadline of a replay's ranks; override with HICACHE_CP_RANK_TIMEOUT_S.
DEFAULT_RUN_TIMEOUT_S = 3600.0
# After the first failure, how long to wait for the other ranks' reports
# (they usually fail too, in the collective) before terminating them.
FAILURE_GRACE_S = 1.0
# A rank that exited is given this long for its queued report to arrive.
EXIT_GRACE_S = 5.0
JOIN_TIMEOUT_S = 10.0

# Counters each rank measures for its own pages: summed over ranks.
PER_RANK_SUM_KEYS = ("bytes_d2h", "bytes_h2d", "integrity_checked_pages", "integrity_mismatches", "host_bytes")
# Decisions every rank makes identically: taken from rank 0, checked on all.
REPLICATED_KEYS = (
    "requests", "prompt_tokens", "l1_hit_tokens", "l2_hit_tokens", "miss_tokens", "hit_rate",
    "backups_committed", "backups_aborted", "evictions_l1", "evictions_l2", "rejected_requests",
    "l2_used_pages", "l2_capacity_pages", "l1_capacity_pages",
)  # fmt: skip


class RankFailed(HiCacheError):
    """A CP rank raised, died or timed out; the message carries its traceback."""


@dataclass
class RankContext:
    """What a rank function gets: its place in the group and the agreement."""

    rank: int
    world_size: int
    group: cp.CpGroup
    agreement: DistributedAgreement


RankFn = Callable[..., Any]


# ---- generic: run a function on N ranks -----------------------------------------------------


def spawn_ranks(
    fn: RankFn,
    world_size: int,
    fn_args: Sequence[Any] = (),
    *,
    timeout_s: float = DEFAULT_RUN_TIMEOUT_S,
    backend: str | None = None,
) -> list[Any]:
    """Run ``fn(ctx, *fn_args)`` on `world_size` spawned ranks; return their results by rank.

    `fn` must be a module-level function (spawn pickles it by name) and its
    arguments and result picklable. Blocks until every rank reported, or
    raises RankFailed (first failing rank's traceback first) after killing
    the rest. Nothing outlives the call.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    port = cp.free_port()
    level = logging.getLogger().getEffectiveLevel()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, r, world_size, port, backend, tuple(fn_args), results_q, level),
            name=f"hicache-cp-rank{r}",
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results_q, timeout_s)
    finally:
        _reap(procs)
        results_q.close()


def _rank_main(
    fn: RankFn,
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    fn_args: tuple[Any, ...],
    results_q: Any,
    log_level: int,
) -> None:
    """Child process body: join the group, run `fn`, report back. Never raises."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    # Report before leaving the group: a rank that raised must be heard before
    # its peers see the connection drop in a collective and report that instead.
    try:
        group = cp.init_process_group(rank, world_size, port=port, backend=backend)
    except BaseException:
        results_q.put(("error", rank, traceback.format_exc()))
        return
    try:
        agreement = cp.cp_agreement(group)
        result = fn(RankContext(rank, world_size, group, agreement), *fn_args)
        results_q.put(("ok", rank, result))
    except BaseException:
        results_q.put(("error", rank, traceback.format_exc()))
    finally:
        try:
            cp.destroy_process_group()
        except Exception:  # the group may be broken by a failed peer; the process exits anyway
            pass


def _collect(procs: list[Any], results_q: Any, timeout_s: float) -> list[Any]:
    n = len(procs)
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    errors: list[tuple[int, str]] = []
    exited_at: dict[int, float] = {}
    first_error_at: float | None = None
    while len(results) < n:
        now = time.monotonic()
        if first_error_at is not None and (now - first_error_at > FAILURE_GRACE_S or len(results) + len(errors) >= n):
            break
        if now > deadline:
            running = [r for r in range(n) if r not in results]
            errors.append((running[0], f"timed out after {timeout_s:.0f} s; ranks {running} had not reported"))
            break
        try:
            kind, rank, payload = results_q.get(timeout=0.1)
        except queue.Empty:
            for r, p in enumerate(procs):
                if r in results or any(e[0] == r for e in errors) or p.is_alive():
                    continue
                exited_at.setdefault(r, now)
                if now - exited_at[r] > EXIT_GRACE_S:
                    errors.append((r, f"rank {r} exited with code {p.exitcode} without reporting"))
                    first_error_at = first_error_at or now
            continue
        if kind == "ok":
            results[rank] = payload
        else:
            errors.append((rank, payload))
            first_error_at = first_error_at or time.monotonic()
    if errors:
        # A peer's failure shows up on the other ranks as a broken collective:
        # put the rank that failed for its own reason first.
        errors.sort(key=lambda e: _is_collective_error(e[1]))
        first_rank, first_text = errors[0]
        others = "".join(
            f"\n--- rank {r} also failed (likely a consequence) ---\n{_last_lines(t)}" for r, t in errors[1:]
        )
        raise RankFailed(f"CP rank {first_rank} of {n} failed:\n{first_text.rstrip()}{others}")
    return [results[r] for r in range(n)]


_COLLECTIVE_ERROR_MARKS = ("DistBackendError", "Connection closed by peer", "Connection reset by peer",
                          "ProcessGroupGloo", "ProcessGroupNCCL", "Broken pipe")


def _is_collective_error(text: str) -> bool:
    return any(mark in text for mark in _COLLECTIVE_ERROR_MARKS)


def _last_lines(text: str, k: int = 3) -> str:
    return "\n".join(text.rstrip().splitlines()[-k:])


def _reap(procs: list[Any]) -> None:
    """Join every rank; terminate, then kill, those that do not exit in time."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=JOIN_TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join(timeout=JOIN_TIMEOUT_S)


# ---- the replay ----------------------------------------------------------------------------


def run_ranks(args: argparse.Namespace, config: Config, requests: list[TraceRequest]) -> dict[str, Any]:
    """Replay `requests` on `args.cp_size` rank processes; return the combined report."""
    peer = None
    rank_info = None
    if args.pd:
        hooks = _pd_hooks()
        peer = hooks.start_decode_peer(args, config, requests)
        rank_info = peer.rank_info
    timeout = float(os.environ.get("HICACHE_CP_RANK_TIMEOUT_S", DEFAULT_RUN_TIMEOUT_S))
    t0 = time.perf_counter()
    try:
        reports = spawn_ranks(_replay_rank, args.cp_size, (args, config, requests, rank_info), timeout_s=timeout)
    finally:
        pd_report = peer.stop() if peer is not None else None
    combined = combine_reports(reports, wall_s=time.perf_counter() - t0)
    if pd_report is not None:
        combined["pd"] = pd_report
    return combined


def _replay_rank(
    ctx: RankContext, args: argparse.Namespace, config: Config, requests: list[TraceRequest], pd_info: Any
) -> dict[str, Any]:
    """One rank of `run_ranks` (runs in the child)."""
    from hicache_cp.replay import replay_rank

    sink_factory = None
    if pd_info is not None:
        make_sink = _pd_hooks().make_sink
        sink_factory = lambda cache: make_sink(pd_info, cache)  # noqa: E731 - built in the child, never pickled
    report = replay_rank(args, config, requests, rank=ctx.rank, agreement=ctx.agreement,
                         sink_factory=sink_factory, progress=ctx.rank == 0)
    report["collectives"] = ctx.agreement.collectives
    return report


def combine_reports(reports: Sequence[dict[str, Any]], *, wall_s: float) -> dict[str, Any]:
    """One report from every rank's: replicated values checked and taken from
    rank 0, per-rank counters summed, a `per_rank` table added.

    Raises ConsistencyError naming the key, the ranks and both values when a
    replicated decision differs between ranks.
    """
    base = reports[0]
    for r, rep in enumerate(reports[1:], start=1):
        for k in REPLICATED_KEYS:
            if k in base and rep.get(k) != base[k]:
                raise ConsistencyError(
                    f"CP ranks diverged on {k}: rank 0 has {base[k]!r}, rank {r} has {rep.get(k)!r}",
                    rank=r,
                    details={"key": k, "rank0": base[k], f"rank{r}": rep.get(k)},
                )
    out = dict(base)
    for k in PER_RANK_SUM_KEYS:
        out[k] = sum(int(rep.get(k, 0)) for rep in reports)
    for k in base:  # PD transfer bytes are counted per sending rank (DOMAIN.md rule 10)
        if k.startswith("pd_") and k.endswith("bytes"):
            out[k] = sum(int(rep.get(k, 0)) for rep in reports)
    out["mismatch_examples"] = [m for rep in reports for m in rep.get("mismatch_examples", [])][:10]
    out["wall_s"] = round(wall_s, 3)
    out["per_rank"] = [_per_rank(r, rep) for r, rep in enumerate(reports)]
    return out


def _per_rank(rank: int, rep: dict[str, Any]) -> dict[str, Any]:
    """This rank's own lane of L2 (physical pages; the dummy page excluded)."""
    cp_size = int(rep.get("cp_size", 1))
    stats = rep.get("stats", {})
    capacity = int(rep["l2_capacity_pages"]) // cp_size
    lane_free = stats.get("l2_lane_free_pages")
    used = capacity - int(lane_free[rank]) if lane_free is not None else None
    entry = {
        "rank": rank,
        "l2_used_pages": used,
        "l2_capacity_pages": capacity,
        "host_bytes": rep.get("host_bytes"),
        "bytes_d2h": rep.get("bytes_d2h"),
        "bytes_h2d": rep.get("bytes_h2d"),
        "integrity_checked_pages": rep.get("integrity_checked_pages"),
        "integrity_mismatches": rep.get("integrity_mismatches"),
        "collectives": rep.get("collectives"),
        "wall_s": rep.get("wall_s"),
    }
    entry.update({k: v for k, v in rep.items() if k.startswith("pd_")})
    return entry


def _pd_hooks() -> Any:
    """The PD integration module, or a one-line InputError saying what is missing."""
    from hicache_cp.replay import InputError

    try:
        importlib.import_module("hicache_cp.pd.sender")
    except ImportError as exc:
        raise InputError(f"--pd needs the PD module (hicache_cp.pd.sender): {exc}") from None
    try:
        return importlib.import_module("hicache_cp.pd.launch_hooks")
    except ModuleNotFoundError as exc:
        if exc.name != "hicache_cp.pd.launch_hooks":
            raise
        raise InputError(
            "--pd: the PD replay integration is not available yet (hicache_cp.pd.launch_hooks with "
            "start_decode_peer(args, config, requests) and make_sink(rank_info, cache) is missing)"
        ) from None
