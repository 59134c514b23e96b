"""Run a function on N rank processes of one machine (torch.distributed).

Runs in: the parent process (`spawn_ranks`) and one spawned child per rank
(`_rank_main`). The protocol:

    parent: pick a free port, spawn N children (multiprocessing 'spawn')
    child r: init_process_group(r, N, port)    # gloo on CPU, NCCL on CUDA
             agreement = cp_agreement()         # one MIN all-reduce per poll
             result = fn(RankContext, *args)    # the caller's function
             queue.put(("ok", r, result))  or  queue.put(("error", r, traceback))
    parent: collect N results; the first error or a rank that died without
            reporting terminates every other rank and raises RankFailed with
            that rank's traceback. Every wait has a deadline: no hang.

The launcher knows nothing of what the ranks run: the replay passes its rank
function in (`hicache_harness.replay_ranks`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hicache_cp.cp import groups as cp
from hicache_cp.cp.agreement import DistributedAgreement
from hicache_cp.errors import HiCacheError
from hicache_harness import lifetime

logger = logging.getLogger(__name__)

# Default whole-run deadline of a call to `spawn_ranks`.
DEFAULT_RUN_TIMEOUT_S = 3600.0
# After the first failure, how long to wait for the other ranks' reports
# (they usually fail too, in the collective) before terminating them.
FAILURE_GRACE_S = 1.0
# A rank that exited is given this long for its queued report to arrive.
EXIT_GRACE_S = 5.0
JOIN_TIMEOUT_S = 10.0


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
    killed_ok: bool = False,
) -> list[Any]:
    """Run ``fn(ctx, *fn_args)`` on `world_size` spawned ranks; return their results by rank.

    `fn` must be a module-level function (spawn pickles it by name) and its
    arguments and result picklable. Blocks until every rank reported, or
    raises RankFailed (first failing rank's traceback first) after killing
    the rest. Nothing outlives the call. `killed_ok`: a rank that died of
    SIGKILL without reporting (a crash the caller staged) has the result None.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    port = cp.free_port()
    level = logging.getLogger().getEffectiveLevel()
    procs = [
        ctx.Process(
            target=lifetime.child_main,
            args=(os.getpid(), _rank_main, fn, r, world_size, port, backend, tuple(fn_args), results_q, level),
            name=f"hicache-cp-rank{r}",
            daemon=True,
        )
        for r in range(world_size)
    ]
    try:
        lifetime.start_processes(procs)
        results = _collect(procs, results_q, timeout_s, killed_ok)
    except BaseException:  # a failed rank, or the parent interrupted: stop the rest now
        lifetime.stop_processes(procs)
        results_q.close()
        raise
    _reap(procs)
    results_q.close()
    return results


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


def _collect(procs: list[Any], results_q: Any, timeout_s: float, killed_ok: bool = False) -> list[Any]:
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
                if killed_ok and p.exitcode == -signal.SIGKILL:
                    results[r] = None
                elif now - exited_at[r] > EXIT_GRACE_S:
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
