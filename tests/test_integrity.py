"""The deterministic KV content every reader checks against.

`content` (numpy, host) and `content_torch` (any device) must give the same
bytes, or a GPU server and a CPU decode peer would disagree on every page.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache_harness import integrity
from hicache_cp.layout import Part

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@given(
    hashes=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=16),
    part=st.sampled_from(list(Part)),
    layer=st.integers(0, 127),
    words=st.integers(1, 700),
)
def test_torch_content_equals_numpy_content(device: str, hashes: list[int], part: Part, layer: int, words: int) -> None:
    h = np.array(hashes, dtype=np.uint64)
    want = integrity.content(h, part, layer, 8 * words)
    got = integrity.content_torch(h, part, layer, 8 * words, device).cpu().numpy()
    assert got.dtype == np.uint8 and np.array_equal(got, want)


def test_content_depends_on_prefix_part_and_layer() -> None:
    h = np.array([1, 2], dtype=np.uint64)
    base = integrity.content(h, Part.TARGET_KV, 0, 64)
    assert not np.array_equal(base[0], base[1])  # prefix
    assert not np.array_equal(base, integrity.content(h, Part.DRAFT_KV, 0, 64))  # part
    assert not np.array_equal(base, integrity.content(h, Part.TARGET_KV, 1, 64))  # layer


def test_page_bytes_must_be_words() -> None:
    for fn in (integrity.content, lambda *a: integrity.content_torch(*a, "cpu")):
        with pytest.raises(ValueError, match="multiple of 8"):
            fn(np.array([1], dtype=np.uint64), Part.TARGET_KV, 0, 12)
