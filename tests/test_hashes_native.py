"""The compiled CPU hashes (`hicache_cp._hashes`) give numpy's bits, for every shape.

`checksum.raw_sums`, `checksum.finalise` and `keys.prefix_hashes` run compiled where
setup.py built the module and in numpy otherwise; the definitions are numpy's. Each
property draws pages (views with strides, gathers by page id with repeats, empty
ones) and compares the two paths bit for bit.
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_cp import checksum, keys

needs_compiled = pytest.mark.skipif(not checksum.NATIVE, reason="the compiled hashes are not built here")


def _numpy(f, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - a pass-through
    """`f(*args, **kwargs)` with `checksum` and `keys` hashing in numpy (the definitions)."""
    with checksum.numpy_hashes():
        return f(*args, **kwargs)


@st.composite
def page_views(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray | None]:
    """A uint8 [n, page_bytes] or [rows, n, page_bytes] view of a larger buffer (so its
    pages and rows are strided), and None or page ids (repeats allowed) to gather."""
    page_bytes = 8 * draw(st.integers(1, 80))
    n = draw(st.integers(0, 12))
    rows = draw(st.integers(1, 4))
    spare = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    buf = np.random.default_rng(seed).integers(0, 256, (rows + 1, n + spare, page_bytes + 8 * spare), dtype=np.uint8)
    view = buf[1:, spare:, : page_bytes] if draw(st.booleans()) else buf[:rows, :n, spare * 8 : spare * 8 + page_bytes]
    view = view[:, :n] if view.shape[1] > n else view
    if draw(st.booleans()):
        view = view[0]
    index = None
    if n and draw(st.booleans()):
        index = np.array(draw(st.lists(st.integers(0, n - 1), max_size=16)), dtype=np.int64)
    return view, index


@needs_compiled
@settings(max_examples=200, deadline=None)
@given(page_views())
def test_raw_sums_compiled_equal_numpy_on_views_and_gathers(case: tuple[np.ndarray, np.ndarray | None]) -> None:
    view, index = case
    got = checksum.raw_sums(view, index=index)
    want = _numpy(checksum.raw_sums, view, index=index)
    expected_shape = view.shape[:-1] if index is None else (*view.shape[:-2], len(index))
    assert got.shape == want.shape == expected_shape
    assert np.array_equal(got, want)
    if index is None and view.shape[-2]:  # and the gather of every page is the same as none
        assert np.array_equal(checksum.raw_sums(view, index=np.arange(view.shape[-2])), got)


@needs_compiled
@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(0, 40), st.integers(0, 2**32 - 1))
def test_finalise_compiled_equals_numpy(rows: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 2**64, (rows, n), dtype=np.uint64)
    salts = rng.integers(0, 2**64, rows, dtype=np.uint64)
    got = checksum.finalise(raw.copy(), salts)
    want = _numpy(checksum.finalise, raw.copy(), salts)
    assert np.array_equal(got, want)


@needs_compiled
@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(0, 300), st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1))
def test_prefix_hashes_compiled_equal_numpy(page_size: int, length: int, parent: int, seed: int) -> None:
    tokens = np.random.default_rng(seed).integers(0, 1 << 40, length, dtype=np.int64)
    for p in (0, parent):
        got = keys.prefix_hashes(tokens, page_size, p)
        want = _numpy(keys.prefix_hashes, tokens, page_size, p)
        assert got.dtype == np.uint64 and np.array_equal(got, want)
    # int32 tokens (an engine's) hash as their int64 values
    small = (tokens % (1 << 31)).astype(np.int32)
    want = _numpy(keys.prefix_hashes, small.astype(np.int64), page_size)
    assert np.array_equal(keys.prefix_hashes(small, page_size), want)


def test_numpy_hashes_switches_to_numpy_inside_and_back_after() -> None:
    built = checksum.native
    with pytest.raises(RuntimeError), checksum.numpy_hashes():
        assert checksum.native is None
        raise RuntimeError("left by an exception")
    assert checksum.native is built


@needs_compiled
def test_a_page_id_out_of_range_is_refused_not_read() -> None:
    pages = np.zeros((3, 4, 64), dtype=np.uint8)
    with pytest.raises(IndexError, match="page 4 of 4 pages"):
        checksum.raw_sums(pages, index=np.array([0, 4]))
    with pytest.raises(IndexError, match="page -1 of 4 pages"):
        checksum.raw_sums(pages, index=np.array([-1]))


@needs_compiled
def test_wrong_dtypes_and_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="must be uint8"):
        checksum.raw_sums(np.zeros((2, 8), dtype=np.int8))
    mults = checksum.word_multipliers(1)
    with pytest.raises(ValueError, match="not rows x pages"):
        checksum.native.raw_sums(np.zeros((2, 8), np.uint8), mults, np.empty(3, np.uint64), None)
    with pytest.raises(ValueError, match="fewer than page_bytes"):
        checksum.native.raw_sums(np.zeros((2, 16), np.uint8), np.ones(1, np.uint64), np.empty(2, np.uint64), None)
    out = np.empty(2, np.uint64)
    out.flags.writeable = False
    with pytest.raises(TypeError, match="out: not a buffer of the required kind"):  # read-only
        checksum.native.raw_sums(np.zeros((2, 8), np.uint8), mults, out, None)


@needs_compiled
def test_a_strided_output_still_gets_numpys_sums() -> None:
    """The compiled pass needs a C-contiguous `out`; any other goes through numpy."""
    pages = np.random.default_rng(1).integers(0, 256, (2, 5, 64), dtype=np.uint8)
    out = np.zeros((5, 2), dtype=np.uint64).T  # not C-contiguous
    checksum.raw_sums(pages, out=out)
    assert np.array_equal(out, _numpy(checksum.raw_sums, pages))


def test_the_compiled_hashes_are_built_where_a_c_compiler_is() -> None:
    """setup.py's extension is optional: a machine with a compiler and Python's headers
    must not silently fall back to numpy (the checks' CPU cost depends on it)."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if shutil.which(cc) is None or not headers.exists():
        pytest.skip(f"no C compiler ({cc}) or no Python.h here")
    assert checksum.NATIVE, "a C compiler is here but hicache_cp._hashes is not built: pip install -e . again"


@needs_compiled
@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 30), st.integers(0, 12), st.booleans(), st.integers(0, 2**32 - 1))
def test_store_and_mismatched_compiled_equal_numpy(height: int, width: int, n: int, all_rows: bool, seed: int) -> None:
    """The stored-checksum table's cells: a store writes the same cells, and a compare
    sees a difference exactly where numpy does (a single changed cell included)."""
    rng = np.random.default_rng(seed)
    table = rng.integers(0, 2**64, (height, width), dtype=np.uint64)
    rows = None if all_rows else rng.integers(0, height, rng.integers(1, 2 * height), dtype=np.int64)
    cols = rng.choice(width, size=min(n, width), replace=False).astype(np.int64)
    sums = rng.integers(0, 2**64, (height if rows is None else len(rows), len(cols)), dtype=np.uint64)
    if rows is not None:  # a row twice: the later write wins in both, so keep them equal
        sums = sums[np.unique(rows, return_inverse=True)[1] if len(rows) else slice(None)]
    got, want = table.copy(), table.copy()
    checksum.store(got, rows, cols, sums)
    _numpy(checksum.store, want, rows, cols, sums)
    assert np.array_equal(got, want)
    assert checksum.mismatched(got, rows, cols, sums) is _numpy(checksum.mismatched, got, rows, cols, sums) is False
    if sums.size:
        i, j = rng.integers(0, sums.shape[0]), rng.integers(0, sums.shape[1])
        changed = sums.copy()
        changed[i, j] ^= np.uint64(1) << np.uint64(rng.integers(0, 64))
        assert checksum.mismatched(got, rows, cols, changed) is True
        assert _numpy(checksum.mismatched, got, rows, cols, changed) is True


