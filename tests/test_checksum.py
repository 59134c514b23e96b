"""The page checksum (`hicache_cp.checksum`): its definition, its guarantees.

The numpy implementation is checked against a plain-Python reference written
from the docstring's 32-bit-word form (the multilinear sum with M_2j = A_j,
M_2j+1 = A_j * 2**32 + B_j), so a change to either shows. The GPU kernel is
checked against numpy in tests/test_checksum_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_cp import checksum
from hicache_cp.layout import Part

MASK = (1 << 64) - 1


def _fmix(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def reference(page: bytes, part: Part, layer: int) -> int:
    """The definition over 32-bit words, in Python integers."""
    words = np.frombuffer(page, dtype="<u4").tolist()
    a, b = checksum.multipliers(len(words) // 2)
    total = 0
    for i, w in enumerate(words):
        j = i // 2
        m = int(a[j]) if i % 2 == 0 else ((int(a[j]) << 32) + int(b[j])) & MASK
        total = (total + m * w) & MASK
    return _fmix(total ^ int(checksum.salt(part, layer, len(page))))


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    words=st.integers(1, 300),
    pages=st.integers(1, 40),
    part=st.sampled_from(list(Part)),
    layer=st.integers(0, 200),
)
def test_numpy_checksum_equals_the_definition(data: st.DataObject, words: int, pages: int, part: Part, layer: int) -> None:
    seed = data.draw(st.integers(0, 2**32 - 1))
    block = np.random.default_rng(seed).integers(0, 256, (pages, 8 * words), dtype=np.uint8)
    got = checksum.checksums(block, part, layer)
    assert got.dtype == np.uint64 and got.shape == (pages,)
    for i in (0, pages // 2, pages - 1):  # rows of both the small and the blocked path
        assert int(got[i]) == reference(block[i].tobytes(), part, layer)


def test_blocked_and_single_row_paths_agree() -> None:
    # 300 pages of 4 KiB: several steps of `_STEP_BYTES` and a partial last one (einsum),
    # against each page alone (a matrix-vector product)
    n = 300
    assert n * 4096 > 2 * checksum._STEP_BYTES and (n * 4096) % checksum._STEP_BYTES
    block = np.random.default_rng(1).integers(0, 256, (n, 4096), dtype=np.uint8)
    whole = checksum.checksums(block, Part.TARGET_KV, 3)
    rows = np.concatenate([checksum.checksums(block[i : i + 1], Part.TARGET_KV, 3) for i in range(n)])
    assert np.array_equal(whole, rows)
    strided = checksum.checksums(np.ascontiguousarray(block[::2]), Part.TARGET_KV, 3)
    assert np.array_equal(strided, whole[::2])


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), words=st.integers(1, 2048), index=st.integers(0, 4095),
       delta=st.integers(1, 2**32 - 1))  # fmt: skip
def test_any_change_of_one_32_bit_word_is_detected(seed: int, words: int, index: int, delta: int) -> None:
    page = np.random.default_rng(seed).integers(0, 256, (1, 8 * words), dtype=np.uint8)
    bad = page.copy()
    w = bad.view("<u4")
    i = index % w.shape[1]
    w[0, i] = (int(w[0, i]) + delta) & 0xFFFFFFFF
    assert checksum.checksums(page, Part.TARGET_KV, 0)[0] != checksum.checksums(bad, Part.TARGET_KV, 0)[0]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), flips=st.lists(st.integers(0, 42 * 1024 * 8 - 1), min_size=1, max_size=64,
                                                        unique=True))  # fmt: skip
def test_random_bit_flips_are_detected(seed: int, flips: list[int]) -> None:
    page = np.random.default_rng(seed).integers(0, 256, (1, 42 * 1024), dtype=np.uint8)
    bad = page.copy()
    for bit in flips:
        bad[0, bit // 8] ^= np.uint8(1 << (bit % 8))
    assert checksum.checksums(page, Part.DRAFT_KV, 0)[0] != checksum.checksums(bad, Part.DRAFT_KV, 0)[0]


def test_torn_swapped_and_misplaced_pages_are_detected() -> None:
    rng = np.random.default_rng(7)
    a, b = rng.integers(0, 256, (2, 1, 8448), dtype=np.uint8)
    base = checksum.checksums(a, Part.TARGET_STATE, 5)[0]
    torn = a.copy()
    torn[0, 4224:] = b[0, 4224:]  # the second half from another copy
    assert checksum.checksums(torn, Part.TARGET_STATE, 5)[0] != base
    halves = np.concatenate([a[:, 4224:], a[:, :4224]], axis=1)  # halves swapped
    assert checksum.checksums(halves, Part.TARGET_STATE, 5)[0] != base
    # The same bytes under another part or layer (a page moved with its checksum) never match.
    assert checksum.checksums(a, Part.TARGET_STATE, 6)[0] != base
    assert checksum.checksums(a, Part.DRAFT_STATE, 5)[0] != base
    zeros = np.zeros((2, 8448), dtype=np.uint8)
    assert checksum.checksums(zeros, Part.TARGET_STATE, 5)[0] != checksum.checksums(zeros, Part.TARGET_STATE, 4)[0]


def test_multipliers_are_odd_and_stable_as_they_grow() -> None:
    a, b = checksum.multipliers(10)
    assert (a & np.uint64(1)).all() and (b & np.uint64(1)).all()
    a2, b2 = checksum.multipliers(50_000)
    assert np.array_equal(a2[:10], a) and np.array_equal(b2[:10], b)
    with pytest.raises(ValueError, match="read-only"):
        a2[0] = 0


def test_page_bytes_must_be_words() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        checksum.checksums(np.zeros((1, 12), np.uint8), Part.TARGET_KV, 0)


def test_sample_positions() -> None:
    assert checksum.sample_positions(20, 3, checksum.Verify.ALL) is None
    assert len(checksum.sample_positions(20, 3, checksum.Verify.OFF)) == 0
    got = checksum.sample_positions(20, 3, checksum.Verify.SAMPLE)
    assert got.tolist() == [3, 11, 19]


@pytest.mark.parametrize("pages, page_bytes", [(3, 256), (40, 4096), (200, 4096)])
def test_raw_sums_of_a_layers_view_equal_each_layers_checksums(pages: int, page_bytes: int) -> None:
    # A [layers, pages, page_bytes] view of a pool-shaped buffer (a run of pages, no gather)
    # and a gather of scattered pages, written into a table given as `out`: the small
    # (matmul), whole-layers-per-step and one-layer-in-steps paths.
    buf = np.random.default_rng(pages).integers(0, 256, (5, 2 * pages + 3, page_bytes), dtype=np.uint8)
    view = buf[1:4, 2 : 2 + pages]
    assert not view.flags.c_contiguous
    table = np.zeros((5, pages), dtype=np.uint64)
    assert checksum.raw_sums(view, out=table[1:4]) is not None
    layers = [7, 8, 9]
    got = checksum.salted(table[1:4].copy(), Part.TARGET_KV, layers, page_bytes)
    for i, layer in enumerate(layers):
        assert np.array_equal(got[i], checksum.checksums(np.ascontiguousarray(view[i]), Part.TARGET_KV, layer))
    assert not table[0].any() and not table[4].any()  # only the rows given
    scattered = np.arange(0, 2 * pages, 2)
    by_layer = checksum.checksums_by_layer(buf[1:4, scattered], Part.TARGET_KV, layers, pages)
    for i, layer in enumerate(layers):
        assert np.array_equal(by_layer[i], checksum.checksums(buf[1 + i, scattered], Part.TARGET_KV, layer))
    assert int(got[0, 0]) == reference(view[0, 0].tobytes(), Part.TARGET_KV, 7)


@pytest.mark.parametrize("words", [8, 64, 512])
def test_the_three_paths_of_raw_sums_agree(words: int) -> None:
    # Page counts just under and over each path's bound in total words (matrix-vector
    # product, one einsum over the 32-bit words, steps): every page as it hashes alone.
    sizes = {checksum._SMALL_WORDS // words, checksum._SMALL_WORDS // words + 1,
             checksum._MID_WORDS // words, checksum._MID_WORDS // words + 1}  # fmt: skip
    for n in sorted(sizes):
        block = np.random.default_rng(n).integers(0, 256, (n, 8 * words), dtype=np.uint8)
        whole = checksum.raw_sums(block)
        alone = [int(checksum.raw_sums(block[i : i + 1])[0]) for i in (0, n // 2, n - 1)]
        assert [int(whole[i]) for i in (0, n // 2, n - 1)] == alone, n
        last = int(checksum.checksums(block[-1:], Part.DRAFT_KV, 2)[0])
        assert last == reference(block[-1].tobytes(), Part.DRAFT_KV, 2)
        layers = checksum.raw_sums(block[: n // 2 * 2].reshape(2, n // 2, 8 * words))
        assert np.array_equal(layers.reshape(-1), whole[: n // 2 * 2]), n


def test_raw_sums_takes_two_or_three_axes() -> None:
    with pytest.raises(ValueError, match="pages must be"):
        checksum.raw_sums(np.zeros((1, 1, 1, 8), np.uint8))
