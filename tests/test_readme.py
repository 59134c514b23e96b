"""The README proves what it shows: its snippet runs, every command of its bash blocks
runs here or is the engines' example whose flags tests/test_examples.py parses with the
engines' own parsers, its configuration keys are fields, and its performance rows are
the numbers of the files they link."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from test_examples import EXAMPLES, exec_argv

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_readme_protocol_sketch_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python block"
    scope: dict[str, object] = {}
    exec(compile(blocks[0], str(README), "exec"), scope)  # noqa: S102 - our own README
    cache = scope["cache"]
    # The sketch's request went through: its pages are cached and nothing is in flight.
    assert cache.in_flight() == ([], [])  # type: ignore[attr-defined]
    assert cache.metrics.backups_committed == 1  # type: ignore[attr-defined]


def test_readme_sketch_is_the_example_programs_protocol() -> None:
    """The README's sketch and examples/library.py's `serve` make the same calls in the same order."""
    calls = re.compile(r"(?:cache|load)\.(\w+)\(")
    sketch = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    example = (EXAMPLES / "library.py").read_text()
    serve = example[example.index("def serve") : example.index("def main")]
    assert calls.findall(sketch) == calls.findall(serve)


# ---- the bash blocks: every line is proven ------------------------------------------------


def _bash_lines() -> list[str]:
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            if line:
                out.append(line)
    return out


def _hicache_commands() -> list[list[str]]:
    """`hicache-cp ...` invocations in the README's bash blocks, as argv after the program."""
    out = []
    for line in _bash_lines():
        for part in line.split("&&"):
            words = shlex.split(part)
            if words and words[0].endswith("hicache-cp"):
                out.append(words[1:])
    return out


def test_every_bash_line_is_one_this_module_proves() -> None:
    """A command added to the README must be added to a proof here."""
    kinds = []
    for line in _bash_lines():
        words = shlex.split(line.split("&&")[-1])
        if "hicache-cp" in line and ("setup.sh" in line or words[0].endswith("hicache-cp")):
            kinds.append("hicache-cp")
        elif "setup.sh" in line and "pytest" in line or words[:3] == [".venv/bin/python", "-m", "pytest"]:
            kinds.append("pytest")
        elif words[:1] == ["./scripts/setup.sh"]:
            kinds.append("setup")
        elif words[:3] == ["pip", "install", "-e"]:
            kinds.append("pip")
        elif words[0].startswith("HICACHE_CP_CONFIG=") and "sglang.launch_server" in words:
            kinds.append("sglang")
        elif words[:2] == ["vllm", "serve"]:
            kinds.append("vllm")
        elif words[:2] == ["python", "examples/library.py"]:
            kinds.append("library")
        else:
            pytest.fail(f"the README shows a command no test proves: {line}")
    assert {"hicache-cp", "pytest", "pip", "sglang", "vllm", "library"} <= set(kinds), kinds


