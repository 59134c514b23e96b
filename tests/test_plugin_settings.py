"""The plug-ins' settings (issue 48, item 5): every bad value is a `ConfigError`
naming the key and its source, raised while the settings are read, before
anything is built; nothing is accepted that the plug-in would then ignore.

SGLang (`integrations.sglang.settings.resolve`): keys it cannot honour
(l1_free_room, write_threshold, l2_exclusive, pd_timeout_s, pd_per_layer),
a budget no machine has, and a CUDA io backend or `pin_host = true` in a
process without CUDA. vLLM (`ConnectorSettings.from_extra_config`): a budget
of nan, inf, under a byte or 1e30 GiB, a string where the mapping belongs,
and every other key's bad value, under the key as given.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache_cp.errors import ConfigError
from hicache_cp.layout import Part

pytest.importorskip("sglang", reason="the SGLang plug-in's settings read SGLang's pool views")


def _kv():  # type: ignore[no-untyped-def]
    """Pools of one target KV layer: 8 pages of 16 tokens, 32 bytes a token."""
    from hicache_cp.integrations.sglang.pools import PoolPart, SGLangKV

    views = (torch.zeros(8, 16 * 32, dtype=torch.uint8),)
    return SGLangKV(page_size=16, num_pages=8, num_target_layers=1, num_draft_layers=0,
                    parts=(PoolPart(Part.TARGET_KV, (0,), views),))  # fmt: skip


SGLANG_BAD = [
    ({"HICACHE_PD_TIMEOUT_S": "30"}, "pd_timeout_s (from env:HICACHE_PD_TIMEOUT_S)"),
    ({"HICACHE_PD_PER_LAYER": "true"}, "pd_per_layer (from env:HICACHE_PD_PER_LAYER)"),
    ({"HICACHE_L1_FREE_ROOM": "0.1"}, "l1_free_room (from env:HICACHE_L1_FREE_ROOM)"),
    ({"HICACHE_WRITE_THRESHOLD": "3"}, "write_threshold (from env:HICACHE_WRITE_THRESHOLD)"),
    ({"HICACHE_L2_EXCLUSIVE": "true"}, "l2_exclusive needs write_policy = write_back, got write_through (from env:"),
    ({"HICACHE_HOST_BUDGET_BYTES": str(1 << 60)}, "host_budget_bytes: 1.074e+09 GiB per rank"),
    ({"HICACHE_IO_BACKEND": "direct"}, "io_backend: direct copies with CUDA"),
    ({"HICACHE_PIN_HOST": "true"}, "pin_host: true needs CUDA"),
]


@pytest.mark.parametrize("env, fragment", SGLANG_BAD, ids=[next(iter(e)) for e, _ in SGLANG_BAD])
def test_sglang_refuses_what_it_cannot_honour(env: dict[str, str], fragment: str) -> None:
    from hicache_cp.integrations.sglang.settings import resolve

    with pytest.raises(ConfigError) as caught:
        resolve(_kv(), env, cuda=False)
    assert fragment in str(caught.value)
    assert "(from env:" in str(caught.value)  # the source, always


def test_sglang_names_the_toml_file_as_the_source(tmp_path: Path) -> None:
    from hicache_cp.integrations.sglang.settings import resolve

    toml = tmp_path / "c.toml"
    toml.write_text("write_threshold = 4\n")
    with pytest.raises(ConfigError, match=rf"write_threshold \(from toml:{toml}\)"):
        resolve(_kv(), {"HICACHE_CP_CONFIG": str(toml)}, cuda=False)


def test_sglang_accepts_what_it_honours() -> None:
    from hicache_cp.integrations.sglang.settings import resolve

    r = resolve(_kv(), {"HICACHE_HOST_BUDGET_BYTES": str(1 << 20), "HICACHE_IO_BACKEND": "cpu",
                        "HICACHE_L2_FREE_ROOM": "0.1", "HICACHE_PIN_HOST": "false"}, cuda=False)  # fmt: skip
    assert r.config.host_budget_bytes == 1 << 20 and r.sources["page_size"] == "sglang"
    assert resolve(_kv(), {"HICACHE_IO_BACKEND": "direct"}, cuda=True).config.io_backend == "direct"


VLLM_BAD = [
    ({"host_budget_gib": float("nan")}, "host_budget_gib: must be a positive finite number"),
    ({"host_budget_gib": float("inf")}, "host_budget_gib: must be a positive finite number"),
    ({"host_budget_gib": 1e30}, "host_budget_gib: 1e+30 GiB per rank, but this machine"),
    ({"host_budget_gib": 1e-12}, "host_budget_gib: 1e-12 GiB is less than a byte"),
    ({"host_budget_gib": 1e-7}, "host_budget_gib: 107 bytes is below two logical pages"),
    ({"host_budget_bytes": 1 << 70}, "host_budget_bytes: 1.1e+12 GiB per rank"),
    ({"host_budget_gib": 1, "eviction_policy": "fifo"}, "eviction_policy: unknown policy 'fifo'"),
    ({"host_budget_gib": 1, "l2_free_room": "lots"}, "l2_free_room: expected a fraction"),
    ({"host_budget_gib": 1, "io_backend": "direct"}, "io_backend: direct copies with CUDA"),
    ({"host_budget_gib": 1, "pin_host": True}, "pin_host: true needs CUDA"),
    ({"host_budget_gib": 1, "debug_checks": "yes"}, "debug_checks: expected true or false"),
    ({"host_budget_gib": 1, "backup_submits_per_forward": 0}, "backup_submits_per_forward: must be an integer >= 1"),
]


@pytest.mark.parametrize("extra, fragment", VLLM_BAD, ids=[f"{k}={v!r}" for e, _ in VLLM_BAD for k, v in
                                                           list(e.items())[-1:]])  # fmt: skip
def test_vllm_refuses_every_bad_value_under_its_key(extra: dict, fragment: str) -> None:
    from hicache_cp.integrations.vllm.settings import ConnectorSettings

    with pytest.raises(ConfigError) as caught:
        ConnectorSettings.from_extra_config(extra, cuda=False)
    assert fragment in str(caught.value)
    assert str(caught.value).endswith("(from kv_connector_extra_config)")


def test_vllm_refuses_a_string_where_the_mapping_belongs() -> None:
    from hicache_cp.integrations.vllm.settings import ConnectorSettings

    with pytest.raises(ConfigError, match="kv_connector_extra_config: expected a mapping of settings, got str"):
        ConnectorSettings.from_extra_config("host_budget_gib=64")  # type: ignore[arg-type]


def test_vllm_a_budget_below_the_layouts_two_pages_is_named_as_given() -> None:
    """The real layout decides the smallest budget (`cache_config`): still under the key given."""
    from hicache_cp.integrations.vllm.settings import ConnectorSettings
    from hicache_cp.layout import KVLayout

    layout = KVLayout.build(page_size=64, num_layers=4, kv_bytes_per_token=656)
    settings = ConnectorSettings.from_extra_config({"host_budget_gib": 1e-4}, cuda=False)  # 107 KiB
    with pytest.raises(ConfigError, match=r"host_budget_gib: 107374 bytes is below two logical pages .*"
                                          r"\(from kv_connector_extra_config\)"):
        settings.cache_config(layout)
    assert ConnectorSettings.from_extra_config({"host_budget_gib": 0.01}, cuda=False).cache_config(layout)
