"""Shared helpers of the KV event tests (no tests here).

- `SHARED_TRACE`: the public trace, or None (the tests that replay it skip).

- `Subscriber`: a ZMQ SUB socket on a thread, decoding every batch with the
  engine's own decoder (`msgspec.msgpack.Decoder(<engine>.KVEventBatch)`),
  checking the sequence numbers run from 0 without a gap.
- `WireReplay`: a router's view rebuilt from engine-format events: the block
  hashes per medium after applying them in order.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any



def shared_trace() -> Path | None:
    """The public trace beside the checkout (`shared/traces` beside it, as test_replay finds it), or
    beside the main checkout when this is a worktree of it; None when neither has it."""
    name = Path("shared") / "traces" / "synthetic_trace.jsonl"
    here = Path(__file__).resolve().parents[2]
    for base in (here, here.parent):
        if (base / name).is_file():
            return base / name
    return None


SHARED_TRACE = shared_trace()


class Subscriber:
    """Collects the batches published on `endpoint` (connects; the publisher binds)."""

    def __init__(self, endpoint: str, batch_type: Any, *, bind: bool = False) -> None:
        import msgspec
        import zmq

        self._decoder = msgspec.msgpack.Decoder(type=batch_type)
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVHWM, 0)
        if bind:
            self._sock.bind(endpoint)
        else:
            self._sock.connect(endpoint)
        self.batches: list[Any] = []
        self.seqs: list[int] = []
        self._stop = threading.Event()
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True, name="test-kv-subscriber")
        self._thread.start()
        time.sleep(0.3)  # ZMQ's slow joiner: the subscription reaches the publisher before it sends

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            if self._sock.poll(50):
                topic, seq, payload = self._sock.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                self.batches.append(self._decoder.decode(payload))
                self._last = time.monotonic()

    def drain(self, quiet_s: float = 1.0, timeout_s: float = 30.0) -> list[Any]:
        """Wait until nothing arrived for `quiet_s`, then stop; the batches in order."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() - self._last < quiet_s and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        assert self.seqs == list(range(len(self.seqs))), f"batches lost or reordered: {self.seqs[:10]}..."
        return self.batches


class WireReplay:
    """Block hashes per medium, from engine-format events (SGLang's or vLLM's classes)."""

    def __init__(self) -> None:
        self.held: dict[str, set[Any]] = {}
        self.ever: dict[str, set[Any]] = {}  # every hash ever stored, per medium
        self.cleared = 0

    def apply(self, events: list[Any]) -> None:
        for ev in events:
            name = type(ev).__name__
            if name == "AllBlocksCleared":
                self.cleared += 1
                for s in self.held.values():
                    s.clear()
            elif name == "BlockStored":
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                self.held.setdefault(ev.medium, set()).update(ev.block_hashes)
                self.ever.setdefault(ev.medium, set()).update(ev.block_hashes)
            elif name == "BlockRemoved":
                self.held.setdefault(ev.medium, set()).difference_update(ev.block_hashes)
            else:
                raise AssertionError(f"unknown event {ev!r}")

    def apply_batches(self, batches: list[Any]) -> WireReplay:
        for b in batches:
            self.apply(b.events)
        return self

    def of(self, medium: str) -> set[Any]:
        return self.held.get(medium, set())
