"""`--ttft-probe N`: what an L2 hit costs over an L1 hit, and what copies cost a layer.

After the replay, with the server otherwise idle, two measurements in the
real model (issue 28, item 3):

TTFT pairs. For each of N long prompts of the trace, of its length: a prefix
P of 93% of it (whole pages) of fresh tokens, so that no tier holds any of P
beforehand (the replay leaves prefixes partly in L1 without a host copy). P is served once and its backups are committed;
then P + a fresh suffix is served while P is in L1 (an L1 hit) and P + another
fresh suffix of the same length while P is only in L2 (`HiCache.evict_device`
first: an L2 hit, whose loads overlap the forward). P is first made L2-only:
served (computing what no tier holds) until every page of it has a committed
host copy, then L1 emptied. Both requests have the
same prompt size and hit fraction, arrive at an idle server (no queueing) and
are timed arrival -> first token by the scheduler. The order alternates from
pair to pair (an L2 hit leaves P in L1 for the L1 hit that follows).
`ttft_l2_over_l1_hit` is the median of (L2-hit TTFT / L1-hit TTFT); a pair
whose requests did not hit as planned (a hit tier other than the one meant,
or fewer hit pages than P) is refused with a WARNING and left out, and listed.

Layer times. The forward of one chunk of a probe prompt (no paging: a scratch
store), layer by layer: its time per layer alone, and with copies of the
same size in flight on the cache's copy engine: a load of every layer
submitted before the forward and each layer's backup after the layer,
between scratch pages of both pools (never pages the cache holds). On CUDA
each layer is timed with events on the compute stream (no host sync inside
the forward; read after it), elsewhere with the wall clock.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from hicache_cp.harness.engines.hf_forward import LayerHooks, PagedForward, ScratchKV, SeqChunk, SeqPlan
from hicache_cp.harness.engines.scheduler import RequestRecord
from hicache_cp.cp.mapping import to_physical
from hicache_cp.harness.trace import TraceRequest
from hicache_cp.io.base import Direction
from hicache_cp.layout import Model

logger = logging.getLogger(__name__)

#: The prefix's share of a probe prompt: the trace's long-prompt hit fraction.
HIT_FRACTION = 0.93
#: Forwards per layer-time measurement (after one unmeasured).
LAYER_REPEATS = 3

ServeOne = Callable[[TraceRequest, np.ndarray], RequestRecord]


@dataclass(frozen=True)
class ProbePair:
    """One L1-hit / L2-hit pair of the same prompt size and hit fraction."""

    sample: int
    prompt_tokens: int
    prefix_tokens: int
    order: str  # which hit was served first: "l1-first" or "l2-first"
    l1_ttft_s: float
    l2_ttft_s: float
    l1_hit_pages: tuple[int, int]  # (L1, L2) hit pages of the L1-hit request
    l2_hit_pages: tuple[int, int]  # the same of the L2-hit request
    l2_load_s: float | None
    valid: bool

    @property
    def ratio(self) -> float:
        return self.l2_ttft_s / self.l1_ttft_s


def ttft_pairs(
    serve_one: ServeOne, cache: Any, prompts: list[np.ndarray], *, vocab_size: int, seed: int, first_index: int
) -> dict[str, Any]:
    """The TTFT pairs of the module docstring over `prompts`; report keys."""
    ps = cache.layout.page_size
    rng = np.random.default_rng(seed)
    index = itertools.count(first_index)  # request ids after the trace's
    pairs: list[ProbePair] = []

    def serve(ids: np.ndarray) -> RequestRecord:
        i = next(index)
        return serve_one(TraceRequest(i, 0.0, len(ids), 1, ()), ids)

    for k, ids in enumerate(prompts):
        prefix = int(len(ids) * HIT_FRACTION) // ps * ps
        if prefix < ps:
            raise ValueError(f"probe prompt {k} of {len(ids)} tokens has no whole page to reuse (page {ps})")
        p = rng.integers(0, vocab_size, prefix, dtype=np.int64)  # new to every tier (see the docstring)
        tail = len(ids) - prefix

        def fresh() -> np.ndarray:
            return np.concatenate([p, rng.integers(0, vocab_size, tail, dtype=np.int64)])

        pages = prefix // ps
        _make_l2_only(serve, cache, p, fresh, pages, k)
        l2_first = k % 2 == 0
        if l2_first:
            l2 = serve(fresh())  # loads P back into L1
            cache.drain()
            l1 = serve(fresh())
        else:
            serve(fresh())  # loads P back into L1
            cache.drain()
            l1 = serve(fresh())
            cache.evict_device()
            l2 = serve(fresh())
        cache.drain()
        valid = (l1.l1_hit_pages, l1.l2_hit_pages) == (pages, 0) and (l2.l1_hit_pages, l2.l2_hit_pages) == (0, pages)
        pair = ProbePair(
            k, len(ids), prefix, "l2-first" if l2_first else "l1-first", l1.ttft_s, l2.ttft_s,
            (l1.l1_hit_pages, l1.l2_hit_pages), (l2.l1_hit_pages, l2.l2_hit_pages), l2.load_s, valid,
        )  # fmt: skip
        if not valid:
            logger.warning("ttft probe %d: not the planned hits (prefix %d pages; L1-hit request %s, L2-hit request %s "
                           "as (L1, L2) pages); left out", k, pages, pair.l1_hit_pages, pair.l2_hit_pages)  # fmt: skip
        pairs.append(pair)
    ratios = [q.ratio for q in pairs if q.valid]
    return {
        "ttft_l2_over_l1_hit": float(np.median(ratios)) if ratios else None,
        "ttft_l2_over_l1_hit_p90": float(np.percentile(ratios, 90)) if ratios else None,
        "ttft_probe_valid_pairs": len(ratios),
        "ttft_l2_over_l1_hit_pairs": [{**asdict(q), "ratio": q.ratio} for q in pairs],
    }


def _make_l2_only(serve: Callable[[np.ndarray], RequestRecord], cache: Any, prefix: np.ndarray,
                  fresh: Callable[[], np.ndarray], pages: int, sample: int) -> None:
    """Serve the prefix until all of it has a committed L2 copy, then empty L1. A prefix
    the replay left partly in L1 without a host copy is backed up only where it is
    computed again, so each round evicts L1 first; three rounds at most."""
    for _ in range(3):
        serve(fresh())
        cache.drain()
        cache.evict_device()
        m = cache.match_prefix(prefix)
        on_device, on_host = len(m.device_pages), m.host_len
        cache.release(m.last_node)
        if (on_device, on_host) == (0, pages):
            return
    raise RuntimeError(f"ttft probe {sample}: the prefix of {pages} pages did not become L2-only "
                       f"(L1 {on_device}, L2 {on_host} pages after three rounds)")


class _LayerClock:
    """Per-layer times of one forward on the compute stream (events on CUDA)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def layer_ms(self) -> list[float]:
        """After the forward: ms of each (before, after) pair of marks."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks[::2], self.marks[1::2])]
        return [(b - a) * 1e3 for a, b in zip(self.marks[::2], self.marks[1::2])]


class _Traffic:
    """Copies beside the forward between scratch pages of both pools: loads of every
    layer up front, each layer's backup after it (`CopyEngine` tickets, awaited at the end)."""

    def __init__(self, cache: Any, pages: int) -> None:
        self.cache = cache
        dev = cache.alloc_device(pages, 0)
        # The host side is a write-through reservation that never joins the tree (aborted
        # at the end): L2 room made the way a backup makes it, pages no node owns.
        self.reservation = cache.reserve_backup(dev, 0) if dev is not None else None
        if self.reservation is None:
            if dev is not None:
                cache.free_device(dev)
            raise RuntimeError(f"ttft probe: no room for {pages} scratch pages in L1 and L2 (an idle cache should have it)")
        host = self.reservation.host_pages
        self.dev, self.host = dev, host
        eng = cache.engine
        dphys, hphys = to_physical(dev, cache.cp_size), to_physical(host, cache.cp_size)
        self.load, self.backup = eng.plan(Direction.H2D, dphys, hphys), eng.plan(Direction.D2H, dphys, hphys)
        self.tickets: list[Any] = []
        self.bytes = 0

    def submit(self, plan: Any, model: Model, layer: int) -> None:
        owners = [p for p in self.cache.layout.parts_of(model) if p.has_layer(layer)]
        if owners:
            got = self.cache.engine.submit_layer(plan, tuple(p.part for p in owners), layer)
            self.tickets += [t for t in got if t is not None]
            self.bytes += sum(p.page_bytes for p in owners) * len(self.dev)

    def finish(self) -> None:
        for t in self.tickets:
            t.wait()
        self.tickets.clear()

    def close(self) -> None:
        self.finish()
        self.reservation.error = RuntimeError("the ttft probe's scratch reservation (never meant to commit)")
        self.cache.abort_backup(self.reservation)
        self.cache.settle()  # the reservation's host pages go back
        self.cache.free_device(self.dev)


