"""The replay on the ranks of one node sharing its host tier, and an engine restart in the middle.

    --node-ranks N         N rank processes of one node: TP replicas (cp_size 1, the same
                           KV on every rank, every decision agreed over the N ranks)
    --node-segment NAME    L2 in the node segment NAME (`node_segment`): one copy for
                           the N ranks, each writing its share of every backup
                           (docs/node-tier.md); without it each rank keeps its own L2,
                           as an engine's TP ranks do today
    --restart-at K         after request K's layer hooks (its copies in flight, nothing
                           decided) every rank kills itself with SIGKILL; new ranks
                           then open the segment, adopt what was committed and replay
                           requests K..; the report is theirs, plus `restart`
    --report-from K        the report's `continuation`: the hits of requests K.. alone
                           (an uninterrupted run to hold a restart against)

A restart needs the node segment (nothing else outlives the processes). The
killed ranks leave it to the new ones: their locks die with them, so the new
ranks find nobody mapping it and adopt it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from hicache_cp.config import Config
from hicache_harness import checks
from hicache_harness.errors import InputError
from hicache_harness.trace import TraceRequest


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node-ranks", type=int,
                   help="rank processes of one node: TP replicas sharing every decision (default 1)")
    p.add_argument("--node-segment", metavar="NAME",
                   help="keep L2 in the node segment NAME, one copy shared by the node's ranks (node_segment)")
    p.add_argument("--restart-at", type=int, metavar="K",
                   help="kill every rank with SIGKILL during request K's backups, restart, adopt, replay K..")
    p.add_argument("--report-from", type=int, metavar="K", help="also report the hit rate of requests K.. alone")


def check_node_args(args: argparse.Namespace) -> None:
    """The flags alone (before the config is known); raises InputError."""
    checks.in_range("--node-ranks", args.node_ranks, 1, 64)
    for flag, value in (("--restart-at", args.restart_at), ("--report-from", args.report_from)):
        checks.in_range(flag, value, 0, 1 << 40)
    if args.restart_at is not None and args.report_from is not None and args.report_from != args.restart_at:
        raise InputError(f"--report-from {args.report_from} differs from --restart-at {args.restart_at}: "
                         "a restarted replay reports from its restart")  # fmt: skip
    if args.restart_at is not None:
        args.report_from = args.restart_at


def check_node_config(args: argparse.Namespace, config: Config, sources: dict[str, str]) -> None:
    """What the resolved config must allow for these flags; raises InputError."""
    ranks = args.node_ranks or 1
    if ranks > 1 and config.cp_size > 1:
        raise InputError(f"--node-ranks {ranks} runs TP replicas (cp_size 1); cp_size is {config.cp_size} "
                         f"(from {sources['cp_size']}): give one of them")  # fmt: skip
    if ranks > 1 and (args.pd or getattr(args, "engine", "synthetic") != "synthetic" or getattr(args, "l3", None)):
        raise InputError(f"--node-ranks {ranks} runs the synthetic engine alone (no --pd, --l3 or --engine hf)")
    if args.restart_at is not None:
        if not config.node_segment:
            raise InputError("--restart-at needs the node segment (--node-segment NAME): nothing else outlives the ranks")
        if args.pd or getattr(args, "l3", None) or getattr(args, "engine", "synthetic") != "synthetic":
            raise InputError("--restart-at runs the synthetic engine alone (no --pd, --l3 or --engine hf)")


def world_size(args: argparse.Namespace, config: Config) -> int:
    """Rank processes of the run: the CP group, or the node's TP replicas."""
    return max(config.cp_size, args.node_ranks or 1)


def run_restart(args: argparse.Namespace, config: Config, requests: list[TraceRequest],
                run_phase: Callable[..., list[dict[str, Any]]]) -> list[dict[str, Any]]:  # fmt: skip
    """Phase 1: requests ..K, every rank killed during request K; phase 2: new ranks
    adopt the segment and replay K... `run_phase(requests, crash_at, report_from)`
    runs one phase on every rank and returns their reports (None for a killed rank).
    Returns phase 2's reports, each with `restart` added."""
    k = args.restart_at
    if k >= len(requests):
        raise InputError(f"--restart-at {k}: the replay has {len(requests)} requests")
    t0 = time.perf_counter()
    killed = run_phase(requests[: k + 1], k, None)
    if any(r is not None for r in killed):
        raise RuntimeError(f"--restart-at {k}: a rank finished instead of dying at request {k}")
    t1 = time.perf_counter()
    reports = run_phase(requests[k:], None, 0)
    for rep in reports:
        stats = rep.get("stats", {})
        rep["restart"] = {
            "at_request": k, "phase1_s": round(t1 - t0, 3), "phase2_s": round(time.perf_counter() - t1, 3),
            **{key: stats.get(key) for key in ("node_decision", "node_adopted", "node_adopted_pages", "node_adopted_nodes",
                                               "node_dropped_entries", "node_open_s", "node_adopt_s",
                                               "node_verified_pages", "node_verify_failures")},
        }  # fmt: skip
        rep["continuation"]["from_request"] = k  # phase 2 reports from its first request, K
    return reports
