"""Tests for `hicache-cp bench-pinning` (hicache_harness.bench.pinning).

On CPU the benchmark runs its arena parts unpinned: these tests run it for
real at a few MiB and check the JSON it writes, the exit status on a clean
run, on a real failure and on bad input. The CUDA parts run on the device
(bench/device/pinning.sh).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_harness.bench import pinning
from hicache_harness.bench.pinning import BenchInputError, Variant, main, parse_variant
from hostmem.arena import TouchMode
from hostmem.cuda import cuda_available
from hostmem.mapping import HugePages

SMALL = ["--gib", "0.0625,0.03125", "--chunk-gib", "0.015625", "--copy-gib", "0.015625", "--repeats", "2"]


def test_parse_variant() -> None:
    assert parse_variant("default") == Variant("default")
    v = parse_variant("thp:populate:r4:t12")
    assert (v.huge_pages, v.touch, v.register_threads, v.touch_threads) == (HugePages.THP, TouchMode.POPULATE, 4, 12)
    assert v.kwargs() == {"huge_pages": HugePages.THP, "touch": TouchMode.POPULATE, "register_threads": 4, "touch_threads": 12}
    assert parse_variant("none:write").kwargs() == {"huge_pages": HugePages.NONE, "touch": TouchMode.WRITE}
    assert parse_variant("thp:none:c0.5").kwargs()["register_chunk_bytes"] == 1 << 29
    for bad in ("thp", "big:populate", "thp:poke", "thp:none:r0", "thp:none:x4", "thp:none:r2:r3", "thp:none:c0", "thp:none:c1e-9"):
        with pytest.raises(BenchInputError, match="HUGE:TOUCH"):
            parse_variant(bad)


@pytest.mark.skipif(cuda_available(), reason="the CPU path; the device runs the CUDA one")
def test_cpu_run_is_clean_and_writes_provenance(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sub" / "pinning.json"
    rc = main([*SMALL, "--variants", "thp:write:r2,none:populate:r1:t1:c0.00390625", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["command"].startswith("hicache-cp bench-pinning") and r["machine"] and "commit" in r
    assert r["cuda"] is False and r["gpu"] is None and "errors" not in r and r["targets"] == {}
    assert "split_at_chunks" in r["cross_chunk_limit"]  # documented, not an error
    first, second = r["sizes"]
    assert [row["variant"] for row in first["default"]] == ["default", "default"]
    assert [row["variant"] for row in first["variants"]] == ["thp:write:r2", "none:populate:r1:t1:c0.00390625"]
    assert second["variants"] == []  # the sweep runs at the first size only
    v = first["variants"][1]
    assert v["touch_threads"] == 1 and v["huge_pages"] == "none" and v["chunk_gib"] == 0.00390625
    for row in first["default"] + first["variants"] + second["default"]:
        assert 0 < row["first_chunk_s"] <= row["ready_s"]
        assert 0.0 <= row["huge_coverage"] <= 1.0 and row["dontfork"] is True
        assert row["close_s"] is not None and row["register_threads"] == 0  # unpinned here
    assert first["variants"][1]["huge_coverage"] == 0.0  # base pages asked for
    assert first["best_variant"] in {"default", "thp:write:r2", "none:populate:r1:t1:c0.00390625"}
    assert "warmup_s" in first and "cuda_host_alloc" not in first and first["bandwidth"] == {}
    table = capsys.readouterr().out
    assert "bench-pinning on CPU only" in table and "cross-chunk limit" in table
    assert not list(out.parent.glob(".*.tmp"))  # the atomic write leaves no temporary file


def test_a_failed_measurement_is_recorded_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = pinning._measure_arena

    def broken(run, nbytes, variant, keep=None):  # type: ignore[no-untyped-def]
        if variant.name == "none:write:r1":
            raise OSError(12, "Cannot allocate memory")
        return real(run, nbytes, variant, keep)

    monkeypatch.setattr(pinning, "_measure_arena", broken)
    out = tmp_path / "p.json"
    rc = main([*SMALL, "--repeats", "1", "--no-warmup", "--variants", "none:write:r1,thp:write:r1", "--json", str(out)])
    assert rc == 1
    r = json.loads(out.read_text())
    assert list(r["errors"]) == ["0.0625GiB/none:write:r1"] and "Cannot allocate memory" in r["errors"]["0.0625GiB/none:write:r1"]
    assert [v["variant"] for v in r["sizes"][0]["variants"]] == ["thp:write:r1"]  # the others still ran


def test_a_pool_that_does_not_fit_is_skipped_not_attempted(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    rc = main([*SMALL, "--repeats", "1", "--reserve-gib", "100000", "--variants", "thp:write:r1", "--json", str(out)])
    assert rc == 1  # nothing required was measured
    r = json.loads(out.read_text())
    assert all(e.startswith("skipped: needs") for e in r["errors"].values())
    assert r["sizes"][0]["default"] == [] and "thp:write:r1" in r["sizes"][0]["skipped"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gib", "0"], "--gib"),
        (["--gib", "sixty"], "--gib"),
        (["--gib", "inf"], "--gib"),
        (["--chunk-gib", "0"], "--chunk-gib"),
        (["--chunk-gib", "0.000001"], "4 KiB pages"),
        (["--repeats", "0"], "--repeats"),
        (["--variants", "thp:fast"], "--variants"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "never.json"
    assert main([*argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists()


def test_json_path_that_is_a_directory_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--gib", "0.01", "--json", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
def test_gpu_run_is_clean_and_measures_both_pools(tmp_path: Path) -> None:
    """The CUDA path at a small size: pinned arenas, cudaHostAlloc, bandwidth from both pools."""
    out = tmp_path / "pinning.json"
    rc = main([*SMALL, "--variants", "thp:none:r4,thp:populate:r1", "--json", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0, r.get("errors")
    assert r["cuda"] is True and r["gpu"] and r["cuda_driver"] and "errors" not in r
    first = r["sizes"][0]
    assert {"arena", "cuda_host_alloc", "pageable"} <= set(first["bandwidth"])
    assert first["bandwidth"]["arena"]["copies"] == 1  # 16 MiB copy in one 16 MiB chunk
    assert first["cuda_host_alloc"]["alloc_s"] > 0 and "speedup" in first and "bandwidth_ratio" in first
    assert all(row["register_threads"] > 0 and row["ready_s"] > 0 for row in first["default"] + first["variants"])
    assert set(r["targets"]) >= {"gib", "no_errors"} and r["targets"]["no_errors"] is True
