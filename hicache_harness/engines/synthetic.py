"""A reference prefill-server loop that drives `HiCache` as a real server would.

For each request: match and lock, load back the L2 continuation per layer,
"compute" the missing pages layer by layer (target layers, then draft
layers) writing deterministic KV bytes (`hicache_harness.integrity`) into L1,
fire the target and draft layer hooks, insert, poll, unlock, settle and keep
free room. Once the load is agreed DONE, the bytes of every reused page (the
device-resident prefix and the loaded pages), every part and every layer,
are compared with what computing them gives; a mismatch is recorded with
request, page, layer, part and rank. On GPU the bytes are generated and
compared there (`integrity.content_torch`), so the compute is a real kernel
the copies overlap with.

`HiCache.settle` stands for the sync a real prefill server makes at the end
of each forward (it samples the first token): backups still in flight then
are the last layers' tails, and settling them makes every cache decision
independent of copy timing, so a replay gives the same hits on any machine
and at any CP size. Copies still overlap compute inside the forward.

On CP ranks each rank writes and verifies only the pages it owns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from hicache_cp.cp import mapping as cp_mapping
from hicache_harness import integrity
from hicache_cp.cache import HiCache
from hicache_harness.integrity import Mismatch
from hicache_cp.layout import Model, PartLayout
from hicache_cp.ops import LoadOp, LoadState
from hicache_cp.keys import prefix_hashes
from hicache_cp.radix import Node

logger = logging.getLogger(__name__)

MAX_REPORTED_MISMATCHES = 100


class RequestSink(Protocol):
    """Receives each request's finished KV (the PD adapter implements it).

    A sink may also have `begin_request(request, match, new_pages, hashes, tail)`
    (before the forward), `on_layer_end(model, layer)` (beside the cache's layer
    hook) and `whole_prompt` (it wants the partial last page, `TailPage`): the
    PD sink uses them to send per layer."""

    def send_request(
        self, request: int, node: Node, hashes: np.ndarray, cache: HiCache, *,
        digests: list[np.ndarray] | None = None, tail: TailPage | None = None,
    ) -> None:
        """Called after insert, while `node` (the request's last page) is still locked.
        `digests`: the hf engine's per-page digests of its real KV; `tail`: the
        partial last page, for a sink that wants it (`whole_prompt`)."""


@dataclass(frozen=True)
class TailPage:
    """The partial last page of a prompt, computed into a scratch L1 page (never cached)."""

    page: int  # logical L1 page, freed after the request
    prefix_hash: int  # the seed its bytes were computed from
    tokens: int  # valid tokens in it (1 .. page_size - 1)


@dataclass
class RequestResult:
    request: int
    prompt_tokens: int
    l1_hit_pages: int
    l2_hit_pages: int
    computed_pages: int
    served: bool = True


@dataclass
class IntegrityReport:
    """What the byte checks covered and found.

    `expected_units` is derived from what each request reused (its owned
    reused pages times every layer of every part), independently of the
    checker; `checked_units` counts the (page, part, layer) units the checker
    compared. A run is clean only when they are equal and nothing mismatched.
    """

    checked_pages: int = 0  # reused pages compared (on this rank)
    checked_units: int = 0  # (page, part, layer) units compared
    expected_units: int = 0  # (page, part, layer) units that had to be compared
    mismatches: int = 0
    examples: list[Mismatch] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.checked_units == self.expected_units

    def add(self, found: list[Mismatch]) -> None:
        self.mismatches += len(found)
        room = MAX_REPORTED_MISMATCHES - len(self.examples)
        self.examples.extend(found[:room])
        for m in found[:room]:
            logger.warning("integrity mismatch: %s", m)


class ReferenceServer:
    """Serves requests one at a time through the cache; see the module docstring."""

    def __init__(self, cache: HiCache, *, verify: bool = True, sink: RequestSink | None = None) -> None:
        self.cache = cache
        self.verify = verify
        self.sink = sink
        self.layout = cache.layout
        self.integrity = IntegrityReport()
        self.rejected = 0
        #: Called after a request's layer hooks, before its insert (copies in flight, nothing
        #: decided): the replay's staged crash (`replay --restart-at`).
        self.before_insert: Callable[[], None] | None = None

    def serve(self, request: int, tokens: np.ndarray, queued: Sequence[np.ndarray] = ()) -> RequestResult:
        """Serve one request. `queued`: the tokens of requests that arrived
        behind it; with an L3 tier that does not wait (`l3.prefetch_wait =
        false`) their prefetches start once this request's load is submitted,
        so they land while it computes and serve them when their turn comes
        (`HiCache.prefetch_queued`). A request is passed as queued once."""
        cache = self.cache
        hashes = prefix_hashes(tokens, self.layout.page_size)
        m = cache.match_prefix(tokens, request=request)
        load = cache.load_back(m)
        if cache.l3 is not None and not cache.config.l3.prefetch_wait:
            for ids in queued:
                cache.prefetch_queued(ids)
        start = m.matched_pages
        new = cache.alloc_device(len(hashes) - start, start)
        if new is None:
            if load is not None:
                self._finish_load(load)
            cache.release(m.last_node)
            self.rejected += 1
            logger.warning("request %d rejected: L1 cannot hold its %d new pages", request, len(hashes) - start)
            return RequestResult(request, len(tokens), m.device_len, m.host_len, 0, served=False)
        pd = self.sink if hasattr(self.sink, "begin_request") else None
        tail = self._tail_page(tokens, hashes) if pd is not None and pd.whole_prompt else None
        backup = cache.reserve_backup(new, start)
        if pd is not None:
            pd.begin_request(request, m, new, hashes, tail)
        loaded = load.device_pages if load is not None else np.empty(0, np.int64)
        page_table = np.concatenate([m.device_pages, loaded, new])
        for model in (Model.TARGET, Model.DRAFT):
            # The model's KV of the new pages, every layer in one pass per part
            # (the new pages are not the ones being loaded); then each layer's
            # hook, after waiting for that layer of the loads, as a forward does.
            for part in self.layout.parts_of(model):
                self._compute(part, new, hashes[start:], start)
            for layer in range(self.layout.num_layers(model)):
                for op in m.waits:
                    op.wait_layer(layer, model)
                if load is not None:
                    load.wait_layer(layer, model)
                cache.on_layer_end(model, layer, [backup])
                if pd is not None:
                    pd.on_layer_end(model, layer)  # the PD send of this layer, from the same hook
        if self.before_insert is not None:
            self.before_insert()
        node = cache.insert(m, new, backup=backup)
        cache.poll()
        reused = start
        if load is not None and not self._finish_load(load):
            # An aborted load's pages hold no valid KV: recompute them in place.
            reused = m.device_len
            for part in self.layout.parts:
                self._compute(part, loaded, hashes[reused:start], reused)
            cache.recomputed(load)
        if self.verify and reused:
            self.integrity.expected_units += self._owned_count(page_table[:reused]) * self._units_per_page
            self._verify(request, page_table[:reused], hashes[:reused])
        if pd is not None:
            pd.send_request(request, node, hashes, cache, tail=tail)
        elif self.sink is not None:
            self.sink.send_request(request, node, hashes, cache)
        if tail is not None:
            cache.free_device(np.array([tail.page], dtype=np.int64))
        cache.release(node)
        cache.settle()
        cache.ensure_free()
        return RequestResult(request, len(tokens), m.device_len, m.host_len, len(new))

    def _tail_page(self, tokens: np.ndarray, hashes: np.ndarray) -> TailPage | None:
        """The partial last page (tokens after the last whole page) computed into a
        scratch L1 page at position len(hashes); None when the prompt has none or L1
        has no page for it (the decode side then refuses the room: counts must match)."""
        ps = self.layout.page_size
        rest = tokens[len(hashes) * ps:]
        if not len(rest):
            return None
        page = self.cache.alloc_device(1, len(hashes))
        if page is None:
            logger.warning("no L1 page for the partial last page at position %d", len(hashes))
            return None
        parent = int(hashes[-1]) if len(hashes) else 0
        seed = prefix_hashes(rest, len(rest), parent)  # one page of len(rest) tokens, chained to the prefix
        for part in self.layout.parts:
            self._compute(part, page, seed, len(hashes))
        return TailPage(int(page[0]), int(seed[0]), len(rest))

    def _finish_load(self, load: LoadOp) -> bool:
        """Poll until the load is agreed DONE (True) or ABORTED (False).

        The forward already waited for every layer, so this only turns acks
        into the rank-uniform decision.
        """
        while load.active:
            self.cache.settle()  # waits for the copies, then one agreed poll: no spinning
        if load.state is LoadState.ABORTED:
            return False
        return True

    # ---- bytes -------------------------------------------------------------------------------

    @property
    def _units_per_page(self) -> int:
        return sum(p.num_slots for p in self.layout.parts)

    def _owned_count(self, pages: np.ndarray) -> int:
        """How many of a request's leading pages (positions 0..) this rank owns."""
        return len(pages) if self.cache.cp_size == 1 else int(cp_mapping.owned_mask(pages, self.cache.rank, self.cache.cp_size).sum())

    def _owned(self, pages: np.ndarray, first_position: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's (physical pages, request-absolute positions) of `pages`."""
        return cp_mapping.owned_pages(pages, self.cache.rank, self.cache.cp_size, first_position)

    def _compute(self, part: PartLayout, pages: np.ndarray, hashes: np.ndarray, first: int) -> None:
        """Write every layer of `part` for this rank's share of `pages`."""
        physical, positions = self._owned(pages, first)
        if not len(physical):
            return
        buf = self.cache.device_pool.buffer(part.part)  # [slots, physical_pages, page_bytes]
        seeds = hashes[positions - first]
        if buf.device.type == "cpu":
            buf.numpy()[:, physical] = integrity.contents(seeds, part.part, part.layer_ids, part.page_bytes)
        else:  # generated on the GPU, on the compute stream: real kernels the copies overlap with
            idx = torch.from_numpy(physical).to(buf.device, non_blocking=True)
            buf.index_copy_(1, idx, integrity.contents_torch(seeds, part.part, part.layer_ids, part.page_bytes, buf.device))

    def _verify(self, request: int, pages: np.ndarray, hashes: np.ndarray) -> None:
        """Compare every part and layer of this rank's share of the reused pages
        (positions 0..) with what computing them gives. On GPU the comparison
        runs there and one host sync per request brings back the verdicts."""
        physical, positions = self._owned(pages, 0)
        if not len(physical):
            return
        checks = self._units()
        per_part = [self._bad_rows(part, layers, physical, hashes[positions]) for part, layers in checks]
        bad = torch.cat(per_part).cpu().numpy() if isinstance(per_part[0], torch.Tensor) else np.concatenate(per_part)
        units = [(part, layer) for part, layers in checks for layer in layers]  # the rows of `bad`
        self.integrity.checked_pages += len(physical)
        self.integrity.checked_units += len(physical) * len(units)
        for (part, layer), row in zip(units, bad):
            if row.any():
                self.integrity.add(
                    [Mismatch(request, int(positions[i]), part.part.value, layer, self.cache.rank) for i in np.flatnonzero(row)]
                )

    def _units(self) -> list[tuple[PartLayout, tuple[int, ...]]]:
        """What the checker compares on every reused page: each part with its layers."""
        return [(part, part.layer_ids) for part in self.layout.parts]

    def _bad_rows(
        self, part: PartLayout, layers: tuple[int, ...], physical: np.ndarray, hashes: np.ndarray
    ) -> np.ndarray | torch.Tensor:
        """Per layer and page: do its bytes differ from the computed ones? [layers, pages]"""
        buf = self.cache.device_pool.buffer(part.part)
        slots = [part.slot(layer) for layer in layers]
        if buf.device.type == "cpu":
            expected = integrity.contents(hashes, part.part, layers, part.page_bytes)
            return (buf.numpy()[np.ix_(slots, physical)] != expected).any(axis=2)
        expected_t = integrity.contents_torch(hashes, part.part, layers, part.page_bytes, buf.device)
        idx = torch.from_numpy(physical).to(buf.device)
        actual = buf.index_select(1, idx)
        if len(slots) != part.num_slots:
            actual = actual[torch.tensor(slots, device=buf.device)]
        return (actual != expected_t).any(dim=2)
