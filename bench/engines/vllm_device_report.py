"""Turn the device run's pytest JUnit XML into bench/results/vllm-<machine>.json (commit, machine, command).

    python3 bench/engines/vllm_device_report.py --junit J.xml --log L.log --command "..." --json OUT.json [--extra K=FILE]

Written by bench/device/vllm.sh on the device machine; the JSON lists every
test with its outcome and time, the totals, the versions that ran (Python,
torch, CUDA device, vLLM) and whatever extra JSON files the script names
(the import check, the vllm.LLM probe).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hicache_harness.provenance import git_commit, machine  # noqa: E402


def tests_of(junit: Path) -> list[dict]:
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        detail = None
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                detail = (el.get("message") or "")[:500]
        out.append({"id": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                    "seconds": round(float(case.get("time") or 0), 3), **({"detail": detail} if detail else {})})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--junit", type=Path, required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--log", type=Path)
    ap.add_argument("--extra", action="append", default=[], help="KEY=FILE.json to include")
    args = ap.parse_args()
    import torch

    tests = tests_of(args.junit) if args.junit.exists() else []
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    cuda = [t for t in tests if "[cuda" in t["id"]]
    report = {
        "commit": git_commit(), "machine": machine(), "command": args.command,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "counts": counts,
        "cuda_counts": {o: sum(1 for t in cuda if t["outcome"] == o) for o in ("passed", "failed", "error", "skipped")},
        "tests": tests,
        "log": args.log.name if args.log else None,
    }
    try:
        import vllm

        report["vllm"] = vllm.__version__
    except Exception as exc:  # noqa: BLE001 - recorded
        report["vllm"] = f"import failed: {exc!r}"
    for item in args.extra:
        key, _, path = item.partition("=")
        p = Path(path)
        report[key] = json.loads(p.read_text()) if p.exists() else None
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.json}: {counts}; on CUDA {report['cuda_counts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
