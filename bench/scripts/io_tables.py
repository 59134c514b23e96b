"""Markdown tables of the copy-engine results (issue 28), from their JSON, for the README.

    python3 bench/scripts/io_tables.py [bench/results/io-h200.json] [bench/results/io-vs-sglang-h200.json]

Prints, from bench-io's JSON: the default backend's exposure rows (scattered
and in runs, per page count), every variant's exposure beside the same forward
with its link ratios and submit times at 1024 pages, and the top-level keys;
from bench/scripts/io_vs_sglang.py's JSON: the race table. Numbers are copied from
the files, never typed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _f(x: Any, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else "-"


def io_tables(r: dict[str, Any]) -> str:
    out = [f"bench-io at {r['commit']} on {r['machine']}, {r['page_bytes']} B pages, default `{r['default_backend']}`; "
           f"top level: exposed load {_f(r.get('exposed_load_fraction'), 3)}, exposed backup "
           f"{_f(r.get('exposed_backup_fraction'), 3)}, bidir ratio {_f(r.get('bidir_ratio'))}", ""]
    if r.get("exposure"):
        out += ["| default, pages | pattern | layers | exposed load | exposed backup |", "|---|---|---|---|---|"]
    for pattern, rows in r.get("exposure", {}).items():
        for n, o in rows.items():
            if "error" in o:
                out.append(f"| {n} | {pattern} | - | failed | {o['error'][:60]} |")
            else:
                out.append(f"| {n} | {pattern} | {o['layers']} | {_f(o['exposed_load_fraction'], 3)} | "
                           f"{_f(o['exposed_backup_fraction'], 3)} |")
    out += ["", "| variant | exposed load | exposed backup | D2H / H2D ratio, 1024 scattered | submit us D2H / H2D (64, 1024, 8192) | bidir GB/s |",
            "|---|---|---|---|---|---|"]
    for name, o in r.get("overlap", {}).items():
        rows = r.get("backends", {}).get(name) or r.get("kernel_sm_sweep", {}).get(name.removeprefix("kernel@"), {})
        row = rows.get("1024", {}) if isinstance(rows, dict) else {}
        submits = " / ".join(
            f"{_f(rows[n]['d2h_submit_us'], 0)}, {_f(rows[n]['h2d_submit_us'], 0)}" for n in ("64", "1024", "8192")
            if isinstance(rows, dict) and n in rows and "d2h_submit_us" in rows[n]
        )
        bidir = r.get("bidir_by_backend", {}).get(name)
        load = "failed" if "error" in o else _f(o.get("exposed_load_fraction"), 3)
        out.append(f"| `{name}` | {load} | {_f(o.get('exposed_backup_fraction'), 3)} | "
                   f"{_f(row.get('d2h_ratio'))} / {_f(row.get('h2d_ratio'))} | {submits or '-'} | {_f(bidir, 1)} |")
    runs = r.get("runs_pattern", {})
    if runs:
        out += ["", f"pages in runs of {runs.get('run_pages')} (allocator-shaped):", "",
                "| variant | pages | D2H ratio | H2D ratio | submit us D2H / H2D |", "|---|---|---|---|---|"]
        for name, rows in runs.items():
            if name == "run_pages" or "error" in rows:
                continue
            for n, row in rows.items():
                if n != "engine":
                    out.append(f"| `{name}` | {n} | {_f(row.get('d2h_ratio'))} | {_f(row.get('h2d_ratio'))} | "
                               f"{_f(row['d2h_submit_us'], 0)} / {_f(row['h2d_submit_us'], 0)} |")
    return "\n".join(out)


def race_table(r: dict[str, Any]) -> str:
    out = [f"SGLang {r['sglang_version']} vs ours at {r['commit']} on {r['machine']}: {r['pages']} pages of "
           f"{r['page_bytes']} B a layer ({r['row_bytes']} B rows), {r['layers']} layers, {r['pattern']}", "",
           "| contestant | D2H ratio | H2D ratio | submit us D2H / H2D (median) | exposed load | exposed backup |",
           "|---|---|---|---|---|---|"]
    for name, o in r.get("contestants", {}).items():
        if "error" in o:
            out.append(f"| `{name}` | failed: {o['error'][:80]} | | | | |")
            continue
        out.append(f"| `{name}` | {_f(o['d2h_ratio'])} | {_f(o['h2d_ratio'])} | {_f(o['d2h_submit_us'], 0)} / "
                   f"{_f(o['h2d_submit_us'], 0)} | {_f(o['exposed_load_fraction'], 3)} | {_f(o['exposed_backup_fraction'], 3)} |")
    for key in ("build_error_register", "build_error_tma"):
        if key in r:
            out.append(f"\n{key}: {str(r[key])[:300]}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    paths = [Path(p) for p in argv] or [Path("bench/results/io-h200.json"), Path("bench/results/io-vs-sglang-h200.json")]
    for path in paths:
        if not path.exists():
            print(f"({path} missing)")
            continue
        r = json.loads(path.read_text())
        print(race_table(r) if "contestants" in r else io_tables(r))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
