"""The documentation stays true: every file it cites exists, the configuration page
is generated from the code, its snippets run, and library docstrings carry contracts,
not commit hashes."""

from __future__ import annotations

import io
import shlex
import re
import sys
import tokenize
from pathlib import Path

import pytest

from conftest import mooncake_store_available

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PAGES = [ROOT / "README.md", *DOCS, ROOT / "bench" / "results" / "INDEX.md"]
#: Pages other work is writing (the README and the docs index link them already).
PENDING = {"docs/integrations/sglang.md", "docs/integrations/vllm.md", "docs/integrity.md", "docs/node-tier.md",
           "docs/events.md"}  # fmt: skip
#: Folders whose paths the docs cite in backticks, relative to the repository root.
TOP = ("hostmem/", "hicache_cp/", "hicache_harness/", "tests/", "bench/", "tools/", "scripts/", "examples/", "docs/")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def cited(page: Path) -> list[tuple[str, Path]]:
    """(as written, resolved path) of every local file the page cites: markdown links
    (relative to the page) and backticked repository paths (relative to the root)."""
    text = page.read_text()
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|#|mailto:", target):
            continue
        out.append((target, (page.parent / target.split("#", 1)[0]).resolve()))
    if page.name == "INDEX.md":  # its backticks are the commands as they ran, not citations
        return out
    for path in re.findall(r"`([\w./\-]+)`", text):
        if path.startswith(TOP) and not re.search(r"[<>*{}]|\.\.\.", path):
            out.append((path, (ROOT / path).resolve()))
    return out


def code_citations() -> list[tuple[str, str]]:
    """(file, docs page) for every docs/*.md the code, scripts and tests name."""
    out = []
    for top in ("hicache_cp", "hicache_harness", "hostmem", "bench", "tools", "tests", "scripts", "examples"):
        for f in (ROOT / top).rglob("*"):
            if f.suffix in (".py", ".sh", ".toml") and "results" not in f.parts:
                out += [(_rel(f), m) for m in re.findall(r"docs/[\w./\-]+\.md", f.read_text())]
    return out


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_file_a_page_cites_exists(page: Path) -> None:
    missing = [written for written, path in cited(page) if not path.exists() and _rel_or(path) not in PENDING]
    assert not missing, f"{_rel(page)} cites files that do not exist: {missing}"


def _rel_or(path: Path) -> str:
    try:
        return _rel(path)
    except ValueError:
        return str(path)


def test_the_citation_check_sees_links_and_backticked_paths(tmp_path: Path) -> None:
    page = ROOT / "docs" / "x.md"
    text = "see [a](invariants.md), [b](../bench/results/nope.json#x), `hicache_cp/nope.py`, `bench/device/*.sh`"
    found = {w for w, _ in cited_text(page, text)}
    assert found == {"invariants.md", "../bench/results/nope.json#x", "hicache_cp/nope.py"}


def cited_text(page: Path, text: str) -> list[tuple[str, Path]]:
    real = Path.read_text
    try:
        Path.read_text = lambda self, *a, **k: text if self == page else real(self, *a, **k)  # type: ignore[method-assign]
        return cited(page)
    finally:
        Path.read_text = real  # type: ignore[method-assign]


def test_every_docs_page_the_code_names_exists() -> None:
    missing = [(f, d) for f, d in code_citations() if not (ROOT / d).exists() and d not in PENDING]
    assert not missing, missing


def test_the_code_cites_the_rules_in_the_repository() -> None:
    """The rules the code cites by number live in docs/invariants.md (twelve of them),
    not in documents outside the repository."""
    rules = re.findall(r"^(\d+)\. \*\*", (ROOT / "docs" / "invariants.md").read_text(), re.M)
    assert [int(r) for r in rules] == list(range(1, 13))
    outside = []
    for top in ("hicache_cp", "hicache_harness", "hostmem", "bench", "tools", "tests", "scripts"):
        for f in (ROOT / top).rglob("*"):
            if f.suffix in (".py", ".sh") and "results" not in f.parts and f.name != "test_docs.py":
                text = f.read_text()
                outside += [_rel(f) for name in ("DOMAIN.md", "DESIGN.md", "STYLE.md", "PLATFORM.md", "../shared")
                            if re.search(r"(?<![/\w])" + re.escape(name), text)]  # fmt: skip
    assert not outside, outside


# ---- no commit hashes in the library ---------------------------------------------------------

#: 7-40 hex digits with a letter and a digit among them, or a 7-digit number after "at"/"commit".
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b|\b(?:at|commit|since|before|after)\s+\d{7}\b")


