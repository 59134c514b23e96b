#!/usr/bin/env python
"""bench/results/INDEX.md: every result file, its bench, provenance, headline and citations.

    python tools/results_index.py            # rewrite bench/results/INDEX.md
    python tools/results_index.py --check    # exit 1 when it is out of date or incomplete

The hand-kept facts are in bench/results_index.json (`entries`: a path under
bench/results, a file or a folder ending in "/", -> its `bench`, and where the
file cannot say it itself a `headline`, `superseded_by`, `note` or
`provenance`). Everything else is read from the files: commit, machine and
command from a JSON's top level or a log's first line ("# commit C; machine M;
command: X"), else from the JSON of the same name; headlines of replay, io,
overhead and host-floor JSONs from their numbers; and who cites each file, by
scanning the README, docs/, examples/, the code and the tests for its name.
tests/test_results_index.py runs `problems()` and `--check`.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hicache_harness.provenance import log_header  # noqa: E402

RESULTS = ROOT / "bench" / "results"
INDEX_JSON = ROOT / "bench" / "results_index.json"  # beside the results, not one of them
INDEX_MD = RESULTS / "INDEX.md"
OWN = {"INDEX.md"}
#: Where citations are looked for (relative to the repository root).
CITING = ("README.md", "docs", "examples", "hicache_cp", "hicache_harness", "hostmem", "bench/scripts", "bench/experiments",
          "bench/engines", "bench/device", "tools", "tests")  # fmt: skip


@dataclass
class Entry:
    path: str  # under bench/results; a folder ends in "/"
    bench: str
    commit: str | None
    machine: str | None
    command: str | None
    headline: str | None
    archived: bool
    superseded_by: str | None
    note: str | None
    cited_by: list[str]


def result_files() -> list[str]:
    """Every file under bench/results except the index's own, as paths relative to it."""
    return sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file() and p.name not in OWN)


