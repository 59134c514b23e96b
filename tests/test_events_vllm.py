"""hicache-cp's KV events through vLLM 0.33's own event path, decoded with vLLM's classes.

vLLM's real `Scheduler` (the bench of test_vllm_bench) runs with
`kv_events_config` on: each step it takes its block pool's GPU events and the
connector's (`take_events`: hicache-cp's L2 blocks, medium CPU) and publishes
them with its own `ZmqEventPublisher`. A ZMQ subscriber decodes the batches
with `msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)`.

Skipped where vLLM is not installed (`scripts/install_vllm.sh`); CI installs it.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base", reason="vLLM not installed (scripts/install_vllm.sh)"
)

import test_vllm_bench as H  # noqa: E402
from events_support import Subscriber, WireReplay  # noqa: E402
from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_GPU, KVEventBatch  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from hicache_cp.integrations.vllm.events import VLLMKeyer  # noqa: E402
from hicache_cp.radix import HostState  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return H.write_model_dir(tmp_path_factory.mktemp("tiny-deepseek"))


@pytest.fixture
def events_bench(model_dir, tmp_path, monkeypatch):
    """A CPU bench whose vLLM config publishes KV events on an ipc endpoint, and a subscriber."""
    endpoint = f"ipc://{tmp_path}/kv-events"
    real = H.vllm_config

    def with_events(*args, **kw):
        vc = real(*args, **kw)
        vc.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
        return vc

    monkeypatch.setattr(H, "vllm_config", with_events)
    made = []

    def make(**kw):
        bench = H.make_bench(model_dir, **kw)
        made.append(bench)
        return bench, Subscriber(endpoint, KVEventBatch)

    yield make
    for b in made:
        b.close()


def held_in_l2(bench) -> set:
    """The hashes of the L2 blocks the scheduler side's cache holds, keyed from its tree."""
    keyer, ps = VLLMKeyer("sha256"), H.BLOCK
    out: set = set()
    stack = [(c, None) for c in bench.cache.tree.root.children.values()]
    while stack:
        node, parent = stack.pop()
        keys = keyer.chain(parent, node.tokens, ps)
        if node.host_state is HostState.COMMITTED:
            out.update(maybe_convert_block_hash(k) for k in keys)
        stack.extend((c, keys[-1]) for c in node.children.values())
    return out


def workload(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts over 5 shared prefixes of 3 blocks, each with 1-4 more blocks and 5 tokens."""
    rng = np.random.default_rng(seed)
    prefixes = [list(range(1000 * f + 1, 1000 * f + 1 + 3 * H.BLOCK)) for f in range(5)]
    out = []
    for i in range(n):
        tail = rng.integers(1, 999, size=int(rng.integers(1, 5)) * H.BLOCK + 5).tolist()
        out.append(prefixes[int(rng.integers(0, 5))] + [t + 100_000 * (i % 3) for t in tail])
    return out


def test_vllm_publishes_l2_blocks_that_rebuild_the_cache_and_join_its_gpu_blocks(events_bench) -> None:
    bench, sub = events_bench(num_blocks=24, host_pages=20)
    for prompt in workload(40):
        bench.add(prompt)
        bench.run()
    assert not bench.mismatches
    stats = bench.cache.stats()
    assert stats["evictions_l2"] > 0 and stats["backups_committed"] > 0
    want = held_in_l2(bench)
    bench.sched.shutdown()  # vLLM's publisher sends what it queued
    replay = WireReplay().apply_batches(sub.drain())
    got = replay.of(MEDIUM_CPU)
    assert got == want, f"{len(got - want)} announced but not in L2, {len(want - got)} in L2 but not announced"
    # The join: every L2 block a router saw carries the hash vLLM's own GPU events gave it.
    assert replay.ever[MEDIUM_CPU] <= replay.ever[MEDIUM_GPU]
    assert replay.cleared == 0  # hicache-cp's own start announced nothing vLLM's GPU blocks could lose


def test_vllm_reset_with_the_connector_clears_the_l2_blocks(events_bench) -> None:
    bench, sub = events_bench(num_blocks=32, host_pages=32)
    for prompt in workload(6, seed=1):
        bench.add(prompt)
        bench.run()
    assert held_in_l2(bench)
    assert bench.sched.reset_prefix_cache(reset_connector=True)
    assert not held_in_l2(bench)  # a new, empty cache
    bench.add(workload(1, seed=2)[0])
    bench.run()
    want = held_in_l2(bench)
    bench.sched.shutdown()
    replay = WireReplay().apply_batches(sub.drain())
    assert replay.cleared == 1  # vLLM's block pool: AllBlocksCleared
    assert replay.of(MEDIUM_CPU) == want and want


@pytest.mark.parametrize("ints", ["0", "1"])
def test_the_encoder_converts_hashes_as_vllm_does(ints: str, monkeypatch) -> None:
    from hicache_cp.integrations.vllm.events import VLLMEncoder

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", ints)
    keys = VLLMKeyer("sha256").chain(None, np.arange(3 * H.BLOCK, dtype=np.int64), H.BLOCK)
    enc = VLLMEncoder()
    assert [enc.wire_key(k) for k in keys] == [maybe_convert_block_hash(k) for k in keys]
