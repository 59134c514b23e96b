"""The replay on several processes: CP ranks, and the decode peer for `--pd`.

`run_ranks` is what `hicache-cp replay --cp-size N` (or `--pd`) calls: every
rank replays the same requests with the same calls (docs/invariants.md rule 7, see
`hicache_cp.cp`) and the parent checks that the replicated decisions (hit
tokens, commits, evictions) agree on every rank - a divergence is a bug and
raises `ConsistencyError` with both values - and sums the per-rank byte and
integrity counters. With `--pd` one decode peer process receives every
rank's pages; the ranks' `pd_*` counters go to their per-rank entries and
`pd_*bytes` are also summed.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

from hicache_cp.cache import HiCache
from hicache_cp.config import Config
from hicache_cp.errors import ConsistencyError
from hicache_harness.engines import make_engine
from hicache_harness.engines.synthetic import RequestSink
from hicache_harness.launch import RankContext, spawn_ranks
from hicache_harness.replay.node import run_restart, world_size
from hicache_harness.replay.rank import replay_rank
from hicache_harness.replay.setup import run_timeout_s
from hicache_harness.trace import TraceRequest

# Counters each rank measures for its own pages: summed over ranks.
PER_RANK_SUM_KEYS = (
    "bytes_d2h", "bytes_h2d", "integrity_checked_pages", "integrity_checked_units", "integrity_expected_units",
    "integrity_mismatches", "host_bytes", "host_pss_bytes",
)  # fmt: skip
# The same, from the hf engine (present only in its reports).
HF_PER_RANK_SUM_KEYS = (
    "integrity_checked_l2_units", "integrity_digest_variants", "integrity_restore_checked_units",
    "integrity_refused_units", "loads_refused", "cp_exchange_collectives", "cp_exchange_bytes",
)  # fmt: skip
# Decisions every rank makes identically: taken from rank 0, checked on all.
REPLICATED_KEYS = (
    "requests", "prompt_tokens", "l1_hit_tokens", "l2_hit_tokens", "miss_tokens", "hit_rate",
    "backups_committed", "backups_aborted", "evictions_l1", "evictions_l2", "rejected_requests",
    "l2_used_pages", "l2_capacity_pages", "l1_capacity_pages",
    # hf engine: every rank runs the replicated forward and every oracle on the same requests
    "served_requests", "redone_requests", "restarted_requests", "forwards",
    "outputs_checked", "outputs_mismatches", "draft_outputs_checked", "draft_outputs_mismatches",
    "spec_checked", "spec_mismatches", "faults_injected",
)  # fmt: skip
# Per-rank values of the hf engine's oracles, shown in each rank's entry (rank 0's are the report's).
HF_PER_RANK_KEYS = (
    "outputs_max_abs_err", "draft_outputs_max_abs_err", "spec_accept_mean_restored", "spec_accept_mean_recomputed",
    "loads_refused", "integrity_refused_units", "integrity_restore_checked_units", "cp_exchange_collectives",
    "cp_exchange_bytes",
)  # fmt: skip


def run_ranks(args: argparse.Namespace, config: Config, requests: list[TraceRequest]) -> dict[str, Any]:
    """Replay `requests` on `config.cp_size` rank processes (or `--node-ranks` TP
    replicas); return the combined report. `--restart-at`: see `replay.node`.

    The whole run's deadline is `HICACHE_CP_RANK_TIMEOUT_S` (default one hour)."""
    make_engine(args).configure(args, config, requests)  # the engine's options, checked before any rank starts
    peer = None
    rank_info = None
    if args.pd:
        from hicache_harness import pd_replay

        peer = pd_replay.start_decode_peer(args, config, requests)
        rank_info = peer.rank_info
    timeout = run_timeout_s()
    t0 = time.perf_counter()
    world = world_size(args, config)
    backend = "gloo" if args.device == "cpu" else None  # NCCL (one GPU a rank) for --device cuda

    def phase(reqs: list[TraceRequest], crash_at: int | None, report_from: int | None) -> list[dict[str, Any]]:
        return spawn_ranks(_replay_rank, world, (args, config, reqs, rank_info, crash_at, report_from),
                           timeout_s=timeout, backend=backend, killed_ok=crash_at is not None)  # fmt: skip

    try:
        if args.restart_at is not None:
            reports = run_restart(args, config, requests, phase)
        elif world == 1:  # one rank (with the decode peer): in this process
            reports = [replay_rank(args, config, requests, sink_factory=_sink_factory(rank_info),
                                   report_from=args.report_from)]  # fmt: skip
        else:
            reports = phase(requests, None, args.report_from)
    except BaseException:  # failed or interrupted: stop the peer, never wait on it
        if peer is not None:
            peer.terminate()
        raise
    pd_report = peer.stop() if peer is not None else None
    combined = combine_reports(reports, wall_s=time.perf_counter() - t0)
    if pd_report is not None:
        combined["pd"] = pd_report
    return combined


