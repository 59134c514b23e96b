"""Every config field honours defaults < TOML < HICACHE_* < command line,
in the library (`Config.resolve`) and in `hicache-cp replay`, and the replay's
JSON report records each effective value with its source."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from hicache_cp.config import Config
from hicache_harness.cli import main
from hicache_harness.replay import command
from hicache_harness.replay.setup import build_config, load_requests

# field: (TOML literal, env string, --set string, the three effective values)
FIELDS: dict[str, tuple[str, str, str, tuple[Any, Any, Any]]] = {
    "model": ('"deepseek-v3.2"', "tiny", "deepseek-v3.2", ("deepseek-v3.2", "tiny", "deepseek-v3.2")),
    "page_size": ("32", "64", "16", (32, 64, 16)),
    "host_budget_bytes": ("8000000", "9000000", "10000000", (8_000_000, 9_000_000, 10_000_000)),
    "host_reserve_bytes": ("1", "2", "3", (1, 2, 3)),
    "l1_pages": ("4000", "5000", "6000", (4000, 5000, 6000)),
    "l1_free_room": ("0.05", "7", "0.1", (0.05, 7, 0.1)),
    "l2_free_room": ("3", "0.2", "9", (3, 0.2, 9)),
    "write_policy": ('"write_back"', "write_through_selective", "write_through",
                     ("write_back", "write_through_selective", "write_through")),
    "write_threshold": ("3", "4", "5", (3, 4, 5)),
    "eviction_policy": ('"hit_weighted"', "lru", "hit_weighted", ("hit_weighted", "lru", "hit_weighted")),
    "io_backend": ('"cpu"', "auto", "cpu", ("cpu", "auto", "cpu")),
    "cp_size": ("2", "3", "1", (2, 3, 1)),
    "debug_checks": ("true", "false", "true", (True, False, True)),
    "pin_host": ("false", "auto", "false", (False, None, False)),  # true needs CUDA: refused on a CPU replay
}


def _value(v: Any) -> Any:
    return getattr(v, "value", v)


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_library_precedence_and_sources(field: str, tmp_path: Path) -> None:
    toml, env, cli, (a, b, c) = FIELDS[field]
    f = tmp_path / "c.toml"
    f.write_text(f"{field} = {toml}\n")
    r = Config.resolve(f, env={})
    assert _value(getattr(r.config, field)) == a and r.sources[field] == f"toml:{f}"
    r = Config.resolve(f, env={f"HICACHE_{field.upper()}": env})
    assert _value(getattr(r.config, field)) == b and r.sources[field] == f"env:HICACHE_{field.upper()}"
    r = Config.resolve(f, env={f"HICACHE_{field.upper()}": env}, overrides={field: cli})
    assert _value(getattr(r.config, field)) == c and r.sources[field] == "cli"
    assert all(src == "default" for k, src in r.sources.items() if k not in (field, "model_layout"))


def _replay_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_replay_honours_every_source(field: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the replay runs with: TOML, then the environment, then --set."""
    toml, env, cli, (a, b, c) = FIELDS[field]
    f = tmp_path / "c.toml"
    f.write_text(f"{field} = {toml}\n")
    monkeypatch.delenv(f"HICACHE_{field.upper()}", raising=False)
    for argv, value, source, env_value in (
        (["--config", str(f)], a, f"toml:{f}", None),
        (["--config", str(f)], b, f"env:HICACHE_{field.upper()}", env),
        (["--config", str(f), "--set", f"{field}={cli}"], c, "cli", env),
    ):
        if env_value is not None:
            monkeypatch.setenv(f"HICACHE_{field.upper()}", env_value)
        args = _replay_args("--limit", "5", "--device", "cpu", *argv)
        resolved, _ = build_config(args, load_requests(args))
        assert _value(getattr(resolved.config, field)) == value, (argv, env_value)
        assert resolved.sources[field] == source
        report = resolved.report()[field]
        assert report["source"] == source and report["value"] == value


def test_replay_sizes_from_toml_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """host_budget_bytes and l1_pages from the TOML or environment size the pools
    (they used to be validated, then ignored); flags still win."""
    layout = Config().layout()
    f = tmp_path / "c.toml"
    f.write_text(f"host_budget_bytes = {200 * layout.bytes_per_page}\nl1_pages = 321\n")
    out = tmp_path / "r.json"
    monkeypatch.setenv("HICACHE_CP_SIZE", "1")
    assert main(["replay", "--limit", "20", "--config", str(f), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["l2_capacity_pages"] == 199 and report["l1_capacity_pages"] == 320
    assert report["config"]["host_budget_bytes"] == {"value": 200 * layout.bytes_per_page, "source": f"toml:{f}"}
    assert report["config"]["cp_size"]["source"] == "env:HICACHE_CP_SIZE"
    monkeypatch.setenv("HICACHE_L1_PAGES", "201")
    assert main(["replay", "--limit", "20", "--config", str(f), "--l2-fraction", "0.5", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["l1_capacity_pages"] == 200
    assert report["config"]["host_budget_bytes"]["source"] == "cli:--l2-fraction"
    assert report["config"]["l1_pages"]["source"] == "env:HICACHE_L1_PAGES"
