"""Several runs of the SGLang engine bench, read together: one run's TTFT moves by more than the gap.

`bench/engines/sglang_engine.py` runs each mode once per call, so a device
session with several calls has several JSONs of the same commit. This reads
them and prints, per mode: each run's TTFT p50 of the requests with at least
half their prompt from host (the engine bench's rule), the same over every
such request of every run pooled, how many runs met "at most SGLang's", and
whether greedy outputs were identical to the `none` run in every run that
had one:

    python bench/scripts/engine_runs.py RUN.json... [--json OUT]

Reads only the files named; the commit and machine written are the runs' own
(all must share them: runs of different commits or GPUs do not pool).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "engines")]

from hicache_harness.outputs import write_json  # noqa: E402
from sglang_engine import half_from_host  # noqa: E402 - the engine bench's own rule for a host hit

OURS, THEIRS = "hicache-cp", "sglang-hicache"


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: each run's half-from-host p50, the pooled median and greedy identity."""
    modes = sorted({m for run in runs for m in run["modes"]})
    out: dict[str, Any] = {}
    for mode in modes:
        rows = [run["modes"][mode] for run in runs if mode in run["modes"]]
        pooled = [t for row in rows for t in half_from_host(row.get("requests", []))]
        out[mode] = {
            "runs": len(rows),
            "half_from_host_ttft_p50_ms_by_run": [row.get("half_from_host_ttft_p50_ms") for row in rows],
            "half_from_host_requests_pooled": len(pooled),
            "half_from_host_ttft_p50_ms_pooled": statistics.median(pooled) if pooled else None,
            "greedy_identical_to_none_by_run": [row.get("greedy_identical_to_none") for row in rows],
        }
    return out


def runs_at_most_sglang(modes: dict[str, Any]) -> int | None:
    """Runs whose half-from-host p50 of hicache-cp was at most SGLang HiCache's (None: a mode is missing)."""
    if OURS not in modes or THEIRS not in modes:
        return None
    pairs = zip(modes[OURS]["half_from_host_ttft_p50_ms_by_run"], modes[THEIRS]["half_from_host_ttft_p50_ms_by_run"])
    return sum(1 for a, b in pairs if a is not None and b is not None and a <= b)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="sglang_engine.py JSONs of one commit on one GPU")
    p.add_argument("--json", type=Path, help="write the pooled summary here")
    args = p.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in args.runs]
    ids = {(run["commit"], run["machine"]) for run in runs}
    if len(ids) != 1:
        print(f"engine_runs: the runs are of different commits or machines: {sorted(ids)}", file=sys.stderr)
        return 2
    modes = pool(runs)
    for mode, row in modes.items():
        by_run = ", ".join("-" if v is None else f"{v:.1f}" for v in row["half_from_host_ttft_p50_ms_by_run"])
        pooled = row["half_from_host_ttft_p50_ms_pooled"]
        print(f"{mode:15s} half-from-host TTFT p50 by run: {by_run}; pooled over "
              f"{row['half_from_host_requests_pooled']} requests: {'-' if pooled is None else f'{pooled:.1f}'} ms; "
              f"greedy == none: {row['greedy_identical_to_none_by_run']}")  # fmt: skip
    won = runs_at_most_sglang(modes)
    if won is not None:
        print(f"runs where {OURS} <= {THEIRS}: {won} of {len(runs)}")
    if args.json:
        commit, machine = ids.pop()
        write_json(args.json, {"commit": commit, "machine": machine,
                               "command": "python bench/scripts/engine_runs.py " + " ".join(map(str, args.runs)),
                               "runs": [str(path) for path in args.runs], "modes": modes,
                               "runs_at_most_sglang": won})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
