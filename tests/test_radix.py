"""The radix tree matches exact token content, page by page.

A hypothesis test inserts random token sequences (small alphabets, so
prefixes are shared and nodes split) and checks every match against a brute
force over the inserted sequences; `check_invariants` runs after each step.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_cp.keys import page_hashes, prefix_hashes
from hicache_cp.radix import RadixTree, whole_pages

PS = 2

SEQ = st.lists(st.integers(0, 1), min_size=0, max_size=16).map(lambda xs: np.array(xs, dtype=np.int64))


def _brute_force(inserted: list[np.ndarray], tokens: np.ndarray) -> int:
    """Longest whole-page prefix of `tokens` shared with any inserted sequence."""
    best = 0
    for seq in inserted:
        n = min(len(seq), len(tokens)) // PS
        k = 0
        while k < n and np.array_equal(seq[k * PS : (k + 1) * PS], tokens[k * PS : (k + 1) * PS]):
            k += 1
        best = max(best, k)
    return best


def _insert(tree: RadixTree, tokens: np.ndarray) -> None:
    pages = whole_pages(tokens, PS)
    path = tree.match(pages)
    covered = path[-1].end_position if path else 0
    n = len(pages) // PS
    if covered < n:
        parent = path[-1] if path else tree.root
        tree.add_child(parent, pages[covered * PS :], np.arange(covered, n, dtype=np.int64) + 1)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(ops=st.lists(st.tuples(st.booleans(), SEQ), min_size=1, max_size=30))
def test_match_is_the_longest_exact_page_prefix(ops: list[tuple[bool, np.ndarray]]) -> None:
    tree = RadixTree(PS)
    inserted: list[np.ndarray] = []
    for is_insert, tokens in ops:
        path = tree.match(whole_pages(tokens, PS))
        matched = path[-1].end_position if path else 0
        assert matched == _brute_force(inserted, tokens)
        for node in path:  # every matched node holds exactly the request's tokens there
            lo, hi = node.first_position * PS, node.end_position * PS
            assert np.array_equal(node.tokens, tokens[lo:hi])
        if is_insert:
            _insert(tree, tokens)
            inserted.append(tokens)
        tree.check_invariants()


def test_match_stops_at_the_first_differing_page() -> None:
    """Same first page, different second page (and a difference inside a
    long node): the match ends where the tokens differ, splitting the node."""
    tree = RadixTree(PS)
    a = np.array([0, 0, 1, 1, 0, 1, 1, 0], dtype=np.int64)  # 4 pages
    _insert(tree, a)
    for other, expect in (([0, 0, 0, 0], 1), ([0, 0, 1, 1, 0, 1, 0, 0], 3), ([0, 0, 1, 1, 0, 1, 1, 0, 1, 1], 4)):
        path = tree.match(whole_pages(np.array(other, dtype=np.int64), PS))
        assert (path[-1].end_position if path else 0) == expect, other
        tree.check_invariants()


def test_prefix_hashes_chain_and_continue() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2**32, 64 * 40)
    full = prefix_hashes(tokens, 64)
    assert len(set(full.tolist())) == 40
    # Equal prefixes, equal hashes; one changed token changes its page and every later prefix hash.
    other = tokens.copy()
    other[64 * 10 + 3] += 1
    changed = prefix_hashes(other, 64)
    assert np.array_equal(changed[:10], full[:10]) and (changed[10:] != full[10:]).all()
    assert np.array_equal(page_hashes(other, 64)[11:], page_hashes(tokens, 64)[11:])
    # A chain continues from its parent's hash.
    assert np.array_equal(prefix_hashes(tokens[64 * 15 :], 64, parent=int(full[14])), full[15:])
