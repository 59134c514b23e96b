#!/usr/bin/env python
"""Eviction policies on three generated workloads of different reuse shape
(issue 29, class 8): does any ordering of the policies hold beyond the two
workloads of the README's table?

    .venv/bin/python bench/scripts/policy_workloads.py [--fractions 0.05,0.1,0.25] [--policies ...]

The workloads come from the embedded generator (`hicache_harness.workload`), seeded:

- `multiturn`: chat sessions that extend their own prefix turn by turn
  (the generator's defaults, another seed than the embedded workload);
- `agentic`: tool loops: up to 20 short turns a session (tool results of
  100-600 tokens, short answers), many sessions interleaved;
- `hot_document`: one shared 30-block document read by 300 short sessions
  (1-3 questions of 500-3000 tokens each).

L1 is the replay's default (L2 / 8, but at least three of the longest
requests), so on small footprints L1 holds much of the working set and the
hit rate can pass the Belady bound, which is computed at L2's capacity alone.

Each cell is `bench/scripts/policy_sweep.py`'s (one verified replay, LRU with the
Belady bound first). Writes bench/results/policy-workloads.json (commit,
machine, command, every cell, and per policy whether it was ever below LRU).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hicache_harness.provenance import git_commit, machine  # noqa: E402
from hicache_harness.trace import write_trace  # noqa: E402
from hicache_harness.workload import default_workload  # noqa: E402
from policy_sweep import DEFAULT_VARIANTS, sweep  # noqa: E402

WORKLOADS = {
    "multiturn": dict(seed=11, sessions=150, single_shot=40),
    "agentic": dict(seed=12, sessions=200, single_shot=20, max_turns=20, user_tokens=(100, 600),
                    output_tokens=(20, 200), think_ms=3000.0, session_gap_ms=1000.0),
    "hot_document": dict(seed=13, sessions=300, single_shot=40, system_prompts=1, system_blocks=(30, 30),
                         max_turns=3, user_tokens=(500, 3000), output_tokens=(50, 500), session_gap_ms=500.0),
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fractions", default="0.05,0.1,0.25")
    p.add_argument("--policies", default=",".join(DEFAULT_VARIANTS))
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "policy-workloads.json")
    args = p.parse_args(argv)
    fractions = tuple(float(x) for x in args.fractions.split(",") if x)
    policies = ["lru"] + [x for x in args.policies.split(",") if x and x != "lru"]
    with tempfile.TemporaryDirectory() as tmp:
        workloads = []
        for name, kwargs in WORKLOADS.items():
            path = Path(tmp) / f"{name}.jsonl"
            write_trace(path, default_workload(**kwargs))  # type: ignore[arg-type]
            workloads.append((name, path, fractions))
        rows = sweep(workloads, policies, verify=not args.no_verify)
    verdict = {
        policy: {
            "below_lru_in": [f"{r['workload']}@{r['l2_fraction']}" for r in rows
                             if r["policy"] == policy and r["hit_rate"] < r["lru_hit_rate"]],
            "integrity_clean": all(r["integrity_mismatches"] == 0 for r in rows if r["policy"] == policy),
        }
        for policy in policies
    }  # fmt: skip
    result = {"commit": git_commit(), "machine": machine(),
              "command": " ".join(["bench/scripts/policy_workloads.py", *(argv if argv is not None else sys.argv[1:])]),
              "workloads": WORKLOADS, "rows": rows, "verdict": verdict}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    for policy, v in verdict.items():
        print(f"{policy:<20} below LRU in: {', '.join(v['below_lru_in']) or 'none'}")
    print(f"wrote {args.json}")
    return 0 if all(v["integrity_clean"] for v in verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
