"""The operation sequence bench-alloc replays against every allocator.

A model of a host cache under load, independent of any allocator, so every
allocator sees the same reserves and frees in the same order:

* Request sizes: a request of ``t`` prompt tokens reserves ``ceil(t /
  page_tokens)`` pages. The ``t`` come from a Mooncake-format trace
  (``hicache_harness.trace.load_trace``) or, without one, from
  :data:`EMBEDDED_TOKEN_QUANTILES`, the quantiles of the shared synthetic
  trace's ``input_length`` (1 to about 3,000 pages of 64 tokens).
* Eviction: entries are evicted least recently used first when a reserve
  would leave less than ``free_room`` of the pool free, down to that target
  (docs/invariants.md rule 5), so the pool runs full and fragments.
* Hits: each request touches ``hits`` random live entries on average
  (Poisson), which moves them to the most recently used end: eviction is
  not FIFO. With probability ``split`` a hit splits its entry at a random
  page, as a radix tree splits a node when a request diverges inside it: the
  prefix is touched, the suffix keeps its old age and is evicted on its own.
  Frees are therefore whole reservations or pieces of them.

The sequence starts from an empty pool; the first ``timed_from`` operations
(filling the pool, then at least ``warmup_ops`` more and until eviction has
freed ``turnover`` times the pool, so that large pools reach the same steady
state as small ones) are replayed but not timed.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hicache_harness.trace import load_trace

__all__ = ["EMBEDDED_TOKEN_QUANTILES", "RESERVE", "FREE", "SizeSource", "Workload", "make_workload"]

RESERVE, FREE = 0, 1

#: ``input_length`` (tokens) of the shared synthetic trace (3,993 requests) at
#: the 0, 2.5, 5, ..., 100th percentiles: the size distribution used when no
#: trace is given. Sampled by interpolating log(tokens) between them.
EMBEDDED_TOKEN_QUANTILES: tuple[int, ...] = (
    13, 19, 22, 26, 30, 36, 45, 61, 88, 135, 277, 479, 913, 1983, 2777, 3379, 4365,
    5433, 6657, 8978, 11587, 13856, 14724, 15567, 16290, 17053, 17642, 18414, 19409,
    21206, 23175, 25381, 28425, 31422, 34319, 36870, 38611, 41325, 48905, 55781, 191378,
)  # fmt: skip


@dataclass(frozen=True)
class SizeSource:
    """Where request sizes come from: a trace's ``input_length`` values or the embedded quantiles."""

    tokens: np.ndarray  # int64 token counts (a trace), or the quantile table (embedded)
    description: str
    embedded: bool

    @classmethod
    def from_trace(cls, path: Path) -> SizeSource:
        """Sizes of every request of a Mooncake-format trace with a non-empty prompt.

        Raises ``TraceError`` (bad input) for a malformed or empty trace.
        """
        requests = load_trace(path)
        tokens = np.array([r.input_length for r in requests if r.input_length > 0], dtype=np.int64)
        if tokens.size == 0:
            from hicache_harness.trace import TraceError

            raise TraceError(f"{path}: no request has input_length > 0")
        return cls(tokens, f"trace {path} ({tokens.size} requests)", embedded=False)

    @classmethod
    def builtin(cls) -> SizeSource:
        return cls(
            np.array(EMBEDDED_TOKEN_QUANTILES, dtype=np.int64),
            "embedded quantiles of the shared synthetic trace's input_length",
            embedded=True,
        )

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``count`` token counts: uniform over the trace's requests, or by inverse CDF."""
        if not self.embedded:
            return self.tokens[rng.integers(0, self.tokens.size, size=count)]
        q = np.log(self.tokens.astype(np.float64))
        x = rng.random(count) * (q.size - 1)
        return np.maximum(1, np.rint(np.exp(np.interp(x, np.arange(q.size), q)))).astype(np.int64)


@dataclass(frozen=True)
class Workload:
    """Rows of ``(kind, entry id, lo, hi)``: reserve ``hi`` pages as entry ``id`` (lo = 0),
    or free pages at positions ``[lo, hi)`` of entry ``id``'s reservation."""

    pool_pages: int
    ops: np.ndarray
    timed_from: int
    sizes: str
    page_tokens: int
    free_room: float
    hits: float
    split: float
    #: Reserve sizes (pages) of the timed part: p50, p99, max, and how many were clamped to the pool.
    reserve_pages_p50: float
    reserve_pages_p99: float
    reserve_pages_max: int
    clamped_reserves: int
    split_frees: int

    @property
    def timed_ops(self) -> int:
        return self.ops.shape[0] - self.timed_from

    def describe(self) -> dict[str, object]:
        timed = self.ops[self.timed_from :]
        return {
            "sizes": self.sizes,
            "page_tokens": self.page_tokens,
            "free_room": self.free_room,
            "hits_per_request": self.hits,
            "split_probability": self.split,
            "untimed_ops": self.timed_from,
            "timed_ops": self.timed_ops,
            "timed_reserves": int(np.count_nonzero(timed[:, 0] == RESERVE)),
            "timed_frees": int(np.count_nonzero(timed[:, 0] == FREE)),
            "timed_split_frees": self.split_frees,
            "reserve_pages_p50": self.reserve_pages_p50,
            "reserve_pages_p99": self.reserve_pages_p99,
            "reserve_pages_max": self.reserve_pages_max,
            "clamped_reserves": self.clamped_reserves,
        }


