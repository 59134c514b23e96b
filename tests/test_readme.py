"""The README's protocol sketch is runnable code: keep it true."""

from __future__ import annotations

import re

import pytest

from conftest import mooncake_store_available
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_protocol_sketch_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python block"
    scope: dict[str, object] = {}
    exec(compile(blocks[0], str(README), "exec"), scope)  # noqa: S102 - our own README
    cache = scope["cache"]
    # The sketch's request went through: its pages are cached and nothing is in flight.
    assert cache.in_flight() == ([], [])  # type: ignore[attr-defined]
    assert cache.metrics.backups_committed == 1  # type: ignore[attr-defined]


# ---- the README's commands and configuration sentences (issue 29, class 4) -----------------


def _bash_commands() -> list[list[str]]:
    """`hicache-cp ...` invocations in the README's bash blocks, as argv after the program."""
    import shlex

    out = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0]
            if "hicache-cp" not in line:
                continue
            for part in line.split("&&"):
                words = shlex.split(part)
                if words and words[0].endswith("hicache-cp"):
                    out.append(words[1:])
    return out


def test_readme_commands_run_as_written(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """Every `hicache-cp` command in the README's bash blocks exits 0 here."""
    from hicache_cp.harness.cli import main

    commands = _bash_commands()
    assert ["replay"] in commands, commands
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        assert main(argv) == 0, (argv, capsys.readouterr().err[-2000:])


def test_readme_l3_enabled_means_the_mooncake_backend(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The README's `[l3] enabled = true` is accepted and turns the tier on."""
    from hicache_cp.config import Config

    assert "[l3] enabled = true" in README.read_text()
    toml = tmp_path / "c.toml"
    toml.write_text("[l3]\nenabled = true\n")
    resolved = Config.resolve(toml, env={})
    assert resolved.config.l3.enabled and resolved.config.l3.backend == "mooncake"
    assert resolved.sources["l3.backend"] == f"toml:{toml}"


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
    """"`HICACHE_<FIELD>` environment variables, then the command line (`--set
    FIELD=VALUE` for any field)": each field takes effect from each source, and
    the source is recorded."""
    import json

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




@pytest.mark.slow
@pytest.mark.skipif(not mooncake_store_available(), reason="mooncake (store and master) not installed")
@pytest.mark.parametrize("how", ["flag", "toml", "set", "env"])
def test_report_config_l3_is_what_ran(how: str, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """"the replay's JSON records each effective value with its source": with L3
    on (by --l3 or by the README's `[l3] enabled = true`), `config.l3` is the
    tier that ran, not the defaults."""
    import argparse

    from hicache_cp.harness.replay import command

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
    """README, L3: "`prefetch_wait = false` ... the engine prefetches a request
    while it is queued, and what landed by its turn is an L3 hit". Two
    instances share the store and L2 is small, so later requests find pages
    in L3; before issue 29 this mode reported 0 L3 hits (every fetched page
    was surplus: the request had computed it already)."""
    import argparse

    from hicache_cp.harness.replay import command

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
