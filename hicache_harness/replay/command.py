"""`hicache-cp replay`: the main job.

Replays a Mooncake-format trace (or the embedded default workload) through
the reference prefill server with hicache-cp as its L2, verifies every
reused byte, and reports hit rates per tier, bytes moved and integrity:

    hicache-cp replay                                   # embedded workload, tiny model
    hicache-cp replay --trace t.jsonl --l2-fraction 0.1 --json out.json --bounds

Modules: `setup` (requests, sizing, configuration), `rank` (one rank's
loop), `multirank` (CP ranks and the decode peer as processes), `report`
(bounds, table, JSON).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hicache_cp.presets import PRESETS
from hicache_harness.replay.instances import add_l3_arguments, check_l3_args, run_instances, uses_instances
from hicache_harness.replay.multirank import run_ranks
from hicache_harness.replay.node import add_node_arguments, check_node_args, check_node_config, world_size
from hicache_harness.replay.rank import replay_rank
from hicache_harness.engines import add_engine_arguments
from hicache_harness.errors import ExitCode
from hicache_harness.outputs import write_json
from hicache_harness.replay.report import compute_bounds, integrity_failures, print_table
from hicache_harness.replay.setup import build_config, check_args, load_requests, tokens_per_block
from hicache_cp.policy import policy_names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace (default: the embedded workload)")
    p.add_argument("--model", choices=sorted(PRESETS), help="model preset (default: tiny)")
    p.add_argument("--config", type=Path, help="TOML config file (see hicache_cp.config)")
    p.add_argument("--l1-pages", type=int, help="logical L1 capacity in pages (default: L2 / 8, at least 3 requests)")
    l2 = p.add_mutually_exclusive_group()
    l2.add_argument("--l2-gib", type=float, help="host budget per rank in GiB")
    l2.add_argument(
        "--l2-fraction",
        type=float,
        help="L2 as a fraction of the unique-block footprint (default 0.1 for a trace, 0.5 for the embedded workload)",
    )
    p.add_argument("--tokens-per-block", type=int, help="tokens per 512-token trace block (default: one page)")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--policy", choices=policy_names(), help="eviction policy (default lru)")
    p.add_argument("--write-policy", choices=["write_through", "write_through_selective", "write_back"])
    p.add_argument("--io-backend", help="io backend (default auto)")
    p.add_argument("--cp-size", type=int, help="context-parallel ranks, one process each (default: the config's, 1)")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="set any config field (repeatable); beats --config and HICACHE_* (see hicache_cp.config)")
    p.add_argument("--pd", action="store_true", help="ship every request's KV to a decode peer process")
    p.add_argument("--pd-timeout-s", type=float, help="PD: seconds a transfer room may stay unfinished (default 300)")
    p.add_argument("--pd-per-layer", action="store_true", default=None,
                   help="PD: send each layer from the forward's layer hooks instead of after insert")
    p.add_argument("--bounds", action="store_true", help="also compute the infinite-capacity and Belady bounds")
    p.add_argument("--no-verify", action="store_true", help="skip the byte-for-byte integrity check")
    p.add_argument("--seed", type=int, default=0, help="seed of the embedded workload")
    p.add_argument("--json", type=Path, help="write the report as JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG of hit rate and occupancy here")
    p.add_argument("--device", default="auto", help="L1 device: auto, cpu, cuda or cuda:N")
    p.add_argument("--metrics-port", type=int,
                   help="serve Prometheus metrics on this port during the run (rank r uses port + r)")
    p.add_argument("--metrics-addr", default="127.0.0.1", help="address the metrics endpoint binds (default loopback)")
    p.add_argument("--kv-events", metavar="ENDPOINT",
                   help="publish KV cache events (BlockStored/BlockRemoved per tier) over ZMQ, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--kv-events-format", choices=["sglang", "vllm"],
                   help="the engine whose keys and event format to use (default sglang; see docs/events.md)")
    add_engine_arguments(p)
    add_l3_arguments(p)
    add_node_arguments(p)


def run(args: argparse.Namespace) -> int:
    """The command: exit 0 when clean, 1 on any integrity failure (see
    `hicache_harness.errors`); bad input raises and the CLI reports it."""
    report = replay(args)
    failures = integrity_failures(report)
    report["integrity_failures"] = failures
    print_table(report)
    if args.json:
        write_json(args.json, report)
    for f in failures:
        print(f"hicache-cp replay: integrity failure: {f}", file=sys.stderr)
    return ExitCode.INTEGRITY if failures else ExitCode.OK


def replay(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole replay described by `args`; return the report dict.

    Every input is checked before any work starts (`setup.check_args`,
    `setup.build_config`); bad input raises InputError/ConfigError/TraceError."""
    check_args(args)
    check_l3_args(args)
    check_node_args(args)
    requests = load_requests(args)
    resolved, sizing = build_config(args, requests)
    config = resolved.config
    check_node_config(args, config, resolved.sources)
    if uses_instances(args, config):
        report = run_instances(args, config, requests, resolved.sources)
    elif world_size(args, config) > 1 or args.pd or args.restart_at is not None:
        report = run_ranks(args, config, requests)
    else:
        report = replay_rank(args, config, requests, report_from=args.report_from)
    if report.get("backup_pages_wanted"):  # computed pages that never got an L2 copy (so never an L3 one)
        uncopied = report["backup_pages_skipped"] + report.get("backup_pages_dropped", 0)
        report["l2_uncopied_fraction"] = round(uncopied / report["backup_pages_wanted"], 4)
    report.update(
        trace_tokens=sum(r.input_length for r in requests),
        footprint_pages=sizing.footprint_pages,
        l1_logical_pages=sizing.l1_logical_pages,
        l2_logical_pages=sizing.l2_logical_pages,
        config=resolved.report(),
    )
    if "l3_config" in report:  # what ran: the master and sizes derived for the run, not the defaults
        ran = report.pop("l3_config")
        report["config"]["l3"]["value"] = ran
        flags = {"master": ("--l3-master", args.l3_master), "pages_per_object": ("--l3-pages-per-object",
                 args.l3_pages_per_object), "segment_bytes": ("--l3-segment-mib", args.l3_segment_mib),
                 "write_queue_pages": ("--l3-write-queue", args.l3_write_queue)}  # fmt: skip
        given = resolved.config.to_dict()["l3"]
        sources = report["config"]["l3"]["sources"]
        for k, v in ran.items():
            flag, value = flags.get(k, ("", None))
            if value is not None:
                sources[k] = f"cli:{flag}"
            elif v != given.get(k):
                sources[k] = "derived:replay (a master started here, sizes from the trace and L2)"
    if args.bounds:
        report["bounds"] = compute_bounds(requests, sizing, tokens_per_block(args, config) // config.page_size)
    return report
