"""Tests for bench-alloc on small pools: the record, the peers, the workload, the errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from hicache_harness.bench import alloc as bench
from hicache_harness.bench import alloc_peers as peers
from hicache_harness.bench.alloc_workload import FREE, RESERVE, SizeSource, make_workload
from hicache_harness.trace import TraceRequest, write_trace

# 122 pages of 64 KiB and 30 of 256 KiB; 1024-token pages keep requests at 1..190 pages.
SMALL = ["--pool-gib", "0.0075", "--page-bytes", "65536,262144", "--page-tokens", "1024",
         "--ops", "400", "--warmup-ops", "100", "--block-ops", "150", "--sample-reserves", "4"]  # fmt: skip
ALLOCATORS = {"ours", "ours_lane", "slot_list_lazy", "page_free_list", "slot_list_eager"}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def run_json(tmp_path: Path, argv: list[str]) -> dict:
    out = tmp_path / "res" / "alloc.json"
    assert bench.run(parse([*argv, "--json", str(out)])) == 0
    return json.loads(out.read_text())


def test_small_run_writes_the_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(tmp_path, SMALL)
    for key in ("pool_gib", "page_bytes", "pages", "sglang", "workload", "allocators", "units",
                "speedup_vs_slot_list_lazy", "speedup_vs_page_free_list", "speedup_vs_slot_list_eager",
                "lane_speedup_vs_page_free_list", "commit", "machine", "command", "load_average"):  # fmt: skip
        assert key in result, key
    assert [u["page_bytes"] for u in result["units"]] == [65536, 262144]
    assert result["allocators"] == result["units"][0]["allocators"]
    for unit in result["units"]:
        allocators = unit["allocators"]
        assert set(allocators) == ALLOCATORS
        w = unit["workload"]
        assert w["timed_ops"] == 400 and w["timed_reserves"] + w["timed_frees"] == 400
        for name, stats in allocators.items():
            assert stats["ops"] == 400, name  # the same count for every allocator
            assert stats["reserves"] == w["timed_reserves"] and stats["frees"] == w["timed_frees"]
            assert stats["reserve_p50_us"] > 0 and stats["reserve_p99_us"] >= stats["reserve_p50_us"]
            assert stats["runs_per_reserve"] >= 1 and stats["label"]
            hist_pages = sum(p for _, p in stats["run_length_histogram"].values())
            assert hist_pages == stats["pages_reserved"]
            assert len(stats["sample_runs"]) == 4
        served = {stats["pages_reserved"] for stats in allocators.values()}
        assert len(served) == 1 and served.pop() > 0  # same ops, same pages served
        # Sampled reservations are the same ones for every allocator: same page counts.
        counts = {name: [sum(k for _, k in runs) for runs in s["sample_runs"]] for name, s in allocators.items()}
        assert len({tuple(c) for c in counts.values()}) == 1
        # The lazy lists hand out the same pages whatever the granularity: one set of runs.
        assert allocators["slot_list_lazy"]["sample_runs"] == allocators["page_free_list"]["sample_runs"]
        assert allocators["ours"]["runs_per_reserve"] == allocators["ours_lane"]["runs_per_reserve"]
        assert allocators["ours"]["runs_per_reserve"] <= allocators["page_free_list"]["runs_per_reserve"]
    out = capsys.readouterr().out
    assert "slot_list_lazy" in out and "page_free_list" in out and "wrote" in out


def test_without_sglang_the_reimplementation_runs_labelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = (None, {"impl": "reimplementation", "reason": "sglang is not installed (test)"})
    monkeypatch.setattr(bench, "load_sglang_host_kv_cache", lambda: missing)
    result = run_json(tmp_path, [*SMALL[:3], "65536", *SMALL[4:]])
    assert result["sglang"] == missing[1]
    assert "re-implementation" in result["allocators"]["slot_list_lazy"]["label"]
    assert "RE-IMPLEMENTATION (sglang is not installed (test))" in capsys.readouterr().out


def test_sglang_missing_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def not_found(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_found)
    cls, info = peers.load_sglang_host_kv_cache()
    assert cls is None and info["impl"] == "reimplementation" and "not installed" in info["reason"]


def test_reimplementation_matches_sglang_as_shipped() -> None:
    """The fallback hands out exactly the pages SGLang's own HostKVCache does."""
    cls, info = peers.load_sglang_host_kv_cache()
    if cls is None:
        pytest.skip(f"sglang not importable: {info['reason']}")
    w = make_workload(pool_pages=60, sizes=SizeSource.builtin(), page_tokens=2048, timed_ops=300,
                      warmup_ops=0, free_room=0.05, hits=1.0, split=0.5, seed=4)  # fmt: skip
    real = peers.SlotListLazy(60, 64, cls, "real")
    mine = peers.SlotListLazy(60, 64, None, "reimplementation")
    held: dict[int, list] = {}
    for kind, ident, lo, hi in w.ops.tolist():
        if kind == RESERVE:
            held[ident] = [real.reserve(hi), mine.reserve(hi)]
            assert held[ident][0].tolist() == held[ident][1].tolist()
        else:
            for adapter, handle in zip((real, mine), held[ident]):
                adapter.free(adapter.piece(handle, lo, hi))
    real.check()
    mine.check()


