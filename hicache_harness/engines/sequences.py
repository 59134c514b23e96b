"""A sequence's life in the scheduler (`engines/scheduler.py`): `Seq`, one admitted
request (its match, pages, load, backup and progress through its chunks), its
`SeqState`, and its `RequestRecord` (what serving it took, one row of the
engine's per-request table)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from hicache_cp.cache import MatchResult
from hicache_cp.ops import BackupOp, LoadOp
from hicache_harness.engines.hf_forward import SeqChunk
from hicache_harness.engines.hf_timing import LoadTimer
from hicache_harness.trace import TraceRequest


@dataclass
class RequestRecord:
    """What serving one request took (one entry of the engine's per-request table)."""

    request: int
    prompt_tokens: int
    l1_hit_pages: int
    l2_hit_pages: int
    computed_tokens: int = 0
    arrival_s: float = 0.0
    admitted_s: float = 0.0
    first_token_s: float = 0.0
    load_s: float | None = None
    load_bytes: int = 0
    load_submit_s: float | None = None  # host time of load_back (allocation, evictions, every copy's submission)
    reused_pages: int = 0  # prefix pages read from the cache (L1 or restored from L2)
    waited_loads: int = 0  # other requests' loads its device prefix waited on
    first_forward: int = -1  # index of the first forward it took part in
    redone: bool = False  # its load aborted; it recomputed the loaded pages
    restarts: int = 0  # a load its prefix waited on aborted; it matched again
    served: bool = True

    page_size: int = 1

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def hit_tokens(self) -> int:
        return (self.l1_hit_pages + self.l2_hit_pages) * self.page_size

    @property
    def hit_fraction(self) -> float:
        """Share of the prompt found in the cache (L1 or L2) at admission."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class SeqState(enum.Enum):
    RUNNING = "running"
    DONE = "done"  # first token out, inserted, released
    RESTARTED = "restarted"  # gave everything back; its request is queued again


@dataclass(eq=False)
class Seq:
    """One admitted request (see the module docstring for its life)."""

    req: TraceRequest
    ids: np.ndarray  # token ids (the tree's tokens and the model's input)
    hashes: np.ndarray  # chain hash of every whole page: the content key of the digests
    m: MatchResult
    load: LoadOp | None
    new: np.ndarray  # logical L1 pages of positions [matched_pages, n_pages)
    backup: BackupOp | None
    table: np.ndarray  # logical L1 page of every page position
    pages: np.ndarray  # the same pages, physical (what the forward indexes)
    record: RequestRecord
    progress: int  # first position whose KV is not stored yet (the next chunk starts one before it)
    write_page: int  # first page position this sequence writes
    reuse_pages: int  # page positions [0, reuse_pages) are reused (checked by the byte oracle)
    timer: LoadTimer | None = None
    redo_load: LoadOp | None = None
    hooked: bool = False  # the backup's layer hooks fired
    load_checked: bool = False  # its load's restored pages went through the RestoreGuard
    state: SeqState = SeqState.RUNNING
    #: Digests of the pages this sequence computed, by page position, until insert
    #: tells which of its pages the cache kept (a page another request inserted
    #: first is freed: its bytes are never read, so its digest is not recorded).
    digests: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    @property
    def n_pages(self) -> int:
        return len(self.pages)

    @property
    def start(self) -> int:
        """The first position the next chunk computes (module docstring)."""
        return max(0, self.progress - 1)

    @property
    def remaining(self) -> int:
        """Tokens left to compute up to the first token."""
        return self.n_tokens - self.start

    def next_chunk(self, budget: int, chunk_tokens: int, page_size: int) -> int:
        """Tokens this sequence computes in a forward with `budget` tokens left (0: none):
        up to that many new ones, plus the recomputed one before them; a chunk
        that is not the last ends on a page boundary."""
        start = self.start
        left = self.n_tokens - start
        room = min(budget, chunk_tokens) + (self.progress - start)
        if left <= room:
            return left
        q = (start + room) // page_size * page_size - start
        return q if start + q > self.progress else 0

    def chunk(self, q: int, page_size: int) -> SeqChunk:
        start, end = self.start, self.start + q
        final = end == self.n_tokens
        lo = max(self.progress, self.write_page * page_size)
        hi = min(end, self.n_pages * page_size)
        return SeqChunk(self.ids[start:end], start, self.pages, lo, max(lo, hi), None if final else int(self.ids[end]))