@needs_compiled
def test_store_and_mismatched_refuse_cells_outside_the_table() -> None:
    table = np.zeros((2, 4), dtype=np.uint64)
    with pytest.raises(IndexError, match="cols: page 4 of 4"):
        checksum.store(table, None, np.array([0, 4]), np.zeros((2, 2), dtype=np.uint64))
    with pytest.raises(IndexError, match="rows: row 2 of 2"):
        checksum.mismatched(table, np.array([2]), np.array([0]), np.zeros((1, 1), dtype=np.uint64))
    with pytest.raises(ValueError, match="sums: not rows x cols"):
        checksum.store(table, None, np.array([0]), np.zeros((1, 1), dtype=np.uint64))


@needs_compiled
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 40)), min_size=1, max_size=4), st.integers(1, 10),
       st.booleans(), st.integers(0, 2**32 - 1))  # fmt: skip
def test_raw_sums_blocks_compiled_equal_numpy(shapes: list[tuple[int, int]], n: int, run: bool, seed: int) -> None:
    """Several blocks (rows of different page sizes) in one call: each row's pages, a run
    (a slice) or gathered by id, as `raw_sums` gives them one block at a time."""
    rng = np.random.default_rng(seed)
    blocks, row = [], 0
    for k, words in shapes:
        buf = rng.integers(0, 256, (k + 1, n + 2, 8 * words), dtype=np.uint8)
        view = buf[1:]  # rows strided by a whole slab, as a pool's slots are
        blocks.append((view, checksum.word_multipliers(words), row))
        row += k
    pages = slice(1, n + 1) if run else rng.integers(0, n + 2, rng.integers(0, 2 * n), dtype=np.int64)
    width = n if run else len(pages)
    got, want = np.zeros((row, width), np.uint64), np.zeros((row, width), np.uint64)
    checksum.raw_sums_blocks(tuple(blocks), got, pages)
    _numpy(checksum.raw_sums_blocks, tuple(blocks), want, pages)
    assert np.array_equal(got, want)
    view, _, lo = blocks[-1]
    alone = checksum.raw_sums(view[:, pages]) if run else checksum.raw_sums(view, index=pages)
    assert np.array_equal(got[lo:], alone)
    with pytest.raises(IndexError, match="page"):
        checksum.raw_sums_blocks(tuple(blocks), np.zeros((row, 1), np.uint64), np.array([n + 2]))
