"""`hicache-cp bench-sglang` (the race with SGLang's own HiCache) on CPU, and on CUDA where there is one.

On CPU the race runs SGLang's device tree (`radix`) and hicache-cp on SGLang's
real pools and scheduling functions, with the forward writing and checking
every byte through torch; SGLang's own HiCache cannot be built without CUDA
(its host pool registers memory with it), and the race records where it
stops. The GPU test runs all three backends; bench/device/sglang.sh runs it.

Small pools here: latent 64 + rope 16 (160 B a token a layer), 4 layers.
"""

from __future__ import annotations

import threading
import time
from array import array
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("sglang", reason="sglang not installed (scripts/install_sglang.sh)")

from hicache_harness.sglang.env import import_sglang  # noqa: E402

import_sglang()  # SGLang's configs package, on a CPU torch too (see hicache_harness.sglang.env)

from hicache_harness.bench.sglang_race import breakdown_table, run_backend, table  # noqa: E402
from hicache_harness.bench.sglang_race_forward import token_bytes_torch  # noqa: E402
from hicache_harness.bench.sglang_race_server import RaceServer, RaceSpec, SchedulerClock  # noqa: E402
from hicache_harness.sglang.kv_bytes import prefix_hashes, token_bytes  # noqa: E402
from hicache_harness.trace import TraceRequest  # noqa: E402

pytestmark = pytest.mark.slow  # importing SGLang costs ~10 s once per process

CUDA = torch.cuda.is_available()
SMALL = {"kv_lora_rank": 64, "rope_dim": 16, "layers": 4, "device_pages": 16, "dim": 32, "matmuls": 1,
         "chunk_tokens": 1024, "host_ratio": 4.0}  # fmt: skip


def req(i: int, blocks: tuple[int, ...], tail: int = 100) -> TraceRequest:
    return TraceRequest(index=i, timestamp_ms=float(i), input_length=len(blocks) * 512 + tail, output_length=1,
                        hash_ids=(*blocks, 1000 + i))  # fmt: skip


#: A prefix served, pushed out of a 15-page device pool by two others, then asked for again.
STREAM = [req(0, tuple(range(1, 7))), req(1, tuple(range(11, 17))), req(2, tuple(range(21, 27))),
          req(3, tuple(range(1, 7)))]  # fmt: skip


def spec(backend: str, **kw: object) -> RaceSpec:
    return RaceSpec(backend=backend, device="cuda" if CUDA else "cpu", **{**SMALL, **kw})  # type: ignore[arg-type]


def test_device_bytes_are_the_harness_bytes() -> None:
    rng = np.random.default_rng(0)
    hashes = prefix_hashes(rng.integers(0, 50_000, 300))
    device = torch.from_numpy(hashes.view(np.int64))
    for salt, width in ((0, 1152), (17 * 60 + 7, 132), (3, 5)):
        assert np.array_equal(token_bytes_torch(device, salt, width).numpy(), token_bytes(hashes, salt, width))


def test_the_clock_times_outermost_calls_on_its_thread_only() -> None:
    class Cache:
        def outer(self) -> None:
            self.inner()

        def inner(self) -> None:
            pass

    cache, clock = Cache(), SchedulerClock()
    clock.wrap(cache, ("outer", "inner", "absent"), "tree")
    cache.outer()
    cache.inner()
    other = threading.Thread(target=cache.outer)
    other.start()
    other.join()
    assert len(clock.seconds["tree.outer"]) == 1  # the other thread's call is not the scheduler's
    assert len(clock.seconds["tree.inner"]) == 1  # the call inside outer counts in outer only
    assert "tree.absent" not in clock.seconds
    assert clock.total() > 0


def test_the_clock_breaks_an_outer_call_down_into_the_inner_calls_it_makes() -> None:
    class Cache:
        def outer(self) -> None:
            self.inner()
            self.inner()

        def inner(self) -> None:
            pass

    cache, clock = Cache(), SchedulerClock()
    clock.wrap(cache, ("outer",), "tree")
    clock.wrap(cache, ("inner",), "cache", inner=True)
    cache.outer()
    other = threading.Thread(target=cache.outer)
    other.start()
    other.join()
    assert len(clock.inner_seconds["cache.inner"]) == 2  # both nested calls, none from the other thread
    assert list(clock.seconds) == ["tree.outer"]  # the outermost calls' total is not counted twice
    assert sum(clock.inner_seconds["cache.inner"]) <= clock.seconds["tree.outer"][0]  # parts of the outer call
    assert "cache.inner" in clock.inner_cpu_seconds