class _TimedHooks:
    """Marks every layer's start and end; with `traffic`, copies around them."""

    def __init__(self, clock: _LayerClock, traffic: _Traffic | None) -> None:
        self.clock, self.traffic = clock, traffic

    def before_layer(self, model: Model, layer: int) -> None:
        self.clock.mark()

    def after_layer(self, model: Model, layer: int) -> None:
        self.clock.mark()
        if self.traffic is not None:
            self.traffic.submit(self.traffic.backup, model, layer)


def layer_times(model: Any, cache: Any, ids: np.ndarray, chunk_tokens: int) -> dict[str, Any]:
    """The layer-time measurement of the module docstring over the first chunk of `ids`."""
    ps = cache.layout.page_size
    n = min(len(ids), chunk_tokens) // ps * ps
    if n < ps:
        raise ValueError(f"a probe chunk needs a whole page ({ps} tokens), got {len(ids)}")
    chunk = ids[:n]
    forward = PagedForward(model)
    cuda = model.device.type == "cuda"
    plan = SeqPlan.build(SeqChunk(chunk, 0, None, 0, 0, None), ps)
    traffic = _Traffic(cache, n // ps)
    times: dict[str, list[float]] = {"alone": [], "with_copies": []}
    copied = 0
    try:
        for rep in range(LAYER_REPEATS + 1):
            for label in ("alone", "with_copies") if rep % 2 else ("with_copies", "alone"):
                clock = _LayerClock(cuda)
                use = traffic if label == "with_copies" else None
                if use is not None:
                    before = traffic.bytes
                    for m in Model:
                        for layer in range(cache.layout.num_layers(m)):
                            traffic.submit(traffic.load, m, layer)
                hooks: LayerHooks = _TimedHooks(clock, use)
                forward.run([(plan, ScratchKV().bind(plan))], hooks)
                ms = clock.layer_ms()
                if use is not None:
                    traffic.finish()
                    if rep:
                        copied += traffic.bytes - before
                if rep:  # the first round warms kernels and the allocator
                    times[label] += ms
    finally:
        traffic.close()
    out: dict[str, Any] = {"tokens": n, "repeats": LAYER_REPEATS, "copied_bytes": copied}
    for label, ms in times.items():
        out[label] = {"p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90)), "n": len(ms)}
    out["ratio_p50"] = out["with_copies"]["p50"] / out["alone"]["p50"]
    return out
