"""`--ttft-probe N`: what an L2 hit costs over an L1 hit, and what copies cost a layer.

After the replay, on a cache of its own (the replay's counters stay the
replay's: its hit rate, bytes and evictions are not the probe's) and with
the server otherwise idle, two measurements in the real model (issue 28,
item 3):

TTFT pairs. For each of N long prompts of the trace, of its length: a prefix
P of 93% of it (whole pages) of fresh tokens, so that no tier holds any of P
beforehand. P is first made L2-only: served (computing it) until every page
of it has a committed host copy, then L1 emptied (`HiCache.evict_device`).
One unmeasured L2 hit of P + a fresh suffix follows: it warms this length's
kernel shapes (on CUDA a shape's first forward pays cuBLAS and SDPA set-up,
`hf_forward`) and leaves P in L1. Then `PAIRS_PER_PROMPT` pairs: P + a fresh
suffix served while P is in L1 (an L1 hit), and P + another fresh suffix of
the same length while P is only in L2 (`evict_device` first: an L2 hit,
whose loads overlap the forward); an L2 hit leaves P in L1 for an L1 hit
after it, so the order alternates from pair to pair and each prompt has one
pair of each order. Both requests of a pair have the same prompt size and
hit fraction, arrive at an idle server (nothing queued, no copy in flight:
the cache is drained before each) and are timed arrival -> first token by
the scheduler, without the byte oracle (its checks would sit inside the
L2 hit's TTFT only). `ttft_l2_over_l1_hit` is the median of (L2-hit TTFT /
L1-hit TTFT); a pair whose requests did not hit as planned (a hit tier
other than the one meant, or fewer hit pages than P) is refused with a
WARNING and left out, and listed.

Layer times (`layer_forward_ms`). The forward of one chunk of a probe
prompt (no paging: a scratch store), layer by layer: its time per layer
alone, and with copies in flight in both directions on the cache's copy
engine, each layer as much as an L2 hit of the prompt loads (its prefix
pages): before each layer that layer's load is submitted, after it its
backup, between scratch pages of both pools (never pages the cache holds).
Beside them, `hit_pairs`: the layer times of the pairs' own forwards, the
L1 hits' against the L2 hits' (the same shapes; the L2 hits' loads in
flight). On CUDA each layer is timed with events on the compute stream
(no host sync inside the forward; read after it), elsewhere with the wall
clock; a layer's time starts once its loads were waited for.
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

from hicache_harness.engines.hf_forward import LayerHooks, NoHooks, PagedForward, ScratchKV, SeqChunk, SeqPlan
from hicache_harness.engines.sequences import RequestRecord
from hicache_cp.cp.mapping import to_physical
from hicache_harness.trace import TraceRequest
from hicache_cp.io.base import Direction
from hicache_cp.layout import Model

logger = logging.getLogger(__name__)

#: The prefix's share of a probe prompt: the trace's long-prompt hit fraction.
HIT_FRACTION = 0.93
#: L1-hit / L2-hit pairs per probe prompt (orders alternating; one full compute of P serves them all).
PAIRS_PER_PROMPT = 2
#: Forwards per layer-time measurement (after one unmeasured).
LAYER_REPEATS = 3


@dataclass(frozen=True)
class Served:
    """One probe request: its record and the layer times of its forwards (ms, in order)."""

    record: RequestRecord
    layer_ms: list[float]


ServeOne = Callable[[TraceRequest, np.ndarray], Served]


@dataclass(frozen=True)
class ProbePair:
    """One L1-hit / L2-hit pair of the same prompt size and hit fraction."""

    sample: int  # the probe prompt
    repeat: int  # the pair's number among that prompt's
    prompt_tokens: int
    prefix_tokens: int
    order: str  # which hit was served first: "l1-first" or "l2-first"
    l1_ttft_s: float
    l2_ttft_s: float
    l1_hit_pages: tuple[int, int]  # (L1, L2) hit pages of the L1-hit request
    l2_hit_pages: tuple[int, int]  # the same of the L2-hit request
    l1_prompt_tokens: int
    l2_prompt_tokens: int
    l2_load_s: float | None
    l2_load_bytes: int
    valid: bool

    @property
    def ratio(self) -> float:
        return self.l2_ttft_s / self.l1_ttft_s


def ttft_pairs(
    serve_one: ServeOne, cache: Any, prompts: list[np.ndarray], *, vocab_size: int, seed: int, first_index: int
) -> dict[str, Any]:
    """The TTFT pairs of the module docstring over `prompts`; report keys
    (`layer_forward_ms_hit_pairs`: the pairs' layer times)."""
    ps = cache.layout.page_size
    rng = np.random.default_rng(seed)
    index = itertools.count(first_index)
    pairs: list[ProbePair] = []
    layers: dict[str, list[float]] = {"l1_hit": [], "l2_hit": []}

    def serve(ids: np.ndarray) -> Served:
        return serve_one(TraceRequest(next(index), 0.0, len(ids), 1, ()), ids)

    for k, ids in enumerate(prompts):
        prefix = int(len(ids) * HIT_FRACTION) // ps * ps
        if prefix < ps:
            raise ValueError(f"probe prompt {k} of {len(ids)} tokens has no whole page to reuse (page {ps})")
        p = rng.integers(0, vocab_size, prefix, dtype=np.int64)  # new to every tier (see the docstring)
        tail = len(ids) - prefix

        def fresh() -> np.ndarray:
            return np.concatenate([p, rng.integers(0, vocab_size, tail, dtype=np.int64)])

        pages = prefix // ps
        _make_l2_only(lambda ids: serve(ids).record, cache, p, fresh, pages, k)
        serve(fresh())  # warm-up: an L2 hit of this length's shapes; P is in L1 after it
        cache.drain()
        for j in range(PAIRS_PER_PROMPT):
            l2_first = (k + j) % 2 == 0
            if l2_first:
                cache.evict_device()
                l2 = serve(fresh())  # loads P back into L1
                cache.drain()
                l1 = serve(fresh())
            else:
                l1 = serve(fresh())
                cache.drain()
                cache.evict_device()
                l2 = serve(fresh())
            cache.drain()
            pair = _pair(k, j, len(ids), prefix, l2_first, l1.record, l2.record, pages)
            if pair.valid:
                layers["l1_hit"] += l1.layer_ms
                layers["l2_hit"] += l2.layer_ms
            else:
                logger.warning("ttft probe %d.%d: not the planned hits (prefix %d pages; L1-hit request %s, L2-hit "
                               "request %s as (L1, L2) pages); left out", k, j, pages, pair.l1_hit_pages,
                               pair.l2_hit_pages)  # fmt: skip
            pairs.append(pair)
    ratios = [q.ratio for q in pairs if q.valid]
    hit_layers: dict[str, Any] = {label: _spread(ms) for label, ms in layers.items()}
    hit_layers["ratio_p50"] = _ratio_p50(hit_layers["l2_hit"], hit_layers["l1_hit"])
    hit_layers["l2_load_bytes"] = sum(q.l2_load_bytes for q in pairs if q.valid)
    return {
        "ttft_l2_over_l1_hit": float(np.median(ratios)) if ratios else None,
        "ttft_l2_over_l1_hit_p90": float(np.percentile(ratios, 90)) if ratios else None,
        "ttft_probe_pairs": len(pairs),
        "ttft_probe_valid_pairs": len(ratios),
        "ttft_l2_over_l1_hit_pairs": [{**asdict(q), "ratio": q.ratio} for q in pairs],
        "layer_forward_ms_hit_pairs": hit_layers,
    }


def _pair(k: int, j: int, prompt: int, prefix: int, l2_first: bool, l1: RequestRecord, l2: RequestRecord,
          pages: int) -> ProbePair:  # fmt: skip
    """The pair of (`l1`, `l2`); valid when each hit all of P in its own tier and nowhere else."""
    l1_hits, l2_hits = (l1.l1_hit_pages, l1.l2_hit_pages), (l2.l1_hit_pages, l2.l2_hit_pages)
    valid = l1_hits == (pages, 0) and l2_hits == (0, pages) and l1.prompt_tokens == l2.prompt_tokens == prompt
    return ProbePair(
        k, j, prompt, prefix, "l2-first" if l2_first else "l1-first", l1.ttft_s, l2.ttft_s, l1_hits, l2_hits,
        l1.prompt_tokens, l2.prompt_tokens, l2.load_s, l2.load_bytes, valid,
    )  # fmt: skip


def _spread(ms: list[float]) -> dict[str, Any]:
    if not ms:
        return {"p50": None, "p90": None, "n": 0}
    return {"p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90)), "n": len(ms)}


def _ratio_p50(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    return a["p50"] / b["p50"] if a["p50"] is not None and b["p50"] else None


def _make_l2_only(serve: Callable[[np.ndarray], RequestRecord], cache: Any, prefix: np.ndarray,
                  fresh: Callable[[], np.ndarray], pages: int, sample: int) -> None:
    """Serve the (fresh) prefix once, so that it is computed and backed up whole, let the
    backups commit, then empty L1: the prefix is L2-only. RuntimeError when it is not
    (L2 skipped a backup for want of room)."""
    serve(fresh())
    cache.drain()
    cache.evict_device()
    m = cache.match_prefix(prefix)
    on_device, on_host = len(m.device_pages), m.host_len
    cache.release(m.last_node)
    if (on_device, on_host) != (0, pages):
        raise RuntimeError(f"ttft probe {sample}: the prefix of {pages} pages did not become L2-only "
                           f"(L1 {on_device}, L2 {on_host} pages)")


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
        """After the forward: ms of each (start, end) pair of marks. Blocks on the last event."""
        if not self.marks:
            return []
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks[::2], self.marks[1::2])]
        return [(b - a) * 1e3 for a, b in zip(self.marks[::2], self.marks[1::2])]


class _ClockedHooks:
    """A forward's hooks with every layer timed between them: the start mark after
    the inner `before_layer` (its load waits are queued first, so a layer's time
    starts once its pages landed), the end mark before the inner `after_layer`."""

    def __init__(self, inner: LayerHooks, clock: _LayerClock) -> None:
        self.inner, self.clock = inner, clock

    def before_layer(self, model: Model, layer: int) -> None:
        self.inner.before_layer(model, layer)
        self.clock.mark()

    def after_layer(self, model: Model, layer: int) -> None:
        self.clock.mark()
        self.inner.after_layer(model, layer)


class TimedForward(PagedForward):
    """`PagedForward` whose every layer is timed (`_ClockedHooks`); `take_ms()` hands
    over the layer times of the forwards since the last call (after their sync)."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self._clocks: list[_LayerClock] = []

    def run(self, batch: Any, hooks: LayerHooks | None = None) -> Any:
        clock = _LayerClock(self.m.device.type == "cuda")
        self._clocks.append(clock)
        return super().run(batch, _ClockedHooks(hooks or NoHooks(), clock))

    def take_ms(self) -> list[float]:
        ms = [t for c in self._clocks for t in c.layer_ms()]
        self._clocks.clear()
        return ms


class _Traffic:
    """Copies beside the forward between scratch pages of both pools: each layer's
    load before it, its backup after it (`CopyEngine` tickets, awaited at the end).

    The host side is two write-through reservations that never join the tree (aborted
    at the end): L2 room made the way a backup makes it, pages no node owns. Loads read
    the first, seeded once from the scratch L1 pages so its stored checksums hold;
    backups write the second. A layer's load and backup are in flight together and
    unordered, so they never share host pages: each load's restore check compares bytes
    that nothing rewrites."""

    def __init__(self, cache: Any, pages: int) -> None:
        self.cache = cache
        self.dev = cache.alloc_device(pages, 0)
        self.reservations: list[Any] = []
        while self.dev is not None and len(self.reservations) < 2:
            op = cache.reserve_backup(self.dev, 0)
            if op is None:
                break
            self.reservations.append(op)
        if len(self.reservations) < 2:
            self._release()
            raise RuntimeError(f"ttft probe: no room for {pages} scratch pages in L1 and twice in L2 "
                               "(an idle cache should have it)")  # fmt: skip
        eng, cp = cache.engine, cache.cp_size
        dphys = to_physical(self.dev, cp)
        source, target = (to_physical(op.host_pages, cp) for op in self.reservations)
        self.load, self.backup = eng.plan(Direction.H2D, dphys, source), eng.plan(Direction.D2H, dphys, target)
        self.tickets: list[Any] = []
        self.bytes = 0
        seed = eng.plan(Direction.D2H, dphys, source)
        for model in Model:
            for layer in range(cache.layout.num_layers(model)):
                self.submit(seed, model, layer)
        self.finish()
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
        self._release()

    def _release(self) -> None:
        for op in self.reservations:
            op.error = RuntimeError("the ttft probe's scratch reservation (never meant to commit)")
            self.cache.abort_backup(op)
        if self.reservations:
            self.cache.settle()  # the reservations' host pages go back
        if self.dev is not None:
            self.cache.free_device(self.dev)


class _TrafficHooks:
    """Each layer's load submitted before it, its backup after it."""

    def __init__(self, traffic: _Traffic) -> None:
        self.traffic = traffic

    def before_layer(self, model: Model, layer: int) -> None:
        self.traffic.submit(self.traffic.load, model, layer)

    def after_layer(self, model: Model, layer: int) -> None:
        self.traffic.submit(self.traffic.backup, model, layer)


def layer_times(model: Any, cache: Any, ids: np.ndarray, chunk_tokens: int, copy_pages: int) -> dict[str, Any]:
    """The layer-time measurement of the module docstring over the first chunk of
    `ids`, with `copy_pages` pages a layer and direction in flight for `with_copies`."""
    ps = cache.layout.page_size
    n = min(len(ids), chunk_tokens) // ps * ps
    if n < ps:
        raise ValueError(f"a probe chunk needs a whole page ({ps} tokens), got {len(ids)}")
    if copy_pages < 1:
        raise ValueError(f"copies beside the forward need at least one page, got {copy_pages}")
    chunk = ids[:n]
    forward = TimedForward(model)
    plan = SeqPlan.build(SeqChunk(chunk, 0, None, 0, 0, None), ps)
    cache.drain()
    traffic = _Traffic(cache, copy_pages)
    times: dict[str, list[float]] = {"alone": [], "with_copies": []}
    copied = 0
    try:
        for rep in range(LAYER_REPEATS + 1):
            for label in ("alone", "with_copies") if rep % 2 else ("with_copies", "alone"):
                use = label == "with_copies"
                before = traffic.bytes
                hooks: LayerHooks = _TrafficHooks(traffic) if use else NoHooks()
                forward.run([(plan, ScratchKV().bind(plan))], hooks)
                ms = forward.take_ms()
                traffic.finish()  # nothing in flight when the next forward starts
                if rep:  # the first round warms kernels and the allocator
                    times[label] += ms
                    copied += traffic.bytes - before
    finally:
        traffic.close()
    out: dict[str, Any] = {"tokens": n, "repeats": LAYER_REPEATS, "copy_pages": copy_pages, "copied_bytes": copied}
    for label, ms in times.items():
        out[label] = _spread(ms)
    out["ratio_p50"] = _ratio_p50(out["with_copies"], out["alone"])
    return out
