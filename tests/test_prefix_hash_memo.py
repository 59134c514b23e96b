"""`keys.PrefixHashMemo`: whatever sequence of prompts it is asked for, it answers what
`prefix_hashes` answers, and it hashes again only the pages it does not share."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_cp import keys
from hicache_cp.keys import PrefixHashMemo, prefix_hashes

PS = 4


def _prompt(base: list[int], edits: list[tuple[int, int]], pages: int) -> np.ndarray:
    t = np.array((base * (pages * PS // max(1, len(base)) + 1))[: pages * PS + 1], dtype=np.int64)
    for pos, value in edits:
        t[pos % len(t)] = value
    return t


@settings(max_examples=200, deadline=None)
@given(
    base=st.lists(st.integers(0, 50), min_size=1, max_size=12),
    asks=st.lists(
        st.tuples(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 50)), max_size=2), st.integers(0, 12)),
        min_size=1, max_size=8,
    ),
)
def test_the_memo_answers_what_prefix_hashes_answers(base: list[int], asks: list) -> None:
    memo = PrefixHashMemo(PS)
    for edits, pages in asks:
        tokens = _prompt(base, edits, 12)
        got = memo.first(tokens, pages)
        assert np.array_equal(got, prefix_hashes(tokens[: pages * PS], PS))
        assert not got.flags.writeable


def test_shared_pages_are_not_hashed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[int] = []
    real = keys.prefix_hashes

    def counting(tokens: np.ndarray, page_size: int, parent: int = 0) -> np.ndarray:
        hashed.append(len(tokens) // page_size)
        return real(tokens, page_size, parent)

    monkeypatch.setattr(keys, "prefix_hashes", counting)
    memo = PrefixHashMemo(PS)
    tokens = np.arange(10 * PS, dtype=np.int64)
    memo.first(tokens, 6)  # a match
    memo.first(tokens, 6)  # the same request matched again
    memo.first(tokens, 10)  # its reservation: 4 more pages
    other = tokens.copy()
    other[7 * PS + 1] = -1
    memo.first(other, 10)  # another prompt sharing 7 pages
    assert hashed == [6, 4, 3]
    assert np.array_equal(memo.first(other, 10), real(other, PS))


def test_more_pages_than_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="3 pages asked of 9 tokens"):
        PrefixHashMemo(PS).first(np.arange(9), 3)


def _reference(tokens: np.ndarray, page_size: int, parent: int = 0) -> list[int]:
    """The prefix hashes by their definition, in Python integers: g_i = splitmix64(sum of
    token * position multiplier, ^ page_size), x_i = x_{i-1} * P + g_i (mod 2**64)."""
    mask, mults = (1 << 64) - 1, [int(m) for m in keys._position_multipliers(page_size)]

    def splitmix(z: int) -> int:
        z ^= z >> 30
        z = (z * 0xBF58476D1CE4E5B9) & mask
        z ^= z >> 27
        z = (z * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    out, x = [], parent
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size : (i + 1) * page_size]
        g = splitmix((sum((int(t) & mask) * m for t, m in zip(page, mults)) & mask) ^ page_size)
        x = (x * 0x9E3779B97F4A7C15 + g) & mask
        out.append(x)
    return out


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("parent", [0, 0xFEDCBA9876543210])
def test_prefix_hashes_follow_their_definition(page_size: int, parent: int) -> None:
    tokens = np.random.default_rng(page_size).integers(-(2**40), 2**40, 37 * page_size + 3)
    assert prefix_hashes(tokens, page_size, parent).tolist() == _reference(tokens, page_size, parent)
