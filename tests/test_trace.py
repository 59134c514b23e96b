"""Mooncake trace loading, validation, tokenisation and writing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hicache_harness.trace import (
    BLOCK_TOKENS,
    TraceError,
    TraceRequest,
    load_trace,
    request_tokens,
    tail_tokens,
    unique_blocks,
    write_trace,
)

SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"


def _line(**over: object) -> str:
    obj: dict[str, object] = {
        "timestamp": 0,
        "input_length": 1100,
        "output_length": 5,
        "hash_ids": [1, 2, 3],
    }
    obj.update(over)
    return json.dumps({k: v for k, v in obj.items() if v is not _DROP})


_DROP = object()


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def _req(i: int, ids: list[int], input_length: int | None = None) -> TraceRequest:
    n = len(ids) * BLOCK_TOKENS if input_length is None else input_length
    return TraceRequest(index=i, timestamp_ms=0.0, input_length=n, output_length=1,
                        hash_ids=tuple(ids))


# ----------------------------------------------------------------- shared trace


@pytest.mark.skipif(
    not SHARED_TRACE.exists(),
    reason=f"shared trace not present at {SHARED_TRACE} (the repo does not ship it)",
)
def test_shared_trace_first_50_lines() -> None:
    reqs = load_trace(SHARED_TRACE, limit=50)
    assert len(reqs) == 50
    assert [r.index for r in reqs] == list(range(50))
    first = reqs[0]
    assert first.timestamp_ms == 0.0
    assert first.input_length == 40160
    assert first.hash_ids == tuple(range(79))
    for r in reqs:
        assert len(r.hash_ids) == -(-r.input_length // BLOCK_TOKENS)
        assert r.session is None
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(reqs, reqs[1:]))


# -------------------------------------------------------------- malformed traces


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ('{"timestamp": 0, "input_length": 5,', "bad JSON"),
        (_line(output_length=_DROP), "missing field"),
        (_line(input_length=-1, hash_ids=[]), "'input_length' must be in [0, "),
        (_line(output_length=-3), "'output_length' must be in [0, "),
        (_line(hash_ids=[1, 2]), "'hash_ids' has 2 entries"),
        (_line(hash_ids=[1, 2.5, 3]), "'hash_ids'[1] must be an integer"),
        (_line(hash_ids=[1, "2", 3]), "'hash_ids'[1] must be an integer"),
        (_line(hash_ids=[1, -2, 3]), "'hash_ids'[1] must be in [0, 2**63)"),
        (_line(input_length=1100.0), "'input_length' must be an integer"),
        (_line(input_length=True), "'input_length' must be an integer"),
        (_line(timestamp="now"), "'timestamp' must be a number"),
        (_line(timestamp=-1), "'timestamp' must be finite and >= 0"),
        (_line(hash_ids="1,2,3"), "'hash_ids' must be a list"),
        ("[1, 2, 3]", "expected a JSON object"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, bad: str, needle: str) -> None:
    # Good line 1, blank line 2, good line 3, bad line 4, good line 5: the error
    # must point at line 4 (1-based, blank lines counted) and nothing is returned.
    p = _write(tmp_path, [_line(), "", _line(), bad, _line()])
    with pytest.raises(TraceError) as ei:
        load_trace(p)
    msg = str(ei.value)
    assert f"{p}:4:" in msg
    assert needle in msg
    assert isinstance(ei.value, ValueError)


def test_bad_line_after_limit_still_rejected(tmp_path: Path) -> None:
    p = _write(tmp_path, [_line(), _line(), "not json"])
    with pytest.raises(TraceError, match=r":3: bad JSON"):
        load_trace(p, limit=1)


@pytest.mark.parametrize("content", ["", "\n\n   \n"])
def test_empty_file_rejected(tmp_path: Path, content: str) -> None:
    p = tmp_path / "empty.jsonl"
    p.write_text(content)
    with pytest.raises(TraceError, match=r"empty.jsonl:1: trace has no requests"):
        load_trace(p)


def test_missing_file_is_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "nope.jsonl")


def test_zero_length_input_and_extra_fields(tmp_path: Path) -> None:
    p = _write(tmp_path, [_line(input_length=0, hash_ids=[], extra="ignored"), _line()])
    reqs = load_trace(p)
    assert reqs[0].input_length == 0 and reqs[0].hash_ids == ()
    assert reqs[1].index == 1
    assert len(request_tokens(reqs[0], 64)) == 0


def test_limit(tmp_path: Path) -> None:
    p = _write(tmp_path, [_line(timestamp=i) for i in range(5)])
    assert [r.timestamp_ms for r in load_trace(p, limit=2)] == [0.0, 1.0]
    assert len(load_trace(p, limit=0)) == 0
    with pytest.raises(ValueError):
        load_trace(p, limit=-1)


# ----------------------------------------------------------------------- tokens


def test_equal_ids_give_equal_tokens() -> None:
    a = request_tokens(_req(0, [7, 8, 9]), 64)
    b = request_tokens(_req(1, [7, 8, 10]), 64)
    assert a.dtype == np.int64 and len(a) == 3 * 64
    assert np.array_equal(a[:128], b[:128])  # shared blocks 7, 8
    assert not np.array_equal(a[128:], b[128:])  # 9 vs 10
    # a block's tokens do not depend on its position or neighbours
    c = request_tokens(_req(2, [8]), 64)
    assert np.array_equal(c, a[64:128])
    assert (a >= 0).all() and (a < 1 << 32).all()


def test_different_ids_differ_everywhere() -> None:
    toks = request_tokens(_req(0, list(range(200))), 16).reshape(200, 16)
    assert len({row.tobytes() for row in toks}) == 200
    assert len(np.unique(toks)) > 0.99 * toks.size


@pytest.mark.parametrize(
    ("input_length", "tpb", "expected"),
    [
        (1024, 64, 128),  # two full blocks
        (1024 + 256, 64, 128 + 32),  # half a block -> 32 of 64
        (1024 + 1, 64, 128 + 1),  # tiny tail -> at least one token
        (1024 + 511, 64, 128 + 63),  # nearly full tail stays partial
        (100, 1, 0 + 1),  # one token per block: tail gives one token
        (512 + 4, 64, 64 + 1),  # 0.5 rounds half up
        (0, 64, 0),
    ],
)
def test_lengths_with_partial_tails(input_length: int, tpb: int, expected: int) -> None:
    n_ids = -(-input_length // BLOCK_TOKENS)
    r = _req(0, list(range(100, 100 + n_ids)), input_length)
    toks = request_tokens(r, tpb)
    assert len(toks) == expected
    if n_ids and input_length % BLOCK_TOKENS:
        # the tail is a prefix of the same block's full tokens
        full = request_tokens(_req(1, [r.hash_ids[-1]]), tpb)
        assert np.array_equal(toks[r.full_blocks * tpb :], full[: len(toks) - r.full_blocks * tpb])


def test_tail_tokens_contract() -> None:
    assert tail_tokens(0, 64) == 0
    assert all(1 <= tail_tokens(t, 64) <= 63 for t in range(1, 512))
    assert all(tail_tokens(t, 512) == t for t in range(1, 512))
    with pytest.raises(ValueError):
        tail_tokens(512, 64)


def test_vocab_and_bad_args() -> None:
    toks = request_tokens(_req(0, [1, 2, 3]), 32, vocab_size=1000)
    assert toks.max() < 1000
    with pytest.raises(ValueError):
        request_tokens(_req(0, [1]), 0)
    with pytest.raises(ValueError):
        request_tokens(_req(0, [1]), 8, vocab_size=1)


# ------------------------------------------------------------ write / footprint


def test_write_load_round_trip(tmp_path: Path) -> None:
    reqs = [
        TraceRequest(0, 0.0, 1100, 5, (1, 2, 3)),
        TraceRequest(1, 12.5, 0, 0, ()),
        TraceRequest(2, 13.0, 1024, 7, (1, 2), session=4),
    ]
    p = tmp_path / "out.jsonl"
    p.write_text("old contents\n")
    write_trace(p, reqs)
    assert load_trace(p) == reqs
    assert [q.name for q in tmp_path.iterdir()] == ["out.jsonl"]  # temp file renamed
    assert unique_blocks(reqs) == 3


def test_write_failure_leaves_old_file(tmp_path: Path) -> None:
    p = tmp_path / "out.jsonl"
    p.write_text("keep\n")

    def gen() -> object:
        yield TraceRequest(0, 0.0, 512, 1, (1,))
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_trace(p, gen())  # type: ignore[arg-type]
    assert p.read_text() == "keep\n"
    assert [q.name for q in tmp_path.iterdir()] == ["out.jsonl"]