def hashes_in(source: str) -> list[str]:
    """Commit-hash-like tokens in the comments and strings (docstrings) of a module."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            found += [f"line {tok.start[0]}: {m.group(0)}" for m in HASH.finditer(tok.string)]
    return found


def test_the_hash_finder_finds_hashes_and_nothing_else() -> None:
    src = '"""Measured at 3524bee (io-h200-160acc4.json), at 4518922."""\nx = 0x2  # 8589934592 bytes, deadbeef, facade\n'
    assert [h.split(": ")[1] for h in hashes_in(src)] == ["3524bee", "160acc4", "at 4518922"]


def test_no_library_module_holds_a_commit_hash() -> None:
    """Library docstrings and comments state contracts; run history and its commits go to
    docs/design/ and bench/results/ (the harness, `hicache_harness`, may name the runs it writes)."""
    bad = {}
    for top in ("hicache_cp", "hostmem"):
        for f in sorted((ROOT / top).rglob("*.py")):
            if found := hashes_in(f.read_text()):
                bad[_rel(f)] = found
    assert not bad, bad


def test_the_readme_names_no_commit_and_no_issue() -> None:
    text = (ROOT / "README.md").read_text()
    assert not HASH.findall(text)
    assert not re.findall(r"(?i)\bissues? \d+|\(#\d+\)|\bgh-\d+", text)


# ---- the configuration page ------------------------------------------------------------------


def _config_doc():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import config_doc
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return config_doc


def test_the_configuration_page_is_the_code() -> None:
    """docs/configuration.md's field tables are what tools/config_doc.py renders from
    `Config` and `L3Config` now: a field added, renamed or given another default fails
    here until the page is regenerated."""
    doc = _config_doc()
    text = doc.PAGE.read_text()
    assert doc.updated(text) == text, "run: python tools/config_doc.py"
    for name in ("host_budget_bytes", "io_backend", "pages_per_object", "prefetch_wait"):
        assert f"| `{name}` |" in text


def test_the_configuration_page_would_see_a_new_default(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    from hicache_cp.config import Config

    doc = _config_doc()
    before = doc.render()
    fields = {f.name: f for f in dataclasses.fields(Config)}
    monkeypatch.setattr(fields["page_size"], "default", 32)
    assert doc.render() != before


def test_every_flag_the_configuration_page_names_is_a_replay_flag() -> None:
    import argparse

    from hicache_harness.replay import command

    p = argparse.ArgumentParser()
    command.add_arguments(p)
    known = {s for a in p._actions for s in a.option_strings}
    named = {flag for _, flags in _config_doc().MEANING.values() for flag in flags}
    assert named and named <= known, named - known


# ---- snippets ---------------------------------------------------------------------------------


def _blocks(page: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", page.read_text(), re.S)


@pytest.mark.parametrize("page", [p for p in DOCS if _blocks(p, "toml")], ids=_rel)
def test_every_toml_block_of_the_docs_is_a_valid_configuration(page: Path, tmp_path: Path) -> None:
    from hicache_cp.config import Config

    for i, block in enumerate(_blocks(page, "toml")):
        path = tmp_path / f"{i}.toml"
        path.write_text(block)
        Config.resolve(path, env={})


@pytest.mark.parametrize("page", [p for p in DOCS if _blocks(p, "python")], ids=_rel)
def test_every_python_block_of_the_docs_runs(page: Path) -> None:
    """Every python block runs, except a sketch, which says so on its first line."""
    for block in _blocks(page, "python"):
        if block.startswith("# sketch"):
            continue
        scope: dict[str, object] = {}
        exec(compile(block, str(page), "exec"), scope)  # noqa: S102 - our own docs


# ---- claims of docs/integrations/l3.md (moved with the L3 section from the README) ----------


def test_l3_enabled_means_the_mooncake_backend(tmp_path: Path) -> None:
    """`[l3] enabled = true` (docs/integrations/l3.md, the README) turns the tier on."""
    from hicache_cp.config import Config

    assert "enabled = true" in (ROOT / "docs" / "integrations" / "l3.md").read_text()
    toml = tmp_path / "c.toml"
    toml.write_text("[l3]\nenabled = true\n")
    resolved = Config.resolve(toml, env={})
    assert resolved.config.l3.enabled and resolved.config.l3.backend == "mooncake"
    assert resolved.sources["l3.backend"] == f"toml:{toml}"


@pytest.mark.slow
@pytest.mark.skipif(not mooncake_store_available(), reason="mooncake (store and master) not installed")
@pytest.mark.parametrize("how", ["flag", "toml", "set", "env"])
def test_report_config_l3_is_what_ran(how: str, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """"the replay's JSON records each effective value with its source" (docs/configuration.md):
    with L3 on (by --l3 or by `[l3] enabled = true`), `config.l3` is the tier that ran, not the
    defaults."""
    import argparse

    from hicache_harness.replay import command

    p = argparse.ArgumentParser()
    command.add_arguments(p)
    if how == "flag":
        args = p.parse_args(["--limit", "20", "--device", "cpu", "--l3", "mooncake", "--l3-pages-per-object", "2"])
    elif how == "set":
        args = p.parse_args(["--limit", "20", "--device", "cpu", "--l3", "mooncake", "--set", "l3.pages_per_object=2"])
    elif how == "env":
        monkeypatch.setenv("HICACHE_L3_PAGES_PER_OBJECT", "2")
        args = p.parse_args(["--limit", "20", "--device", "cpu", "--l3", "mooncake"])
    else:
        toml = tmp_path / "c.toml"
        toml.write_text("[l3]\nenabled = true\npages_per_object = 2\n")
        args = p.parse_args(["--limit", "20", "--device", "cpu", "--config", str(toml)])
    report = command.replay(args)
    l3 = report["config"]["l3"]
    assert report["l3"] == "mooncake"
    assert l3["value"]["backend"] == "mooncake" and l3["value"]["pages_per_object"] == 2
    assert l3["value"]["master"] != "127.0.0.1:50051"  # the master started for the run, not the default
    want = {"flag": "cli:--l3-pages-per-object", "toml": f"toml:{tmp_path / 'c.toml'}", "set": "cli",
            "env": "env:HICACHE_L3_PAGES_PER_OBJECT"}[how]
    assert l3["sources"]["pages_per_object"] == want
    assert l3["sources"]["master"].startswith("derived:")


@pytest.mark.slow
@pytest.mark.skipif(not mooncake_store_available(), reason="mooncake (store and master) not installed")
def test_prefetch_wait_false_serves_queued_requests_from_l3() -> None:
    """docs/integrations/l3.md: "With `prefetch_wait = false` nothing ever waits: ... when the
    request is scheduled its match finds what committed by then". Two instances share the
    store and L2 is small, so later requests find pages in L3."""
    import argparse

    from hicache_harness.replay import command

    p = argparse.ArgumentParser()
    command.add_arguments(p)
    args = p.parse_args(["--limit", "300", "--device", "cpu", "--l3", "mooncake", "--instances", "2",
                         "--l2-fraction", "0.05", "--set", "l3.prefetch_wait=false"])  # fmt: skip
    report = command.replay(args)
    assert report["config"]["l3"]["value"]["prefetch_wait"] is False
    assert report["l3_hit_tokens"] > 0 and report["l3_hit_pages"] > 0
    assert report["integrity_mismatches"] == 0
    assert report["integrity_checked_units"] == report["integrity_expected_units"] > 0
    # the report's hit rate counts the L3 hits, from the same counters the instances report
    hits = report["l1_hit_tokens"] + report["l2_hit_tokens"] + report["l3_hit_tokens"]
    assert report["hit_rate"] == pytest.approx(hits / report["prompt_tokens"])
    assert report["l3_hit_tokens"] == sum(r["l3_hit_tokens"] for r in report["per_instance"])


# ---- the docs' commands --------------------------------------------------------------------


def docs_commands() -> list[tuple[str, list[str], list[str]]]:
    """(page, argv after the program, optional flags shown in brackets) of every `hicache-cp`
    line in the docs' bash blocks (lines with an ellipsis are sketches and skipped)."""
    out = []
    for page in DOCS:
        for block in _blocks(page, "bash"):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #", 1)[0]
                if "..." in line or not line.split() or not line.split()[0].endswith("hicache-cp"):
                    continue
                optional = re.findall(r"\[(--[\w-]+)", line)
                words = shlex.split(re.sub(r"\[[^\]]*\]", "", line))
                if words and words[0].endswith("hicache-cp"):
                    out.append((_rel(page), words[1:], optional))
    return out


def test_every_hicache_cp_command_of_the_docs_parses() -> None:
    """The docs' `hicache-cp` commands are valid command lines, and every optional flag they
    show in brackets is one of the command's (running them needs GPUs, traces or minutes;
    the README's run in tests/test_readme.py)."""
    import argparse

    from hicache_harness.cli import build_parser

    commands = docs_commands()
    assert len(commands) >= 10
    bad = []
    for page, argv, optional in commands:
        parser = build_parser(argv)
        try:
            parser.parse_args(argv)
        except SystemExit:
            bad.append((page, argv))
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[argv[0]]
        known = {s for a in sub._actions for s in a.option_strings}
        bad += [(page, flag) for flag in optional if flag not in known]
    assert not bad, bad