def test_the_clock_tells_a_calls_own_cpu_time_from_its_waiting() -> None:
    """A call that sleeps (as one waiting for the GIL or a host sync does) has wall time
    but almost no CPU time on the scheduler thread; one that computes has both."""

    class Cache:
        def waits(self) -> None:
            time.sleep(0.05)

        def computes(self) -> None:
            end = time.thread_time() + 0.05
            while time.thread_time() < end:
                pass

    cache, clock = Cache(), SchedulerClock()
    clock.wrap(cache, ("waits", "computes"), "tree")
    cache.waits()
    cache.computes()
    assert clock.seconds["tree.waits"][0] >= 0.05 and clock.cpu_seconds["tree.waits"] < 0.02
    assert clock.cpu_seconds["tree.computes"] >= 0.05


@pytest.mark.parametrize("pools", ["mla", "dsa"])
def test_hicache_cp_serves_the_evicted_prefix_from_host_with_every_byte_right(pools: str, tmp_path: Path) -> None:
    rows = {b: run_backend(spec(b, pools=pools), STREAM, tokens_per_block=64, workdir=tmp_path / b)
            for b in ("radix", "hicache-cp")}  # fmt: skip
    for backend, row in rows.items():
        assert "error" not in row, (backend, row.get("error"), row.get("traceback"))
        assert row["requests"] == len(STREAM)
        assert row["mismatched_bytes"] == 0
        # one request at a time, none aborted: every prompt token came from one place
        assert row["device_hit_tokens"] + row["host_hit_tokens"] + row["computed_tokens"] == row["prompt_tokens"]
        assert row["tree_cache_ms_per_request"] > 0 and "tree.match_prefix" in row["calls"]
        assert 0 < row["tree_cache_cpu_ms_per_request"] <= row["tree_cache_ms_per_request"] * 1.01
        assert row["idle_rounds"] == 0  # no round admitted nothing while a request waited (no stall)
    radix, ours = rows["radix"], rows["hicache-cp"]
    assert radix["host_hit_tokens"] == 0 and radix["device_hit_tokens"] == 0  # the prefix was evicted
    assert ours["host_hit_tokens"] == 6 * 64  # its six whole pages came back from host memory
    assert ours["checked_bytes"] >= 6 * 64 * 4 * 160  # at least the loaded pages, every layer
    assert ours["forwards_with_load"] >= 1 and ours["bytes_h2d"] > 0 and ours["bytes_d2h"] > 0
    assert "hook.wait_until" in ours["calls"] and ours["hook_ms_per_request"] > 0
    assert ours["host_pool_bytes"] <= ours["host_bytes_spec"]
    assert "| hicache-cp |" in table(list(rows.values()))


def test_the_breakdown_times_hicache_cps_inner_calls_within_its_outer_ones(tmp_path: Path) -> None:
    row = run_backend(spec("hicache-cp", breakdown=True), STREAM, tokens_per_block=64, workdir=tmp_path)
    assert "error" not in row, (row.get("error"), row.get("traceback"))
    inner, outer = row["inner_calls"], row["calls"]
    for name in ("copies.begin", "copies.reached", "cache.poll", "cache.match_prefix", "cache.reserve_host_copy",
                 "cache.on_layers_end", "cache.load_into"):  # fmt: skip
        assert inner[name]["calls"] > 0, name
    # the hooks' time holds the layer hook's; one load was planned, the backups' layers submitted
    assert inner["copies.reached"]["total_ms"] <= outer["hook.wait_until"]["total_ms"]
    assert inner["copies.reached"]["calls"] == outer["hook.wait_until"]["calls"]
    assert inner["cache.engine.submit_layer"]["calls"] + inner["cache.engine.submit_layers"]["calls"] > 0
    text = breakdown_table([row])
    assert "|   cache.poll |" in text and "| hook.wait_until |" in text


