#!/usr/bin/env python3
"""The race's variants as one result file (`bench/device/sglang_variants.sh`).

    variants.py DIR OUT --command CMD      every DIR/<variant>.json (a bench-sglang run) into OUT,
                                           and each variant's per-call p50s printed
    variants.py --rewrap OLD --log LOG     a file of the earlier shape ({variant: run}) in the
                                           shape below, the command read from LOG's header line

OUT: {"commit", "machine", "command", "variants": {name: run}}. The commit and machine are
the runs' own (every run must name the same ones); the command is the script's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hicache_harness.provenance import log_header  # noqa: E402


def merge(runs: dict[str, dict[str, Any]], command: str) -> dict[str, Any]:
    """The variants' runs under the provenance they share; ValueError when they do not."""
    if not runs:
        raise ValueError("no variant ran")
    shared: dict[str, str] = {}
    for key in ("commit", "machine"):
        values = {name: run.get(key) for name, run in runs.items()}
        if len(set(values.values())) != 1 or None in values.values():
            raise ValueError(f"the variants do not share one {key}: {values}")
        shared[key] = next(iter(values.values()))
    return {**shared, "command": command, "variants": runs}


def print_calls(runs: dict[str, dict[str, Any]], top: int = 10) -> None:
    """Each variant's tree-cache time and its `top` calls by total time."""
    for name, run in runs.items():
        for wl, rows in run["workloads"].items():
            for r in rows:
                if "calls" not in r:
                    print(name, r["backend"], "failed:", r.get("error"))
                    continue
                print(f"== {name} {wl} {r['pools']} {r['backend']}: tree-cache {r['tree_cache_ms_per_request']:.2f} "
                      f"ms/request, hooks {r['hook_ms_per_request']:.2f}, wall {r['wall_s']:.2f} s, "
                      f"exposed backup {r.get('exposed_backup_fraction')}")  # fmt: skip
                for k, c in sorted(r["calls"].items(), key=lambda kv: -kv[1]["total_ms"])[:top]:
                    print(f"   {k:34s} {c['calls']:6d} p50 {c['p50_us']:8.1f} p99 {c['p99_us']:8.1f} total {c['total_ms']:8.1f}")


def command_of(log: Path) -> str:
    """The command a device log's header line names (`bench/device/env.sh`'s `header`)."""
    header = log_header(log.read_text().splitlines()[0])
    if header is None:
        raise ValueError(f"{log}: no header line with a command")
    return header[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", type=Path)
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--command")
    ap.add_argument("--rewrap", type=Path)
    ap.add_argument("--log", type=Path)
    args = ap.parse_args(argv)
    if args.rewrap is not None:
        if args.log is None:
            ap.error("--rewrap needs --log")
        runs = json.loads(args.rewrap.read_text())
        if "variants" in runs:
            raise ValueError(f"{args.rewrap} is in the current shape already")
        out, command = args.rewrap, command_of(args.log)
    else:
        if args.dir is None or args.out is None or args.command is None:
            ap.error("DIR, OUT and --command are needed")
        runs = {f.stem: json.loads(f.read_text()) for f in sorted(args.dir.glob("*.json"))}
        out, command = args.out, args.command
    print_calls(runs)
    out.write_text(json.dumps(merge(runs, command), indent=1) + "\n")
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