def test_workload_is_eviction_like_and_seeded() -> None:
    kw = dict(pool_pages=400, sizes=SizeSource.builtin(), page_tokens=512, timed_ops=2000,
              warmup_ops=100, free_room=0.02, hits=1.0, split=0.3)  # fmt: skip
    w = make_workload(seed=1, **kw)
    assert np.array_equal(w.ops, make_workload(seed=1, **kw).ops)
    assert not np.array_equal(w.ops, make_workload(seed=2, **kw).ops)
    live: dict[int, int] = {}  # entry -> pages not yet freed
    order: list[int] = []  # entries by reservation
    used, non_fifo, pieces = 0, 0, 0
    for kind, ident, lo, hi in w.ops.tolist():
        if kind == RESERVE:
            assert lo == 0 and hi >= 1
            live[ident] = hi
            order.append(ident)
            used += hi
            assert w.pool_pages - used >= 0.02 * w.pool_pages - 1e-9  # eviction keeps the free room
        else:
            assert kind == FREE and 0 <= lo < hi and ident in live
            oldest = next(i for i in order if i in live)
            non_fifo += ident != oldest
            pieces += hi - lo != live[ident] or lo != 0
            live[ident] -= hi - lo
            used -= hi - lo
            if not live[ident]:
                del live[ident]
    assert non_fifo > 100 and pieces > 50  # hits reorder eviction; splits free pieces
    d = w.describe()
    assert d["timed_ops"] == 2000 and d["timed_split_frees"] > 0


def test_sizes_come_from_a_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [
        TraceRequest(i, float(i), n, 1, tuple(range(-(-n // 512))))
        for i, n in enumerate([100, 3000, 20000, 0, 700])
    ])  # fmt: skip
    sizes = SizeSource.from_trace(trace)
    assert sorted(sizes.tokens.tolist()) == [100, 700, 3000, 20000]  # empty prompts dropped
    drawn = sizes.draw(np.random.default_rng(0), 200)
    assert set(drawn.tolist()) == {100, 700, 3000, 20000}
    result = run_json(tmp_path, [*SMALL[:3], "262144", *SMALL[4:], "--trace", str(trace)])
    assert str(trace) in result["workload"]["sizes"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--pool-gib", "0"],
        ["--pool-gib", "-1"],
        ["--pool-gib", "0.00001"],  # smaller than two pages
        ["--page-bytes", "0"],
        ["--page-bytes", "4096,-8"],
        ["--ops", "0"],
        ["--page-tokens", "0"],
        ["--free-room", "1"],
        ["--split", "2"],
        ["--hits", "nan"],
        ["--cp-size", "0"],
        ["--trace", "/nonexistent/trace.jsonl"],
    ],
)
def test_bad_input_exits_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from hicache_harness.cli import main

    assert main(["bench-alloc", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "error:" in err and "Traceback" not in err


def test_module_entry_point(tmp_path: Path) -> None:
    argv = [*SMALL[:3], "65536", *SMALL[4:], "--ops", "60", "--json", str(tmp_path / "r.json")]
    assert bench.main(argv) == 0
    assert json.loads((tmp_path / "r.json").read_text())["allocators"]["ours"]["ops"] == 60