def test_a_variant_serves_under_its_switch_interval_and_engine_options(tmp_path: Path) -> None:
    """`--switch-interval` holds while serving only; `--io-option` reaches the copy engine
    hicache-cp's tree cache builds (the cpu engine takes none: the row records why)."""
    import sys

    from hicache_cp.io import cpu as cpu_io

    default = sys.getswitchinterval()
    seen: list[float] = []
    real = RaceServer.run_until_idle

    def watched(self: RaceServer) -> None:
        seen.append(sys.getswitchinterval())
        real(self)

    RaceServer.run_until_idle = watched  # type: ignore[method-assign]
    try:
        row = run_backend(spec("hicache-cp"), STREAM[:1], tokens_per_block=64, workdir=tmp_path / "a", switch_interval=0.0002)
    finally:
        RaceServer.run_until_idle = real  # type: ignore[method-assign]
    assert "error" not in row and row["switch_interval_s"] == 0.0002
    assert seen and all(abs(x - 0.0002) < 1e-9 for x in seen) and sys.getswitchinterval() == default
    row = run_backend(spec("hicache-cp"), STREAM[:1], tokens_per_block=64, workdir=tmp_path / "b",
                      io_options={"hook_worker_above": 7})  # fmt: skip
    assert row["io_options"] == {"hook_worker_above": 7} and row["phase"] == "construct"
    assert f"{cpu_io.CpuCopyEngine.__name__}.__init__() got an unexpected keyword argument 'hook_worker_above'" in row["error"]


def test_a_profiled_backend_writes_its_top_functions_as_text_beside_the_profile(tmp_path: Path) -> None:
    """A device run's files come back only as text: the .txt names the tree cache's calls."""
    prof = tmp_path / "embedded-mla-hicache-cp.prof"
    row = run_backend(spec("hicache-cp"), STREAM[:2], tokens_per_block=64, workdir=tmp_path / "w", profile=prof)
    assert "error" not in row and prof.stat().st_size > 0
    text = prof.with_suffix(".txt").read_text()
    assert "Ordered by: internal time" in text and "Ordered by: cumulative time" in text
    assert "flush_pending_backups" in text


def test_a_setting_reaches_hicache_cps_config_and_its_row(tmp_path: Path) -> None:
    from hicache_harness.bench.sglang_race_server import hicache_cp_env

    s = spec("hicache-cp", settings=(("backup_submits_per_forward", "3"),))
    assert hicache_cp_env(s)["HICACHE_BACKUP_SUBMITS_PER_FORWARD"] == "3"
    seen: list[int] = []
    real = RaceServer.run_until_idle

    def watched(self: RaceServer) -> None:
        seen.append(self.tree_cache.cache.config.backup_submits_per_forward)
        real(self)

    RaceServer.run_until_idle = watched  # type: ignore[method-assign]
    try:
        row = run_backend(s, STREAM[:1], tokens_per_block=64, workdir=tmp_path)
    finally:
        RaceServer.run_until_idle = real  # type: ignore[method-assign]
    assert "error" not in row and row["settings"] == {"backup_submits_per_forward": "3"}
    assert seen and set(seen) == {3}


def test_a_round_that_admits_nothing_fails_the_run_at_once(tmp_path: Path) -> None:
    """A prompt longer than the device pool is never admitted: the first round that admits
    nothing while it waits is a stall (nothing the race calls would change it), recorded as
    the row's error rather than 10,000 empty rounds."""
    long = [req(0, tuple(range(1, 7)), tail=4 * 64)]  # 3,328 tokens for a 15-page (960-token) pool
    row = run_backend(spec("radix"), long, tokens_per_block=512, workdir=tmp_path)
    assert row["phase"] == "serve" and row["error"].startswith("Stalled: radix: a round admitted none"), row


def test_a_wrong_byte_in_a_reused_prefix_is_counted(tmp_path: Path) -> None:
    server = RaceServer(spec("radix", device_pages=40), tmp_path)
    try:
        tokens = [int(t) for t in np.random.default_rng(1).integers(1, 900, 3 * 64 + 5)]
        server.submit(tokens, rid="a")
        server.run_until_idle()
        match = server.tree_cache.match_prefix(_match(tokens))
        slots = server.tree_cache.path_device_indices(match.last_device_node)
        kv = server.target.kv_buffer[2]
        kv.view(torch.uint8).view(kv.shape[0], -1)[slots[70], 0] ^= 1  # one byte of a cached token, layer 2
        server.submit(tokens, rid="b")
        server.run_until_idle()
        assert server.forward.mismatches() == {"b": 1}
    finally:
        server.close()


def _match(tokens: list[int]):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return MatchPrefixParams(key=RadixKey(array("q", tokens)))