def load_index() -> dict[str, dict[str, Any]]:
    return json.loads(INDEX_JSON.read_text())["entries"]


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def provenance(path: str, given: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    """(commit, machine, command) of a result: its own record, its log header, its JSON, or the index's."""
    full = RESULTS / path
    if "provenance" in given:
        p = given["provenance"]
        return p.get("commit"), p.get("machine"), p.get("command")
    if full.suffix == ".json" and (data := _json(full)) is not None:
        machine = data.get("machine")
        if data.get("gpu") and machine and str(data["gpu"]) not in str(machine):
            machine = f"{data['gpu']}; {machine}"
        return data.get("commit"), machine, data.get("command")
    if full.is_file():
        for line in full.read_text(errors="replace").splitlines()[:3]:
            if (header := log_header(line)) is not None:
                return header
        companion = full.with_suffix(".json")
        if companion.is_file() and (data := _json(companion)) is not None:
            return data.get("commit"), data.get("machine"), data.get("command")
    return None, None, None


def _f(x: Any, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else "?"


def derived_headline(path: str) -> str | None:
    """A headline from the numbers of a known kind of result, or None."""
    full = RESULTS / path
    name = full.name
    if full.suffix in (".log", ".txt") and full.with_suffix(".json").is_file():
        return f"the run's log (see {full.with_suffix('.json').name})"
    if full.suffix == ".log" and "gpu-tests" in name:
        summary = [ln for ln in full.read_text(errors="replace").splitlines() if re.search(r"\d+ (passed|failed)", ln)]
        return f"GPU tests: {summary[-1].strip(' =')}" if summary else None
    data = _json(full) if full.suffix == ".json" else None
    if data is None:
        return None
    if "ratio_per_layer_over_after_insert" in data:
        ready = data.get("ready_s_median") or {}
        return (f"forward's end to decode holding all KV at {data.get('layer_ms')} ms layers: per layer "
                f"{_f(ready.get('per_layer'), 4)} s, after insert {_f(ready.get('after_insert'), 4)} s "
                f"(ratio {_f(data['ratio_per_layer_over_after_insert'])})")
    if "integrity_mismatches" in data and "hit_rate" in data:
        units = data.get("integrity_checked_units")
        return (f"{data.get('requests')} requests, hit rate {_f(data['hit_rate'], 4)}, "
                f"{data['integrity_mismatches']} byte mismatches in {units} units, {_f(data.get('wall_s'), 1)} s")
    if "exposed_load_fraction" in data and "bidir_ratio" in data:
        return (f"beside a forward: {_f(data['exposed_load_fraction'])} of a load and "
                f"{_f(data['exposed_backup_fraction'])} of a backup exposed (1,024 scattered pages); "
                f"both ways {_f(data['bidir_ratio'], 2)} of the bidirectional peak")
    if "layer_hook_us_p50" in data:
        variant = (data.get("io_backend") or {}).get("variant") or "default"
        return (f"{variant}: layer hook {_f(data['layer_hook_us_p50'], 1)} / {_f(data['layer_hook_us_p99'], 1)} us "
                f"p50 / p99, load_back p99 {_f(data.get('load_back_us_p99'), 0)} us, match p50 "
                f"{_f(data.get('match_us_p50'), 1)} us")
    if name.startswith("host-floor") and "median" in data:
        hook, load = data["median"].get("layer_hook") or {}, data["median"].get("load_back") or {}
        if "cpu_p50" in hook:
            return (f"Python floor (thread CPU time): layer hook {_f(hook['cpu_p50'], 1)} / {_f(hook.get('cpu_p99'), 1)} "
                    f"us p50 / p99, load_back p99 {_f(load.get('cpu_p99'), 0)} us")
    return None


def _corpus() -> dict[str, str]:
    """The text of every file that may cite a result, by path relative to the root."""
    out = {}
    for top in CITING:
        base = ROOT / top
        files = [base] if base.is_file() else sorted(base.rglob("*")) if base.is_dir() else []
        for f in files:
            if f.is_file() and f.suffix in (".md", ".py", ".sh", ".toml") and "__pycache__" not in f.parts \
                    and f.resolve() != Path(__file__).resolve():
                out[str(f.relative_to(ROOT))] = f.read_text(errors="replace")
    return out


def citations(path: str, corpus: dict[str, str] | None = None) -> list[str]:
    """Files of the repository (outside bench/results) that name this result."""
    name = path.rstrip("/").split("/")[-1]
    pattern = re.compile(r"(?<![\w.\-])" + re.escape(name) + r"(?![\w\-]|\.\w)")
    corpus = corpus if corpus is not None else _corpus()
    return [f for f, text in corpus.items() if name in text and pattern.search(text)]


def entries() -> list[Entry]:
    out = []
    corpus = _corpus()
    for path, given in load_index().items():
        commit, machine, command = provenance(path, given)
        out.append(Entry(path, given["bench"], commit, machine, command, given.get("headline") or derived_headline(path),
                         path.startswith("archive/"), given.get("superseded_by"), given.get("note"), citations(path, corpus)))
    return out


def covered(files: list[str], index: dict[str, Any]) -> dict[str, str | None]:
    """file -> the index entry that covers it (itself, or a folder entry above it), or None."""
    folders = [p for p in index if p.endswith("/")]
    return {f: f if f in index else next((d for d in folders if f.startswith(d)), None) for f in files}


def problems() -> list[str]:
    """What keeps the index from being complete and true (empty when it is)."""
    index = load_index()
    files = result_files()
    out = [f"{f}: no entry in bench/results_index.json" for f, e in covered(files, index).items() if e is None]
    for path in index:
        if not (RESULTS / path).exists():
            out.append(f"{path}: in results_index.json but not in bench/results")
    for f in files:
        if f.endswith(".json"):
            data = _json(RESULTS / f)
            missing = [k for k in ("commit", "machine", "command") if data is None or not data.get(k)]
            if missing:
                out.append(f"{f}: the JSON lacks {', '.join(missing)}")
    for e in entries():
        if not (e.commit and e.machine and e.command):
            out.append(f"{e.path}: no commit, machine or command (a JSON, a log header, or 'provenance' in results_index.json)")
        if not e.headline:
            out.append(f"{e.path}: no headline (give one in results_index.json)")
        if e.superseded_by and not (RESULTS / e.superseded_by).exists():
            out.append(f"{e.path}: superseded_by {e.superseded_by} does not exist")
        if e.archived != e.path.startswith("archive/"):
            out.append(f"{e.path}: archived files live under archive/")
    return out


def _short_machine(machine: str | None) -> str:
    if not machine:
        return "?"
    gpu = re.search(r"NVIDIA [A-Z]\d{2,3}\w*", machine)
    cpus = re.search(r"(\d+) cpus", machine)
    cpu = "AMD EPYC" if "EPYC" in machine else "Intel Xeon" if "Xeon" in machine else ""
    parts = [gpu.group(0) if gpu else None, cpu or None, f"{cpus.group(1)} cpus" if cpus else None]
    return ", ".join(p for p in parts if p) or machine[:40]


def _cell(text: str | None) -> str:
    return (text or "?").replace("|", "\\|").replace("\n", " ")


def render() -> str:
    rows = sorted(entries(), key=lambda e: (e.archived, e.bench, e.path))
    lines = [
        "# Benchmark results",
        "",
        "Generated by `tools/results_index.py` from the files and `bench/results_index.json`; "
        "`tests/test_results_index.py` keeps it complete. Every JSON records the commit, machine and "
        "command it ran with; a log starts with the same line. Results of earlier code that a later run "
        "replaced are under `archive/`, kept whole: the design notes cite them. Benchmark pages: `docs/bench/`.",
    ]
    for archived, title in ((False, "Current"), (True, "Archive (superseded rounds)")):
        lines += ["", f"## {title}", "", "| file | bench | commit | machine | command | headline | cited by |",
                  "|---|---|---|---|---|---|---|"]
        for e in (r for r in rows if r.archived == archived):
            headline = e.headline or "?"
            if e.superseded_by:
                headline += f" (superseded by `{e.superseded_by}`)"
            if e.note:
                headline += f"; {e.note}"
            cited = ", ".join(f"`{c}`" for c in e.cited_by) or "-"
            lines.append(f"| [`{e.path}`]({e.path}) | {e.bench} | {_cell(e.commit)} | {_cell(_short_machine(e.machine))} "
                         f"| `{_cell(e.command)}` | {_cell(headline)} | {cited} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if "--check" in argv:
        issues = problems()
        if not INDEX_MD.exists() or INDEX_MD.read_text() != render():
            issues.append("bench/results/INDEX.md is out of date: run python tools/results_index.py")
        for issue in issues:
            print(issue, file=sys.stderr)
        return 1 if issues else 0
    INDEX_MD.write_text(render())
    issues = problems()
    for issue in issues:
        print(issue, file=sys.stderr)
    return 1 if issues else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
