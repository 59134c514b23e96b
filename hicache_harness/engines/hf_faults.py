"""Faults injected into a real-model replay on purpose (`--hf-fault`), to test that none is served.

A fault fires once, on the N-th load back from L2 (`#N`, default 1) that
brings a page the fault's rank owns, just before the load is submitted; it
targets the first such page of that load, on that rank only (the choice is
made on every rank from replicated state, so all agree on when and where it
fired):

    corrupt:PART:LAYER@RANK[#N] flip one byte of that page's PART, LAYER in RANK's L2 copy
    drop-draft:PART:LAYER@RANK  zero every draft part and layer of RANK's L2 copies of the
                                load's pages (the fork's bug: the draft state not restored);
                                PART and LAYER are ignored
    fail-copy:PART:LAYER@RANK   RANK's copy of PART, LAYER of that load fails (cpu io backend;
                                the engine's `_submit` is wrapped for the run)

What must follow: a corrupt page is refused before anything computed on it
is served (`hf_oracle.RestoreGuard`: the load fails, the request
recomputes, the integrity counters name the unit and the run exits 1); a
failed copy aborts the load on every rank and the request recomputes (exit
0); dropped draft state is refused like corruption, and with `--no-verify`
it is served and only the draft's output oracle sees it. `injected` lists
what fired, with node, page, part, layer and rank.
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache_cp.cache import HiCache, MatchResult
from hicache_cp.config import Config
from hicache_cp.cp import mapping as cp_mapping
from hicache_harness.errors import InputError
from hicache_cp.io.base import Direction
from hicache_cp.layout import Part

logger = logging.getLogger(__name__)


class FaultKind(enum.Enum):
    CORRUPT = "corrupt"
    DROP_DRAFT = "drop-draft"
    FAIL_COPY = "fail-copy"


@dataclass(frozen=True)
class HfFault:
    kind: FaultKind
    part: Part
    layer: int
    rank: int
    nth: int = 1  # fires on the nth eligible load

    @classmethod
    def parse(cls, text: str) -> HfFault:
        """`KIND:PART:LAYER@RANK[#N]`, e.g. `corrupt:draft_kv:0@1`; InputError on anything else."""
        head, _, tail = text.partition("@")
        rank, _, nth = tail.partition("#")
        fields = head.split(":")
        kinds = ", ".join(k.value for k in FaultKind)
        parts = ", ".join(p.value for p in Part)
        numbers = (rank, fields[-1], nth or "1")  # ASCII digits only: int() also reads "١" and str.isdigit() "²"
        if len(fields) != 3 or not all(n.isascii() and n.isdigit() for n in numbers) or nth == "0":
            raise InputError(f"--hf-fault {text!r}: expected KIND:PART:LAYER@RANK[#N] (kinds: {kinds}; parts: {parts})")
        try:
            kind, part = FaultKind(fields[0]), Part(fields[1])
        except ValueError:
            raise InputError(f"--hf-fault {text!r}: kinds are {kinds}; parts are {parts}") from None
        return cls(kind, part, int(fields[2]), int(rank), int(nth or 1))

    @property
    def name(self) -> str:
        return f"{self.kind.value}:{self.part.value}:{self.layer}@{self.rank}#{self.nth}"


def check_faults(faults: list[HfFault], config: Config) -> None:
    """InputError for a fault naming a rank, part or layer the run does not have."""
    layout = config.layout()
    parts = {p.part: p for p in layout.parts}
    for f in faults:
        if f.rank >= config.cp_size:
            raise InputError(f"--hf-fault {f.name}: the run has ranks 0..{config.cp_size - 1}")
        if f.part not in parts or f.layer not in parts[f.part].layer_ids:
            raise InputError(f"--hf-fault {f.name}: {f.part.value} layer {f.layer} is not in this layout")


@dataclass
class FaultInjector:
    """Fires the faults of one rank's run (module docstring); `before_load` is the scheduler's hook."""

    cache: HiCache
    faults: list[HfFault]
    injected: list[dict[str, Any]] = field(default_factory=list)
    requests: set[int] = field(default_factory=set)  # requests a fault hit
    _armed: dict[tuple[Part, int], HfFault] = field(default_factory=dict)
    _seen: dict[HfFault, int] = field(default_factory=dict)  # eligible loads so far, per fault

    def __post_init__(self) -> None:
        c = self.cache
        check_faults(self.faults, c.config)
        if any(f.kind is FaultKind.FAIL_COPY for f in self.faults) and c.engine.name != "cpu":
            raise InputError("--hf-fault fail-copy needs the cpu io backend (its tickets are what fails)")
        if any(f.kind is FaultKind.FAIL_COPY for f in self.faults):
            self._submit = c.engine._submit
            c.engine._submit = self._failing_submit  # type: ignore[method-assign]

    def before_load(self, request: int, match: MatchResult) -> None:
        if not match.host_nodes:
            return
        for f in self.faults:
            hit = self._first_owned(match, f.rank)
            if hit is None or self._seen.get(f, 0) >= f.nth:
                continue
            self._seen[f] = self._seen.get(f, 0) + 1
            if self._seen[f] < f.nth:
                continue
            node, position, host_page = hit
            self.requests.add(request)
            self.injected.append({"fault": f.name, "request": request, "node": node.id, "page": position,
                                  "part": f.part.value, "layer": f.layer, "rank": f.rank})  # fmt: skip
            if self.cache.rank != f.rank:
                continue
            logger.warning("injecting %s: request %d node %d page %d", f.name, request, node.id, position)
            self._fire(f, match, host_page)

    def _first_owned(self, match: MatchResult, rank: int) -> tuple[Any, int, int] | None:
        cp = self.cache.cp_size
        for node in match.host_nodes:
            pages = np.asarray(node.host_pages)
            mine = np.flatnonzero(cp_mapping.owned_mask(pages, rank, cp))
            if len(mine):
                return node, int(node.first_position + mine[0]), int(pages[mine[0]])
        return None

    def _fire(self, f: HfFault, match: MatchResult, host_page: int) -> None:
        c = self.cache
        cp = c.cp_size
        if f.kind is FaultKind.CORRUPT:
            view = c.host_pool.layer_view(f.part, c.layout.part(f.part).slot(f.layer))
            view[int(cp_mapping.to_physical(np.array([host_page]), cp)[0]), 0] ^= 0xFF
        elif f.kind is FaultKind.DROP_DRAFT:
            pages = match.host_pages
            phys = cp_mapping.to_physical(pages[cp_mapping.owned_mask(pages, c.rank, cp)], cp)
            for part in c.layout.parts:
                if part.part in (Part.DRAFT_KV, Part.DRAFT_STATE):
                    for slot in range(part.num_slots):
                        c.host_pool.layer_view(part.part, slot)[phys] = 0
        else:
            self._armed[(f.part, f.layer)] = f

    def _failing_submit(
        self, direction: Direction, part: Part, layer: int, device_pages: np.ndarray, host_pages: np.ndarray,
        *rest: Any,
    ) -> Any:
        """The cpu engine's `_submit` (every copy's), wrapped (a test double): the first
        H2D submission of an armed (part, layer) is a copy that failed, bytes not
        moved; the rest pass (`rest`: the engine's own arguments, its checks)."""
        if direction is not Direction.H2D or self._armed.pop((part, layer), None) is None:
            return self._submit(direction, part, layer, device_pages, host_pages, *rest)
        from hicache_cp.io.cpu import CpuTicket

        failed: cf.Future[None] = cf.Future()
        failed.set_exception(RuntimeError(f"injected copy failure: rank {self.cache.rank} {part.value} layer {layer}"))
        nbytes = len(host_pages) * self.cache.layout.part(part).page_bytes
        return CpuTicket(failed, Direction.H2D, part, layer, nbytes)

