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
sys.path.insert(0, str(ROOT))

from hicache_harness.outputs import write_json  # noqa: E402

OURS, THEIRS = "hicache-cp", "sglang-hicache"


def half_from_host(mode: dict[str, Any]) -> list[float]:
    """TTFTs of the requests with at least half their prompt from host (sglang_engine.summarise's rule)."""
    return [q["ttft_ms"] for q in mode.get("requests", []) if q["host_tokens"] * 2 >= q["prompt_tokens"]]


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: each run's half-from-host p50, the pooled median and greedy identity."""
    modes = sorted({m for run in runs for m in run["modes"]})
    out: dict[str, Any] = {}
    for mode in modes:
        rows = [run["modes"][mode] for run in runs if mode in run["modes"]]
        pooled = [t for row in rows for t in half_from_host(row)]
        out[mode] = {
            "runs": len(rows),
            "half_from_host_ttft_p50_ms_by_run": [row.get("half_from_host_ttft_p50_ms") for row in rows],
            "half_from_host_requests_pooled": len(pooled),
            "half_from_host_ttft_p50_ms_pooled": statistics.median(pooled) if pooled else None,
            "greedy_identical_to_none_by_run": [row.get("greedy_identical_to_none") for row in rows],
        }
    if OURS in out and THEIRS in out:
        pairs = zip(out[OURS]["half_from_host_ttft_p50_ms_by_run"], out[THEIRS]["half_from_host_ttft_p50_ms_by_run"])
        out["runs_at_most_sglang"] = sum(1 for a, b in pairs if a is not None and b is not None and a <= b)
    return out


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
    summary = pool(runs)
    for mode, row in summary.items():
        if isinstance(row, dict):
            by_run = ", ".join("-" if v is None else f"{v:.1f}" for v in row["half_from_host_ttft_p50_ms_by_run"])
            pooled = row["half_from_host_ttft_p50_ms_pooled"]
            print(f"{mode:15s} half-from-host TTFT p50 by run: {by_run}; pooled over "
                  f"{row['half_from_host_requests_pooled']} requests: {'-' if pooled is None else f'{pooled:.1f}'} ms; "
                  f"greedy == none: {row['greedy_identical_to_none_by_run']}")  # fmt: skip
    if "runs_at_most_sglang" in summary:
        print(f"runs where {OURS} <= {THEIRS}: {summary['runs_at_most_sglang']} of {len(runs)}")
    if args.json:
        commit, machine = ids.pop()
        write_json(args.json, {"commit": commit, "machine": machine,
                               "command": "python bench/scripts/engine_runs.py " + " ".join(map(str, args.runs)),
                               "runs": [str(path) for path in args.runs], "modes": summary})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