def _replay_rank(
    ctx: RankContext, args: argparse.Namespace, config: Config, requests: list[TraceRequest], pd_info: Any,
    crash_at: int | None = None, report_from: int | None = None,
) -> dict[str, Any]:
    """One rank of `run_ranks` (runs in the child). On CUDA each rank uses its own
    GPU (`cuda:LOCAL_RANK`, the one its NCCL group was set up on). TP replicas
    (`--node-ranks`) are CP rank 0 each: the same pages, their own agreement rank."""
    device = ctx.group.device if str(args.device).startswith("cuda") else args.device
    rank = ctx.rank if config.cp_size > 1 else 0
    report = replay_rank(args, config, requests, rank=rank, agreement=ctx.agreement,
                         sink_factory=_sink_factory(pd_info), progress=ctx.rank == 0, device=device,
                         crash_at=crash_at, report_from=report_from)  # fmt: skip
    report["collectives"] = ctx.agreement.collectives
    return report


def _sink_factory(pd_info: Any) -> Callable[[HiCache], RequestSink] | None:
    """The PD sink of a rank, built where the rank runs (never pickled)."""
    if pd_info is None:
        return None
    from hicache_harness import pd_replay

    return lambda cache: pd_replay.make_sink(pd_info, cache)


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
    for k in HF_PER_RANK_SUM_KEYS:
        if k in base:
            out[k] = sum(int(rep.get(k, 0)) for rep in reports)
    for k in base:  # PD transfer bytes are counted per sending rank (docs/invariants.md rule 10)
        if k.startswith("pd_") and k.endswith("bytes"):
            out[k] = sum(int(rep.get(k, 0)) for rep in reports)
    for k in {k for rep in reports for k in rep}:  # each rank checks the pages it holds
        if k.startswith(("verified_", "verify_failures")):
            out[k] = sum(int(rep.get(k, 0)) for rep in reports)
    if "continuation" in base:  # the hits are replicated; checked above through their totals
        out["continuation"] = base["continuation"]
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
    used = capacity - int(lane_free[rank if cp_size > 1 else 0]) if lane_free is not None else None
    entry = {
        "rank": rank,
        "l2_used_pages": used,
        "l2_capacity_pages": capacity,
        "host_bytes": rep.get("host_bytes"),
        "host_pss_bytes": rep.get("host_pss_bytes"),
        "bytes_d2h": rep.get("bytes_d2h"),
        "bytes_h2d": rep.get("bytes_h2d"),
        "integrity_checked_pages": rep.get("integrity_checked_pages"),
        "integrity_checked_units": rep.get("integrity_checked_units"),
        "integrity_expected_units": rep.get("integrity_expected_units"),
        "integrity_mismatches": rep.get("integrity_mismatches"),
        "collectives": rep.get("collectives"),
        "wall_s": rep.get("wall_s"),
    }
    entry.update({k: v for k, v in rep.items() if k.startswith("pd_")})
    entry.update({k: rep[k] for k in HF_PER_RANK_KEYS if k in rep})
    return entry