@pytest.mark.skipif(CUDA, reason="on CUDA SGLang's HiCache builds (test_the_race_on_cuda)")
def test_sglangs_hicache_is_built_as_far_as_a_cpu_allows(tmp_path: Path) -> None:
    row = run_backend(spec("sglang-hicache", tree_core="python"), STREAM[:1], tokens_per_block=64, workdir=tmp_path)
    assert row.get("phase") == "construct", row
    assert "_cuda_host_register" in row["at"] or "cuda" in row["error"].lower(), row


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA (bench/device/sglang.sh)")
def test_the_race_on_cuda(tmp_path: Path) -> None:
    rows = []
    for pools in ("mla", "dsa"):
        for backend in ("radix", "hicache-cp", "sglang-hicache"):
            # SGLang's Python tree core: its Rust one, built against another torch, panics on the image's.
            s = spec(backend, pools=pools, kv_lora_rank=512, rope_dim=64, dim=1024, tree_core="python")
            rows.append(run_backend(s, STREAM, tokens_per_block=64, workdir=tmp_path / f"{pools}-{backend}"))
    print(table(rows))
    ran = [r for r in rows if "error" not in r]
    assert all(r["mismatched_bytes"] == 0 for r in ran), table(rows)
    hit = [r for r in ran if r["host_hit_tokens"] + r["device_hit_tokens"]]  # the forward reads back what hit
    assert hit and all(r["checked_bytes"] > 0 for r in hit), table(rows)
    by = {(r["pools"], r["backend"]): r for r in rows}
    for pools in ("mla", "dsa"):
        assert by[(pools, "hicache-cp")].get("host_hit_tokens") == 6 * 64, by[(pools, "hicache-cp")]
    sglang_mla = by[("mla", "sglang-hicache")]
    assert "error" not in sglang_mla, sglang_mla  # MLA with io backend kernel runs SGLang's JIT kernels only
    assert sglang_mla["host_hit_tokens"] > 0 and sglang_mla["tree_core"]
    assert sglang_mla["host_hit_tokens"] + sglang_mla["device_hit_tokens"] == 6 * 64
    sglang_dsa = by[("dsa", "sglang-hicache")]  # its indexer pool loads through sgl-kernel, not here
    assert "error" not in sglang_dsa or "sgl_kernel" in sglang_dsa["error"], sglang_dsa


def test_the_race_spec_refuses_what_it_cannot_build() -> None:
    with pytest.raises(ValueError, match="backend 'lmcache'"):
        RaceSpec(backend="lmcache")
    with pytest.raises(ValueError, match="pools 'mamba'"):
        replace(RaceSpec(backend="radix"), pools="mamba")


def test_mha_pools_are_written_and_checked_in_k_and_v(tmp_path: Path) -> None:
    """A Llama's pools (K and V per layer): the device tree's hits are checked in both."""
    row = run_backend(spec("radix", pools="mha", kv_heads=2, head_dim=32, device_pages=40), STREAM,
                      tokens_per_block=64, workdir=tmp_path)  # fmt: skip
    assert "error" not in row, row
    assert row["device_hit_tokens"] == 6 * 64 and row["mismatched_bytes"] == 0
    assert row["checked_bytes"] == 6 * 64 * 4 * 2 * (2 * 32 * 2)  # the reused pages, 4 layers, K and V


@pytest.mark.parametrize(("argv", "message"), [
    (["--limit", "0"], "--limit must be > 0"),
    (["--host-ratio", "nan"], "--host-ratio must be a finite number"),
    (["--trace", "/no/such/trace.jsonl"], "--trace /no/such/trace.jsonl: no such file"),
    (["--device", "tpu"], "--device 'tpu': expected auto, cpu, cuda or cuda:N"),
    (["--io-option", "hook_worker_above"], "--io-option 'hook_worker_above': expected KEY=INT"),
    (["--io-option", "chunk=big"], "--io-option 'chunk=big': expected KEY=INT"),
    (["--switch-interval", "0"], "--switch-interval 0.0: must be in (0, 1] seconds"),
    (["--setting", "no_such_field=1"], "--setting 'no_such_field=1': expected FIELD=VALUE"),
    (["--setting", "backup_submits_per_forward"], "--setting 'backup_submits_per_forward': expected FIELD=VALUE"),
    (["--setting", "backup_submits_per_forward=0"], "--setting 'backup_submits_per_forward=0': expected FIELD=VALUE"),
])  # fmt: skip
def test_bad_flags_exit_2_before_any_work(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from hicache_harness.cli import main

    assert main(["bench-sglang", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_trace_is_looked_for_beside_the_checkout() -> None:
    """A device call carries the trace in .devdata at the checkout's root; CI has the shared folder beside it."""
    from hicache_harness.bench import sglang_race

    root = Path(__file__).resolve().parents[1]
    assert sglang_race.TRACES[:2] == (root / ".devdata" / "synthetic_trace.jsonl",
                                      root.parent / "shared" / "traces" / "synthetic_trace.jsonl")  # fmt: skip
