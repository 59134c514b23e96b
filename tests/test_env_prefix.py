"""Environment variables (issue 48, item 8): the `HICACHE_` prefix is ours, and
nothing outside it is ever read.

An unknown `HICACHE_*` variable (another program's, or a misspelt setting) is
ignored with one WARNING naming the closest setting, as vLLM treats unknown
`VLLM_*` variables (SGLang ignores unknown `SGLANG_*` ones silently);
`HICACHE_STRICT_ENV=1` refuses it instead, as vLLM's
`fail_on_environ_validation` does. Before, any such variable stopped every
command, so a machine where another program set one could not run hicache-cp.
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_cp import config as config_module
from hicache_cp.config import Config
from hicache_cp.errors import ConfigError


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "_WARNED", set(), raising=False)


def test_an_unknown_hicache_variable_is_a_warning_naming_the_closest_setting(caplog: pytest.LogCaptureFixture) -> None:
    env = {"HICACHE_L1_PAGS": "5", "HICACHE_L1_PAGES": "100", "HICACHE_SOMEONE_ELSES": "x"}
    with caplog.at_level(logging.WARNING, logger="hicache_cp.config"):
        r = Config.resolve(env=env)
        Config.resolve(env=env)  # once per variable and process
    assert r.config.l1_pages == 100 and r.sources["l1_pages"] == "env:HICACHE_L1_PAGES"
    warned = [rec.getMessage() for rec in caplog.records]
    assert len(warned) == 2, warned
    assert "HICACHE_L1_PAGS is not a hicache-cp setting; did you mean HICACHE_L1_PAGES?; ignored" in warned[0]
    assert "HICACHE_SOMEONE_ELSES is not a hicache-cp setting" in warned[1]


def test_strict_mode_refuses_an_unknown_hicache_variable() -> None:
    with pytest.raises(ConfigError, match="HICACHE_L1_PAGS is not a hicache-cp setting; did you mean HICACHE_L1_PAGES"):
        Config.resolve(env={"HICACHE_L1_PAGS": "5", "HICACHE_STRICT_ENV": "1"})
    with pytest.raises(ConfigError, match="HICACHE_STRICT_ENV='maybe': expected 1 or 0"):
        Config.resolve(env={"HICACHE_STRICT_ENV": "maybe"})
    assert Config.resolve(env={"HICACHE_STRICT_ENV": "1", "HICACHE_L1_PAGES": "64"}).config.l1_pages == 64


def test_the_cli_runs_beside_another_programs_hicache_variable(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    from hicache_harness.cli import main

    monkeypatch.setenv("HICACHE_OTHER_PROGRAM_TOKEN", "abc")
    with caplog.at_level(logging.WARNING, logger="hicache_cp.config"):
        assert main(["replay", "--limit", "2"]) == 0
    warned = [r.getMessage() for r in caplog.records if r.name == "hicache_cp.config"]
    assert len(warned) == 1 and "HICACHE_OTHER_PROGRAM_TOKEN is not a hicache-cp setting; ignored" in warned[0]


_NAME = st.text(st.characters(codec="utf-8", exclude_characters="\x00="), min_size=1, max_size=30)
_NEAR = st.sampled_from(["HICACHE", "HICACHE-L1_PAGES", "hicache_l1_pages", "Hicache_L1_PAGES", "XHICACHE_L1_PAGES",
                         "MY_HICACHE_L1_PAGES", " HICACHE_L1_PAGES", "HICACH_L1_PAGES", "SGLANG_HICACHE_SIZE",
                         "VLLM_HICACHE", "HICACHE\u200b_L1_PAGES", "\uff28ICACHE_L1_PAGES"])  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(env=st.dictionaries(st.one_of(_NEAR, _NAME).filter(lambda k: not k.startswith("HICACHE_")),
                           st.text(max_size=20), max_size=8),
       strict=st.booleans())  # fmt: skip
def test_a_variable_outside_the_prefix_never_matters(env: dict[str, str], strict: bool) -> None:
    """Whatever else the environment holds, near misses of the prefix included:
    the same config, the same sources, no warning, in strict mode too."""
    base = {"HICACHE_STRICT_ENV": "1"} if strict else {}
    want = Config.resolve(env=base)
    got = Config.resolve(env={**env, **base})
    assert got.config == want.config and got.sources == want.sources
    assert config_module._WARNED == set()


def test_every_variable_that_is_not_a_field_is_documented() -> None:
    """docs/configuration.md lists each `HICACHE_*` variable read outside the config, so a
    user can tell one that is read from one that is warned about."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    missing = sorted(v for v in config_module.NON_FIELD_ENV if f"`{v}`" not in doc)
    assert not missing, f"not in docs/configuration.md: {missing}"
