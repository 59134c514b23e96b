"""hicache-cp's KV events through SGLang 0.5.23's own publisher, decoded with SGLang's classes.

The harness server (`hicache_harness.sglang.server`: SGLang's own
scheduling functions, pools and `--radix-cache-backend hicache-cp`) runs with
`enable_kv_cache_events`: SGLang's radix cache records its GPU-tier events
and the plug-in hands its L2 events (medium CPU_PINNED) to the same recorder.
SGLang's `SchedulerKvEventsPublisher` takes them after every scheduler step
(`tree_cache.take_events()`) and publishes them with its `ZmqEventPublisher`
on 127.0.0.1; a ZMQ subscriber decodes the batches with
`msgspec.msgpack.Decoder(sglang...kv_events.KVEventBatch)`.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sglang", reason="sglang not installed (scripts/install_sglang.sh)")

from events_support import Subscriber, WireReplay  # noqa: E402

from hicache_harness.sglang.env import import_sglang  # noqa: E402
from hicache_harness.sglang.server import SGLangPrefillServer, ServerSpec  # noqa: E402

import_sglang()
from sglang.srt.disaggregation.kv_events import KVEventBatch, StorageMedium  # noqa: E402
from sglang.srt.managers.scheduler_components.kv_events_publisher import SchedulerKvEventsPublisher  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from hicache_cp.integrations.sglang.events import SGLangKeyer  # noqa: E402
from hicache_cp.radix import HostState  # noqa: E402

pytestmark = pytest.mark.slow

PAGE = 64
TOKEN_BYTES = 4 * 160 + 2 * 132 + 160 + 132
CPU, GPU = StorageMedium.CPU.value, StorageMedium.GPU.value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(tmp_path: Path):
    """A harness server with KV events on, SGLang's scheduler-side publisher on 127.0.0.1, a subscriber."""
    made: list[tuple[SGLangPrefillServer, SchedulerKvEventsPublisher]] = []

    def factory(l2_pages: int, device_pages: int):
        env = {
            "HICACHE_HOST_BUDGET_BYTES": str((l2_pages + 1) * TOKEN_BYTES * PAGE), "HICACHE_IO_BACKEND": "cpu",
            "HICACHE_DEBUG_CHECKS": "true", "HICACHE_PIN_HOST": "false", "HICACHE_L2_FREE_ROOM": "0",
        }  # fmt: skip
        spec = ServerSpec(kv_events=True, device_pages=device_pages)
        server = SGLangPrefillServer(spec, tmp_path / f"s{len(made)}", tree_cache_kwargs={"env": env})
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        # This process's place in SGLang's parallel groups (its scheduler publishes it): one rank of everything.
        with get_parallel().override(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0,
                                     dp_rank=0):  # fmt: skip
            publisher = SchedulerKvEventsPublisher(
                kv_events_config=json.dumps({"publisher": "zmq", "endpoint": endpoint, "bind": True}),
                tree_cache=server.tree_cache, send_metrics_from_scheduler=None, max_running_requests=spec.max_requests,
                max_total_num_tokens=(device_pages - 1) * PAGE, get_stats=lambda: None,
            )  # fmt: skip
        assert publisher.enable_kv_cache_events
        made.append((server, publisher))
        return server, publisher, Subscriber(endpoint, KVEventBatch)

    yield factory
    for server, publisher in made:
        server.close()
        if publisher.kv_event_publisher._running:  # not shut down by the test already
            publisher.kv_event_publisher.shutdown()


def serve_all(server: SGLangPrefillServer, publisher: SchedulerKvEventsPublisher, prompts: list[list[int]]) -> None:
    """Each prompt to completion, publishing after every scheduler step as SGLang's event loop does."""
    for tokens in prompts:
        server.submit(tokens)
        while server.waiting or server.chunked_req is not None:
            server.step()
            publisher.publish_kv_events()
        server.settle()
        publisher.publish_kv_events()


def held_in_l2(server: SGLangPrefillServer) -> set[int]:
    """The plug-in's committed L2 blocks, keyed from its tree with SGLang's hash."""
    keyer, out = SGLangKeyer(), set()
    stack = [(c, None) for c in server.tree_cache.cache.tree.root.children.values()]
    while stack:
        node, parent = stack.pop()
        keys = keyer.chain(parent, node.tokens, PAGE)
        if node.host_state is HostState.COMMITTED:
            out.update(k[0] for k in keys)
        stack.extend((c, keys[-1]) for c in node.children.values())
    return out


def workload(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts over 4 shared prefixes of 2 pages, each with 1-3 more pages and a partial one."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(1, 900, 2 * PAGE).tolist() for _ in range(4)]
    return [prefixes[int(rng.integers(0, 4))] + rng.integers(1, 900, int(rng.integers(1, 4)) * PAGE + 9).tolist()
            for _ in range(n)]  # fmt: skip


def test_sglang_publishes_l2_blocks_that_rebuild_the_cache_and_join_its_gpu_blocks(served) -> None:
    server, publisher, sub = served(l2_pages=12, device_pages=16)
    serve_all(server, publisher, workload(24))
    assert server.forward.report.mismatched_bytes == 0
    stats = server.tree_cache.cache.stats()
    assert stats["evictions_l2"] > 0 and stats["backups_committed"] > 0  # stored and removed blocks both
    want = held_in_l2(server)
    publisher.kv_event_publisher.shutdown()  # sends what it queued
    replay = WireReplay().apply_batches(sub.drain())
    got = replay.of(CPU)
    assert got == want and want, f"{len(got - want)} announced but not in L2, {len(want - got)} in L2 but not announced"
    # The join: the hash of every L2 block is the one SGLang's own GPU-tier events gave that page.
    assert replay.ever[CPU] <= replay.ever[GPU]


def test_sglang_reset_clears_every_tier_and_l2_blocks_come_back_after_it(served) -> None:
    server, publisher, sub = served(l2_pages=32, device_pages=32)
    serve_all(server, publisher, workload(4, seed=1))
    assert held_in_l2(server)
    server.tree_cache.reset()  # SGLang's flush_cache
    publisher.publish_kv_events()
    assert not held_in_l2(server)
    serve_all(server, publisher, workload(2, seed=2))
    want = held_in_l2(server)
    publisher.kv_event_publisher.shutdown()
    replay = WireReplay().apply_batches(sub.drain())
    assert replay.cleared >= 2  # at start and at the reset (SGLang's own and hicache-cp's)
    assert replay.of(CPU) == want and want


def test_the_keyer_gives_sglangs_hashes_and_their_int64() -> None:
    from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

    tokens = np.arange(5 * PAGE, dtype=np.int64) * 7 % 911
    keys = SGLangKeyer().chain(None, tokens, PAGE)
    assert [h for _, h in keys] == get_hash_str(tokens.tolist(), None, page_size=PAGE)
    assert [i for i, _ in keys] == [hash_str_to_int64(h) for _, h in keys]
    tail = SGLangKeyer().chain(keys[1], tokens[2 * PAGE :], PAGE)
    assert tail == keys[2:]  # chained on the parent's key, as SGLang chains a child node on its parent
