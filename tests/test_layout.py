"""KVLayout: the one-budget split over parts and the compact slots of index skip."""

from __future__ import annotations

import pytest

from hicache_cp.presets import PRESETS
from hicache_cp.layout import KVLayout, Model, Part


def tiny() -> KVLayout:
    return PRESETS["tiny"].layout(16)


@pytest.mark.parametrize("budget_pages", [1, 2, 7, 1000])
@pytest.mark.parametrize("extra", [0, 1, 1663])
def test_budget_split_equal_pages_and_within_budget(budget_pages: int, extra: int) -> None:
    layout = tiny()
    budget = budget_pages * layout.bytes_per_page + extra
    split = layout.split_budget(budget)
    # Every part gets the same page capacity (shared logical page ids)...
    assert split.pages == budget_pages
    for p in layout.parts:
        assert split.bytes_per_part[p.part] == split.pages * p.bytes_per_page
    # ...so draft token capacity equals the target's, and the sum fits the one budget.
    draft_tokens = split.bytes_per_part[Part.DRAFT_KV] // layout.part(Part.DRAFT_KV).bytes_per_page * layout.page_size
    target_tokens = split.bytes_per_part[Part.TARGET_KV] // layout.part(Part.TARGET_KV).bytes_per_page * layout.page_size
    assert draft_tokens >= target_tokens
    assert split.used_bytes <= budget


def test_budget_below_one_page_rejected() -> None:
    layout = tiny()
    with pytest.raises(ValueError, match="below one logical page"):
        layout.split_budget(layout.bytes_per_page - 1)


def test_tiny_sizes() -> None:
    layout = tiny()
    # 4 x 256 (target kv) + 2 x 128 (state on layers 0, 2) + 256 (draft kv) + 128 (draft state)
    assert layout.bytes_per_page == 1664
    assert [p.part for p in layout.parts] == list(Part)
    assert layout.num_layers(Model.TARGET) == 4 and layout.num_layers(Model.DRAFT) == 1


def test_compact_slots_for_index_skip() -> None:
    state = tiny().part(Part.TARGET_STATE)
    assert state.layer_ids == (0, 2) and state.num_slots == 2
    assert state.slot(0) == 0 and state.slot(2) == 1
    assert state.has_layer(2) and not state.has_layer(1)
    with pytest.raises(ValueError, match="no layer 1"):
        state.slot(1)
    with pytest.raises(ValueError, match="no layer 3"):
        state.slot(3)


def test_layout_rejects_bad_layers() -> None:
    with pytest.raises(ValueError, match="out of range"):
        KVLayout.build(page_size=16, num_layers=4, kv_bytes_per_token=16, state_bytes_per_token=8, state_layers=(0, 4))
    with pytest.raises(ValueError, match="duplicate"):
        KVLayout.build(page_size=16, num_layers=4, kv_bytes_per_token=16, state_bytes_per_token=8, state_layers=(1, 1))
    with pytest.raises(ValueError, match="page_size"):
        KVLayout.build(page_size=0, num_layers=4, kv_bytes_per_token=16)
