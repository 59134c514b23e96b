"""Config: validation names the field, sources take precedence in order, presets build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hicache_cp.config import Config, WritePolicy
from hicache_cp.errors import ConfigError

TINY_PAGE = 1664  # bytes of one logical page of the tiny preset at page_size 16


@pytest.mark.parametrize(
    "values, field",
    [
        ({"page_size": 0}, "page_size"),
        ({"page_size": -16}, "page_size"),
        ({"page_size": 3, "model_layout": {"kv_bytes_per_token": 5}}, "multiple of 8"),  # 15-byte pages
        ({"host_budget_bytes": TINY_PAGE}, "host_budget_bytes"),
        ({"write_policy": "write_around"}, "write_policy"),
        ({"eviction_policy": "fifo"}, "eviction_policy"),
        ({"io_backend": "rdma"}, "io_backend"),
        ({"l1_free_room": 1.0}, "l1_free_room"),
        ({"l2_free_room": 1.5}, "l2_free_room"),
        ({"l1_free_room": -1}, "l1_free_room"),
        ({"l2_free_room": -0.1}, "l2_free_room"),
        ({"l1_pages": True}, "l1_pages"),
        ({"page_size": True}, "page_size"),
        ({"l1_pages": 1}, "l1_pages"),
        ({"cp_size": 0}, "cp_size"),
        ({"backup_submits_per_forward": 0}, "backup_submits_per_forward"),
        ({"model": "gpt-5"}, "model"),
        ({"model_layout": {"state_layers": [0, 9]}}, "model_layout"),
        ({"model_layout": {"state_layers": [2, 2]}}, "model_layout"),
        ({"model_layout": {"num_layers": 4.5}}, "model_layout.num_layers"),
        ({"wrte_policy": "write_back"}, "wrte_policy"),
    ],
)
def test_bad_values_name_the_field(values: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        Config.from_dict(values)


def test_unknown_policies_list_the_allowed_values() -> None:
    with pytest.raises(ConfigError) as e:
        Config(write_policy="write_around")  # type: ignore[arg-type]
    for p in WritePolicy:
        assert p.value in str(e.value)
    with pytest.raises(ConfigError) as e:
        Config(eviction_policy="fifo")
    assert "lru" in str(e.value) and "hit_weighted" in str(e.value)
    with pytest.raises(ConfigError) as e:
        Config(io_backend="rdma")
    assert "cpu" in str(e.value) and "auto" in str(e.value)


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        Config(page_size=0)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        Config.load(tmp_path / "nope.toml", env={})


def test_unknown_toml_field(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('page_sise = 64\n')
    with pytest.raises(ConfigError, match="page_sise"):
        Config.load(f, env={})


def test_bad_env_value_names_field() -> None:
    with pytest.raises(ConfigError, match="l1_pages"):
        Config.load(env={"HICACHE_L1_PAGES": "many"})


def test_precedence_toml_env_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('l1_pages = 100\nwrite_threshold = 3\nwrite_policy = "write_back"\nl2_free_room = 0.1\n')
    c = Config.load(f, env={})
    assert c.l1_pages == 100 and c.write_threshold == 3 and c.write_policy is WritePolicy.WRITE_BACK
    env = {"HICACHE_L1_PAGES": "200", "HICACHE_WRITE_POLICY": "write_through_selective", "HICACHE_L2_FREE_ROOM": "5"}
    c = Config.load(f, env=env)
    assert c.l1_pages == 200 and c.write_threshold == 3  # env beats TOML; TOML beats default
    assert c.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
    assert c.l2_free_room == 5 and isinstance(c.l2_free_room, int)  # an int is a page count
    c = Config.load(f, env=env, overrides={"l1_pages": 300, "write_threshold": None})
    assert c.l1_pages == 300 and c.write_threshold == 3  # overrides beat env; None means unset


def test_free_room_pages() -> None:
    c = Config(l1_free_room=0.25, l2_free_room=7)
    assert c.free_room_pages("l1", 100) == 25 and c.free_room_pages("l2", 100) == 7


def test_presets_build() -> None:
    c = Config(model="deepseek-v3.2", page_size=64, host_budget_bytes=1 << 30)
    layout = c.layout()
    assert layout.num_target_layers == 61 and layout.num_draft_layers == 1
    from hicache_cp.layout import Part

    assert layout.part(Part.TARGET_KV).page_bytes == 656 * 64
    assert layout.part(Part.TARGET_STATE).page_bytes == 132 * 64 == 8448  # index K page
    assert layout.part(Part.TARGET_STATE).layer_ids == tuple(range(61))
    assert layout.part(Part.DRAFT_KV).page_bytes == 656 * 64
    assert layout.bytes_per_page == 61 * (656 + 132) * 64 + (656 + 132) * 64
    tiny = Config().layout()
    assert tiny.bytes_per_page == TINY_PAGE


def test_toml_model_layout_override(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('model = "tiny"\n[model_layout]\nstate_layers = [1, 3]\n')
    c = Config.load(f, env={})
    from hicache_cp.layout import Part

    assert c.layout().part(Part.TARGET_STATE).layer_ids == (1, 3)