def test_readme_commands_run_as_written(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """Every `hicache-cp` command in the README's bash blocks exits 0 here."""
    from hicache_harness.cli import main

    commands = _hicache_commands()
    assert ["replay"] in commands, commands
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        assert main(argv) == 0, (argv, capsys.readouterr().err[-2000:])


def test_readme_setup_and_test_commands_name_what_exists() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"])
    markers = {m.split(":")[0] for m in pyproject["tool"]["pytest"]["ini_options"]["markers"]}
    assert (ROOT / "scripts" / "setup.sh").stat().st_mode & 0o111
    for line in _bash_lines():
        words = shlex.split(line.split("&&")[-1])
        if words[:3] == ["pip", "install", "-e"]:
            spec = words[3]
            assert spec.startswith("."), spec
            wanted = set(re.findall(r"\[([\w,-]+)\]", spec)[0].split(",")) if "[" in spec else set()
            assert wanted <= extras, (spec, extras)
        if "pytest" in words:
            rest = words[words.index("pytest") + 1 :]
            for w in rest:
                if w.startswith("tests/"):
                    assert (ROOT / w).is_file(), w
            if "-m" in rest:
                assert rest[rest.index("-m") + 1] in markers


def test_readme_engine_launches_are_the_examples() -> None:
    """The SGLang and vLLM lines are examples/sglang/launch.sh's and examples/vllm/serve.sh's
    commands (whose flags tests/test_examples.py parses with SGLang's and vLLM's parsers)."""
    lines = _bash_lines()
    sglang = shlex.split(next(ln for ln in lines if "sglang.launch_server" in ln))
    env, argv = sglang[0], sglang[1:]
    assert env == "HICACHE_CP_CONFIG=examples/sglang/hicache.toml" and (ROOT / env.split("=", 1)[1]).is_file()
    assert argv == exec_argv(EXAMPLES / "sglang" / "launch.sh")
    vllm = shlex.split(next(ln for ln in lines if ln.startswith("vllm serve")))
    assert vllm == exec_argv(EXAMPLES / "vllm" / "serve.sh")


def test_readme_library_command_runs(capsys) -> None:  # type: ignore[no-untyped-def]
    import runpy

    assert "python examples/library.py" in _bash_lines()[-1] or any(
        ln.startswith("python examples/library.py") for ln in _bash_lines())  # fmt: skip
    runpy.run_path(str(EXAMPLES / "library.py"), run_name="__main__")
    assert "L2 hit (0, 10)" in capsys.readouterr().out


def test_every_hicache_cp_command_the_readme_names_exists() -> None:
    from hicache_harness.cli import COMMANDS

    text = README.read_text()
    named = set(re.findall(r"`(?:\.venv/bin/)?hicache-cp ([a-z][a-z0-9-]+)", text)) | set(re.findall(r"`(bench-[a-z0-9]+)`", text))
    named |= {argv[0] for argv in _hicache_commands()}
    assert named and named <= set(COMMANDS), named - set(COMMANDS)


# ---- configuration -------------------------------------------------------------------------


def _config_table_keys() -> list[str]:
    text = README.read_text()
    table = text[text.index("| key | meaning | default |") :].split("\n\n", 1)[0]
    keys = []
    for row in table.splitlines()[2:]:
        keys += re.findall(r"`\[?(\w+)\]?`", row.split("|")[1])
    return keys


def test_readme_configuration_keys_are_fields() -> None:
    import dataclasses

    from hicache_cp.config import Config

    fields = {f.name for f in dataclasses.fields(Config)}
    keys = _config_table_keys()
    assert len(keys) >= 8 and set(keys) <= fields, set(keys) - fields


def test_readme_defaults_are_the_codes() -> None:
    from hicache_cp.config import Config

    c = Config()
    assert c.host_budget_bytes == 64 << 20 and c.l2_free_room == c.l1_free_room == 0.02
    assert c.eviction_policy == "lru" and c.write_policy.value == "write_through" and c.io_backend == "auto"
    assert c.cp_size == 1 and not c.l3.enabled and c.pd_timeout_s == 300 and c.pd_per_layer is False
    assert c.debug_checks is False


def test_readme_l3_enabled_means_the_mooncake_backend(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The README's `[l3] enabled = true` is accepted and turns the tier on."""
    from hicache_cp.config import Config

    assert "`[l3] enabled = true`" in README.read_text()
    toml = tmp_path / "c.toml"
    toml.write_text("[l3]\nenabled = true\n")
    resolved = Config.resolve(toml, env={})
    assert resolved.config.l3.enabled and resolved.config.l3.backend == "mooncake"


def _field_values() -> dict[str, tuple[str, object]]:
    """A non-default value of every scalar top-level field: (as a string, typed)."""
    return {
        "page_size": ("32", 32), "host_reserve_bytes": ("1024", 1024), "l1_pages": ("100", 100),
        "l1_free_room": ("0.1", 0.1), "l2_free_room": ("3", 3), "write_policy": ("write_back", "write_back"),
        "write_threshold": ("3", 3), "eviction_policy": ("reuse_lru", "reuse_lru"), "cp_size": ("2", 2),
        "debug_checks": ("true", True), "host_budget_bytes": ("100000000", 100000000), "io_backend": ("cpu", "cpu"),
    }  # fmt: skip


@pytest.mark.parametrize("source", ["toml", "env", "set"])
@pytest.mark.parametrize("name", sorted(_field_values()))
def test_readme_every_field_from_every_source(name: str, source: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """"from defaults, a TOML file, `HICACHE_<FIELD>` environment variables, then the command
    line (`--set FIELD=VALUE`)": each field takes effect from each source, and the source is
    recorded."""
    from hicache_cp.config import Config

    raw, typed = _field_values()[name]
    path, env, overrides = None, {}, {}
    if source == "toml":
        path = tmp_path / "c.toml"
        path.write_text(f"{name} = {json.dumps(typed)}\n")
    elif source == "env":
        env = {f"HICACHE_{name.upper()}": raw}
    else:
        overrides = {name: raw}
    resolved = Config.resolve(path, env=env, overrides=overrides)
    got = resolved.config.to_dict()[name]
    assert got == typed, (name, source, got)
    assert resolved.sources[name] == {"toml": f"toml:{path}", "env": f"env:HICACHE_{name.upper()}", "set": "cli"}[source]


@pytest.mark.parametrize("source", ["toml", "env", "set"])
def test_readme_l3_fields_from_every_source(source: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hicache_cp.config import Config

    path, env, overrides = None, {}, {}
    if source == "toml":
        path = tmp_path / "c.toml"
        path.write_text("[l3]\npages_per_object = 8\nprefetch_wait = false\nnamespace = \"x\"\n")
    elif source == "env":
        env = {"HICACHE_L3_PAGES_PER_OBJECT": "8", "HICACHE_L3_PREFETCH_WAIT": "false", "HICACHE_L3_NAMESPACE": "x"}
    else:
        overrides = {"l3.pages_per_object": "8", "l3.prefetch_wait": "false", "l3.namespace": "x"}
    resolved = Config.resolve(path, env=env, overrides=overrides)
    l3 = resolved.config.l3
    assert (l3.pages_per_object, l3.prefetch_wait, l3.namespace) == (8, False, "x")
    report = resolved.report()["l3"]
    assert report["value"]["pages_per_object"] == 8
    assert report["sources"]["pages_per_object"] != "default" and report["sources"]["master"] == "default"


# ---- performance at a glance ---------------------------------------------------------------


def _perf_rows() -> dict[str, str]:
    """file name -> its row of the performance table."""
    text = README.read_text()
    table = text[text.index("| what | result | page | file |") :].split("\n\n", 1)[0]
    rows = {}
    for row in table.splitlines()[2:]:
        (target,) = re.findall(r"\[json\]\(bench/results/([\w.\-]+)\)", row)
        rows[target] = row
    return rows


def test_readme_performance_rows_are_their_files_numbers() -> None:
    rows = _perf_rows()
    assert 1 <= len(rows) <= 5
    data = {name: json.loads((ROOT / "bench" / "results" / name).read_text()) for name in rows}
    for name, row in rows.items():
        assert re.search(r"\]\(docs/bench/[\w-]+\.md\)", row), row
        d = data[name]
        if "integrity_checked_units" in d and "ttft_p50_s" not in d:  # the replay
            assert f"{d['hit_rate']:.2f}" in row and f"{d['integrity_checked_units']:,}" in row
            assert f"{d['integrity_mismatches']} byte mismatches" in row and f"{d['wall_s']:.1f} s" in row
        elif "exposed_load_fraction" in d:  # bench-io
            assert f"{d['exposed_load_fraction']:.3f} of a load" in row and f"{d['exposed_backup_fraction']:.3f} of a backup" in row
            n = d["default_numbers"]["1024"]
            assert f"{n['d2h_ratio']:.2f} / {n['h2d_ratio']:.2f} of PCIe" in row
        elif "layer_hook_us_p50" in d:  # bench-overhead
            assert f"{d['layer_hook_us_p50']:.1f} / {d['layer_hook_us_p99']:.1f} us" in row
        elif "ttft_l2_over_l1_hit" in d:  # serve
            assert f"{d['ttft_l2_over_l1_hit']:.3f}" in row
            assert f"{d['ttft_p50_s']:.2f} s against {d['no_l2']['ttft_p50_s']:.2f} s" in row
        elif "sizes" in d:  # bench-pinning
            size = next(s for s in d["sizes"] if s["gib"] == 64.0)
            assert f"about {round(size['default_ready_s'])} s" in row, size["default_ready_s"]
            assert f"{size['cuda_host_alloc']['alloc_s']:.1f} s for `cudaHostAlloc`" in row
        else:
            pytest.fail(f"no check for the row of {name}")


def _engine_section() -> str:
    text = README.read_text()
    start = text.index("## Against the engines' own host tiers")
    return text[start : text.index("\n## ", start + 3)]


def _row(section: str, label: str) -> list[str]:
    line = next(ln for ln in section.splitlines() if ln.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")[1:]]


#: The device runs the README's engine tables quote (its pages name them; the README names no commit).
#: The engine run, the race's runs (one per workload) and the vLLM run the README quotes.
ENGINE_RESULTS = ("sglang-engine-llama-run3-h200-ad4cab5.json", ("sglang-race-h100-f4d083a.json", "sglang-race-h100-97f0990.json"),
                  "vllm-race-h200-ad4cab5.json")  # fmt: skip


def test_readme_engine_tables_are_their_files_numbers() -> None:
    """The three-way tables quote the device runs' JSON (numbers rounded as shown)."""
    section = _engine_section()
    files = ENGINE_RESULTS
    for page, name in (("sglang", files[0]), *(("sglang", race) for race in files[1]), ("vllm", files[2])):
        assert f"docs/bench/{page}.md" in section and name in (ROOT / "docs" / "bench" / f"{page}.md").read_text()
    sg = json.loads((ROOT / "bench" / "results" / files[0]).read_text())["modes"]
    cols = [sg["hicache-cp"], sg["sglang-hicache"], sg["none"]]
    assert _row(section, "TTFT p50 / p90, ms") == [f"{m['ttft_p50_ms']:.1f} / {m['ttft_p90_ms']:.1f}" for m in cols]
    assert _row(section, "requests with half their prompt from host: TTFT p50, ms")[:2] == [
        f"{m['half_from_host_ttft_p50_ms']:.1f}" for m in cols[:2]]  # fmt: skip
    assert _row(section, "prompt tokens from host / computed") == [
        f"{m['host_tokens']:,} / {m['computed_tokens']:,}" for m in cols]  # fmt: skip
    assert all(m["greedy_identical_to_none"] for m in cols)
    checked = cols[0]["restore_checks"]
    assert _row(section, "restored pages checksummed / failed")[0] == (
        f"{sum(checked['checked_pages'].values()):,} / "
        f"{sum(n for parts in checked['failures'].values() for n in parts.values()):,}")  # {tier: {part: n}}

    race = {wl: rows for name in files[1]
            for wl, rows in json.loads((ROOT / "bench" / "results" / name).read_text())["workloads"].items()}
    assert sorted(race) == ["embedded", "trace"]
    mla = {(r["backend"], wl): r["tree_cache_ms_per_request"] for wl, rows in race.items() for r in rows
           if r["pools"] == "mla" and "tree_cache_ms_per_request" in r}  # fmt: skip
    ours = sorted(v for (b, _), v in mla.items() if b == "hicache-cp")
    theirs = sorted(v for (b, _), v in mla.items() if b == "sglang-hicache")
    assert f"{ours[0]:.1f}-{ours[-1]:.1f} ms" in section and f"{theirs[0]:.1f}-{theirs[-1]:.1f} ms" in section
    assert all(r.get("mismatched_bytes", 0) == 0 for rows in race.values() for r in rows)

    vl = json.loads((ROOT / "bench" / "results" / files[2]).read_text())
    runs = [vl["runs"][k] for k in ("hicache", "offloading", "none")]
    ttft = _row(section, "TTFT p50 / p90 of host hits, ms")
    for cell, r in zip(ttft, runs, strict=True):
        t = r["ttft_ms"]["pass2"]
        assert cell.startswith(f"{t['p50']:.1f} / {t['p90']:.1f}"), (cell, t)
    assert _row(section, "prompt tokens from host") == [f"{r['host_tokens']:,}" for r in runs]
    assert _row(section, "batch throughput, tokens/s") == [f"{r['batch']['tokens_per_s']:,.0f}" for r in runs]
    worker = [r["connector_host_time_per_step"]["worker"]["mean_ms"] for r in runs[:2]]
    assert _row(section, "worker host time per step, mean ms")[:2] == [f"{w:.2f}" for w in worker]
    whole = [r["connector_host_time_per_step"]["worker"] for r in runs[:2]]
    assert _row(section, "worker host time, whole run, ms (steps)")[:2] == [
        f"{w['total_ms']:.1f} ({w['steps']})" for w in whole]  # fmt: skip
    checks = runs[0]["restore_checks"]
    assert _row(section, "restored units checksummed / failed")[0] == (
        f"{sum(checks['checked_units'].values()):,} / {sum(checks['failed_units'].values()):,}")  # failed: {"tier/part": n}
    assert all(vl["identity"][k]["identical"] for k in ("hicache", "offloading"))
