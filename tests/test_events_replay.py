"""`replay --kv-events`: the stream a subscriber decodes with the engine's own classes rebuilds the cache.

Over the shared trace and the embedded workload, in SGLang's and vLLM's
formats: a ZMQ subscriber on 127.0.0.1 decodes every batch with the
engine's `KVEventBatch` decoder and rebuilds the blocks per medium; the
report carries what the cache held at the end (keyed from its tree, not from
the log): the two must be equal, block for block (0 differences).
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from events_support import SHARED_TRACE, Subscriber, WireReplay
from hicache_harness import kv_events
from hicache_harness.cli import main


pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch_type(fmt: str):  # type: ignore[no-untyped-def]
    if fmt == "sglang":
        pytest.importorskip("sglang", reason="sglang not installed")
        from sglang.srt.disaggregation.kv_events import KVEventBatch
    else:
        pytest.importorskip("vllm.distributed.kv_events", reason="vLLM not installed")
        from vllm.distributed.kv_events import KVEventBatch
    return KVEventBatch


@pytest.mark.parametrize("workload", ["embedded", "trace"])
@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_replay_stream_rebuilds_every_tier_exactly(fmt: str, workload: str, tmp_path: Path, monkeypatch) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = Subscriber(endpoint, batch_type(fmt))
    real_init = kv_events.KVEventPublisher.__post_init__

    def init_then_let_the_subscriber_join(self) -> None:  # type: ignore[no-untyped-def]
        real_init(self)
        time.sleep(0.5)  # the subscriber (connected before the bind) reconnects: no batch is sent before

    monkeypatch.setattr(kv_events.KVEventPublisher, "__post_init__", init_then_let_the_subscriber_join)
    out = tmp_path / "report.json"
    argv = ["replay", "--kv-events", endpoint, "--kv-events-format", fmt, "--json", str(out)]
    if workload == "trace":
        if SHARED_TRACE is None:
            pytest.skip("the public trace (shared/traces/synthetic_trace.jsonl beside the checkout) is not here")
        argv += ["--trace", str(SHARED_TRACE)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    replay = WireReplay().apply_batches(sub.drain())
    ev = report["kv_events"]
    assert ev["batches"] == len(sub.batches) and ev["format"] == fmt
    assert report["evictions_l2"] > 0 and report["evictions_l1"] > 0
    assert replay.cleared == 1  # the new cache's AllBlocksCleared, first
    for medium, want in ev["resident"].items():
        got = sorted(replay.of(medium), key=repr)
        assert len(got) == want["blocks"] > 0, f"{medium}: rebuilt {len(got)} blocks, the cache holds {want['blocks']}"
        assert kv_events.digest(got) == want["digest"], f"{medium}: the rebuilt blocks differ from the cache's"


def test_kv_events_flags_are_checked_before_any_work(capsys) -> None:
    assert main(["replay", "--kv-events", "tcp://0.0.0.0:5557"]) == 2
    assert "loopback" in capsys.readouterr().err
    assert main(["replay", "--kv-events-format", "vllm", "--limit", "1"]) == 2
    assert "needs --kv-events" in capsys.readouterr().err
