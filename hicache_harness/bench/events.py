"""`hicache-cp bench-events`: what publishing KV cache events costs a replay, and what it buys a router.

Cost: the same replay (`hicache-cp replay`, the synthetic reference server
with every byte verified) runs without events and with `--kv-events` in
each engine's format, in interleaved rounds (off, sglang, vllm, off, ...)
so that load on the machine hits every variant alike. Per run it records

    wall_s      the replay's wall time (its report)
    cpu_s       the process's CPU time over the whole replay call
    publish_s   with events: time the replay's thread spent on them: keying and
                emitting inside the cache (`EventLog.seconds`) plus taking,
                encoding and sending each request's batch (the publisher's)

and reports, per format, `publish_fraction`: the median over its runs of
publish_s / (wall_s - publish_s), the events' share of the replay measured
inside one run, so that load on a shared machine slows both sides alike (the
target: at most 0.02); beside it the medians' wall and CPU ratios against
the runs without events (noisier: the same work varies run to run when
other processes share the machine).
The engines' modules are imported, and their hash code loaded, before any
clock starts.

Router (`--router`): `hicache_harness.router.compare` on the embedded workload and
the trace: two instances routed on GPU-tier events only, then on GPU and
host events; host-hit tokens of each.

Output: a table and JSON (`--json`) with every run, the summary, the
configuration and the provenance (commit, machine, command).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from pathlib import Path
from typing import Any

from hicache_harness.outputs import write_json
from hicache_harness.provenance import command_line, git_commit, machine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, help="Mooncake-format trace (default: the embedded workload)")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--model", help="model preset (default tiny)")
    p.add_argument("--tokens-per-block", type=int, help="tokens per trace block (default: one page)")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="any config field, as replay takes it")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--formats", default="sglang,vllm", help="event formats to measure (default sglang,vllm)")
    p.add_argument("--router", action="store_true", help="also compare routing on GPU-only vs GPU+host events")
    p.add_argument("--json", type=Path, help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    from hicache_harness import checks
    from hicache_harness.kv_events import FORMATS, engine_format

    checks.in_range("--rounds", args.rounds, 1, 100)
    checks.output_file("--json", args.json)
    formats = [f for f in args.formats.split(",") if f]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        from hicache_harness.errors import InputError

        raise InputError(f"--formats {args.formats!r}: expected a comma-separated subset of {', '.join(FORMATS)}")
    engines = {f: engine_format(f) for f in formats}  # imported and warm before any clock
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for variant in ["off", *formats]:
            runs.append({"round": r, "variant": variant, **_replay_once(args, None if variant == "off" else variant)})
            print(f"round {r} {variant:>6}: wall {runs[-1]['wall_s']:.3f} s, cpu {runs[-1]['cpu_s']:.3f} s"
                  + (f", events {runs[-1]['publish_s']:.4f} s" if variant != "off" else ""), flush=True)
    result: dict[str, Any] = {"runs": runs, "summary": _summary(runs, formats)}
    if args.router:
        result["router"] = _router(args, engines[formats[0]])
    result.update(commit=git_commit(), machine=machine(), command=command_line("bench-events"),
                  trace=str(args.trace) if args.trace else "embedded", model=args.model or "tiny", limit=args.limit)
    _print(result)
    if args.json:
        write_json(args.json, result)
    return 0


def _replay_argv(args: argparse.Namespace, fmt: str | None, port: int) -> list[str]:
    argv: list[str] = []  # every byte is verified, as in a plain replay
    if args.trace:
        argv += ["--trace", str(args.trace)]
    for flag, value in (("--limit", args.limit), ("--model", args.model), ("--tokens-per-block", args.tokens_per_block)):
        if value is not None:
            argv += [flag, str(value)]
    for item in args.set or ():
        argv += ["--set", item]
    if fmt is not None:
        argv += ["--kv-events", f"tcp://127.0.0.1:{port}", "--kv-events-format", fmt]
    return argv


def _replay_once(args: argparse.Namespace, fmt: str | None) -> dict[str, Any]:
    from hicache_harness.replay import command

    parser = argparse.ArgumentParser(prog="replay")
    command.add_arguments(parser)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    replay_args = parser.parse_args(_replay_argv(args, fmt, port))
    replay_args.verbose = 0
    t0 = time.process_time()
    report = command.replay(replay_args)
    out = {"wall_s": report["wall_s"], "cpu_s": round(time.process_time() - t0, 4),
           "hit_rate": report.get("hit_rate"), "integrity_mismatches": report.get("integrity_mismatches")}  # fmt: skip
    if fmt is not None:
        ev = report["kv_events"]
        out.update(publish_s=ev["publish_s"], emit_s=ev["emit_s"], encode_send_s=ev["encode_send_s"],
                   batches=ev["batches"], events=ev["events"])  # fmt: skip
    return out


def _summary(runs: list[dict[str, Any]], formats: list[str]) -> dict[str, Any]:
    def median(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["variant"] == variant)

    off_wall, off_cpu = median("off", "wall_s"), median("off", "cpu_s")
    out: dict[str, Any] = {"off_wall_s": off_wall, "off_cpu_s": off_cpu}
    for f in formats:
        out[f] = {
            "wall_s": median(f, "wall_s"), "cpu_s": median(f, "cpu_s"), "publish_s": median(f, "publish_s"),
            "emit_s": median(f, "emit_s"), "encode_send_s": median(f, "encode_send_s"),
            "publish_fraction": round(statistics.median(r["publish_s"] / (r["wall_s"] - r["publish_s"])
                                                         for r in runs if r["variant"] == f), 4),
            "wall_ratio": round(median(f, "wall_s") / off_wall, 4), "cpu_ratio": round(median(f, "cpu_s") / off_cpu, 4),
        }  # fmt: skip
    return out


def _router(args: argparse.Namespace, fmt: Any) -> dict[str, Any]:
    from hicache_cp.config import Config
    from hicache_harness.router import compare
    from hicache_harness.trace import load_trace, request_tokens, unique_blocks
    from hicache_harness.workload import default_workload

    out: dict[str, Any] = {"format": fmt.name}
    workloads = [("embedded", default_workload(seed=0), 1.2)]
    if args.trace:
        workloads.append(("trace", load_trace(args.trace, limit=args.limit), 3.0))
    page = Config(model="tiny").layout().bytes_per_page
    for name, requests, l1_longest in workloads:
        l2 = max(8, int(0.1 * unique_blocks(requests)))
        l1 = max(l2 // 8, int(l1_longest * max(len(r.hash_ids) for r in requests)))
        config = Config(model="tiny", l1_pages=l1 + 1, host_budget_bytes=(l2 + 1) * page, io_backend="cpu",
                        pin_host=False)  # fmt: skip
        res = compare([request_tokens(r, config.page_size) for r in requests], config, fmt)
        out[name] = {"l1_pages": l1, "l2_pages": l2, **res}
    return out


def _print(result: dict[str, Any]) -> None:
    s = result["summary"]
    print(f"\nbench-events: {result['trace']} ({result['model']}), commit {result['commit']}")
    print(f"  without events: wall {s['off_wall_s']:.3f} s, cpu {s['off_cpu_s']:.3f} s (medians)")
    for f, v in s.items():
        if isinstance(v, dict):
            print(f"  {f:>6}: events {v['publish_s']:.4f} s = {v['publish_fraction']:.2%} of the replay "
                  f"(emit {v['emit_s']:.4f}, encode+send {v['encode_send_s']:.4f}); wall x{v['wall_ratio']:.3f}, "
                  f"cpu x{v['cpu_ratio']:.3f}")
    for name, r in result.get("router", {}).items():
        if isinstance(r, dict):
            g, b = r["gpu_events"], r["gpu_and_host_events"]
            print(f"  router {name}: host-hit tokens {g['l2_hit_tokens']:,} on GPU events, "
                  f"{b['l2_hit_tokens']:,} on GPU+host events (L1 {r['l1_pages']}, L2 {r['l2_pages']} pages each)")