class _Entries:
    """Live cache entries (pieces of reservations) with an age each: LRU order and random picks."""

    def __init__(self) -> None:
        self.age: dict[tuple[int, int, int], int] = {}
        self.heap: list[tuple[int, tuple[int, int, int]]] = []  # (age, key); stale rows skipped
        self.keys: list[tuple[int, int, int]] = []
        self.index: dict[tuple[int, int, int], int] = {}

    def add(self, key: tuple[int, int, int], age: int) -> None:
        self.age[key] = age
        heapq.heappush(self.heap, (age, key))
        self.index[key] = len(self.keys)
        self.keys.append(key)

    def remove(self, key: tuple[int, int, int]) -> None:
        del self.age[key]
        i = self.index.pop(key)
        last = self.keys.pop()
        if i < len(self.keys):
            self.keys[i] = last
            self.index[last] = i

    def oldest(self) -> tuple[int, int, int]:
        while True:
            age, key = heapq.heappop(self.heap)
            if self.age.get(key) == age:
                return key


def make_workload(
    *,
    pool_pages: int,
    sizes: SizeSource,
    page_tokens: int,
    timed_ops: int,
    warmup_ops: int,
    free_room: float,
    hits: float,
    split: float,
    seed: int,
    turnover: float = 1.0,
) -> Workload:
    """Generate the sequence (see the module docstring). Deterministic in ``seed``.

    O(total ops x log entries) Python work; nothing here is timed.
    """
    rng = np.random.default_rng(seed)
    room = math.ceil(free_room * pool_pages)
    largest = pool_pages - room
    if largest < 1:
        raise ValueError(f"free room {free_room} leaves no page of a {pool_pages}-page pool to reserve")
    entries = _Entries()
    ops: list[tuple[int, int, int, int]] = []
    free = pool_pages
    clock = 0
    next_id = 0
    timed_from: int | None = None
    filled_at: int | None = None
    evicted = 0
    split_frees = 0
    split_keys: set[tuple[int, int, int]] = set()
    timed_sizes: list[int] = []
    clamped = 0
    batch = np.empty(0, dtype=np.int64)
    while timed_from is None or len(ops) < timed_from + timed_ops:
        if batch.size == 0:
            batch = -(-sizes.draw(rng, 4096) // page_tokens)
        n, batch = int(batch[0]), batch[1:]
        if n > largest:
            n = largest
            clamped += timed_from is not None
        for _ in range(int(rng.poisson(hits)) if entries.keys else 0):
            clock += 1
            key = entries.keys[int(rng.integers(len(entries.keys)))]
            ident, lo, hi = key
            if hi - lo >= 2 and rng.random() < split:
                cut = lo + int(rng.integers(1, hi - lo))
                old = entries.age[key]
                entries.remove(key)
                entries.add((ident, lo, cut), clock)  # the shared prefix was hit
                entries.add((ident, cut, hi), old)  # the diverging suffix keeps its age
                split_keys.update(((ident, lo, cut), (ident, cut, hi)))
            else:
                entries.remove(key)
                entries.add(key, clock)
        while free - n < room:
            key = entries.oldest()
            entries.remove(key)
            ops.append((FREE, *key))
            free += key[2] - key[1]
            if filled_at is None:
                filled_at = len(ops) - 1  # the pool filled up: warm up, then time
            if timed_from is None:
                evicted += key[2] - key[1]
                if len(ops) - filled_at >= warmup_ops and evicted >= turnover * pool_pages:
                    timed_from = len(ops)
            elif key in split_keys:
                split_frees += 1
        clock += 1
        ops.append((RESERVE, next_id, 0, n))
        if timed_from is not None and len(ops) > timed_from:
            timed_sizes.append(n)
        entries.add((next_id, 0, n), clock)
        next_id += 1
        free -= n
    arr = np.array(ops[: timed_from + timed_ops], dtype=np.int64)
    sizes_arr = np.array(timed_sizes or [0], dtype=np.int64)
    return Workload(
        pool_pages=pool_pages,
        ops=arr,
        timed_from=timed_from,
        sizes=sizes.description,
        page_tokens=page_tokens,
        free_room=free_room,
        hits=hits,
        split=split,
        reserve_pages_p50=float(np.percentile(sizes_arr, 50)),
        reserve_pages_p99=float(np.percentile(sizes_arr, 99)),
        reserve_pages_max=int(sizes_arr.max()),
        clamped_reserves=clamped,
        split_frees=split_frees,
    )
