"""The real engine's oracles: byte identity of every reused page, and outputs.

(a) Byte identity. A real model's KV is not a function anyone can recompute
bit for bit (a batched forward rounds differently from an unbatched one), so
the engine digests every page it computes, per (page, part, layer) *unit*, at
the moment it computes it, and at insert records the digests of the pages
the cache kept, keyed by the page's content (the prefix hash of its tokens
and everything before them); a duplicate that another request inserted
first is freed, never read, and not recorded. Every page a request reuses,
from L1 or restored from L2, is digested again where it lies and compared
with what was recorded. A content computed again later (after its pages
left both tiers, or in place after an aborted load) legitimately has
several digests (`DigestBook.variants`); a unit passes when it equals one of
them. Corrupt, stale, misplaced or half-copied bytes match none.

Restored pages are checked twice. `RestoreGuard` digests every page a load
brought back from L2 (this rank's share of it) at the end of the first
forward that waited on it, before the load is decided: a unit that matches
no recorded digest fails the load on this rank, the agreed poll aborts it on
every rank, and the request recomputes those pages (the hit is refused; what
the forward computed on them is never served). The refused units are
integrity mismatches naming request, page, part, layer, rank and node. Then,
as for every reused page, the request's pages are checked again when it
finishes. Under CP each rank records and checks the pages it owns.

The digest of a unit is two independent sums of its 32-bit words times
fixed random multipliers, modulo two primes below 2**31, packed into one
int64: any change of one word changes it, and two different pages collide
with probability about 2**-62. It runs where the bytes are (one batched
expression per (part, layer) over all pages, on the GPU on an H200), so
checking costs no host copy of KV.

(b) Output equivalence. For a sample of hit requests the last-token logits
the engine produced with the restored prefix are compared with a full
recompute of the prompt by the model's own forward (transformers' cache
object, chunked through `past_key_values`; no pages, no hicache), within
the preset's tolerance: |restored - recompute| <= atol + rtol *
max|recompute|. The presets use an index top-k above any prompt length, so
the sparse selection is the same in both. The MTP draft is held to the same
test (`recompute_outputs`): its last-token logits (the shared head over its
output at the last position, whose input is the target's first token) and
its proposed token, against the draft layer run over the recomputed target
hidden states with its own cache. A draft restored wrong (the fork's lost
draft state) leaves the target's logits intact and fails this one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hicache_cp.cp import mapping as cp_mapping
from hicache_cp.errors import ConsistencyError
from hicache_cp.layout import KVLayout, PartLayout
from hicache_cp.ops import LoadOp
from hicache_cp.pools import DevicePool

logger = logging.getLogger(__name__)

_P1 = 2_147_483_647  # 2**31 - 1
_P2 = 2_147_483_629  # the largest prime below 2**31 - 1
MAX_EXAMPLES = 100


@dataclass(frozen=True)
class UnitMismatch:
    """A reused unit whose bytes match no digest recorded for its content."""

    request: int
    position: int  # request-absolute page position
    part: str
    layer: int
    tier: str  # "l1" (device prefix) or "l2" (restored by a load)
    rank: int = 0
    node: int | None = None  # the tree node holding the page, where known
    refused: bool = False  # caught before use: the load was failed and the hit refused

    def __str__(self) -> str:
        where = f"rank {self.rank}" + (f" node {self.node}" if self.node is not None else "")
        what = "; hit refused" if self.refused else ""
        return f"request {self.request} page {self.position} {self.part} layer {self.layer} ({self.tier}, {where}{what})"


DIGEST_SEED = 0x5EED


def _multipliers(words: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two multiplier vectors of a unit of `words` 32-bit words: a pure
    function of `words` (any process, any device gets the same ones)."""
    gen = torch.Generator().manual_seed(DIGEST_SEED * 1_000_003 + words)
    r = torch.randint(1, _P1, (2, words), generator=gen, dtype=torch.int64)
    return r[0].to(device), r[1].to(device)


def unit_digests(pages: torch.Tensor, mult: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """int64 [n]: the digest of each row of uint8 `pages` [n, page_bytes] (page_bytes % 4 == 0),
    computed where `pages` lives. Allocates n x page_bytes/4 int64 temporaries."""
    words = pages.view(torch.int32).to(torch.int64)
    r1, r2 = mult if mult is not None else _multipliers(words.shape[1], pages.device)
    d1 = ((words * r1) % _P1).sum(dim=1) % _P1
    d2 = ((words * r2) % _P2).sum(dim=1) % _P2
    return d1 * (1 << 31) + d2


class Digester:
    """Digests of (part, layer) units of pages of the L1 pool, computed on its device."""

    def __init__(self, layout: KVLayout, device_pool: DevicePool) -> None:
        self.layout = layout
        self.pool = device_pool
        self.units: list[tuple[PartLayout, int]] = [(p, layer) for p in layout.parts for layer in p.layer_ids]
        self._mult = {p.page_bytes // 4: _multipliers(p.page_bytes // 4, device_pool.device) for p in layout.parts}

    @property
    def num_units(self) -> int:
        return len(self.units)

    def digests(self, physical_pages: np.ndarray) -> np.ndarray:
        """int64 [n, units] for these physical pages (one host sync)."""
        if len(physical_pages) == 0:
            return np.empty((0, self.num_units), np.int64)
        idx = torch.from_numpy(np.ascontiguousarray(physical_pages, np.int64)).to(self.pool.device)
        cols = []
        for p, layer in self.units:
            pages = self.pool.layer(p.part, p.slot(layer)).index_select(0, idx)
            cols.append(unit_digests(pages, self._mult[p.page_bytes // 4]))
        return torch.stack(cols, dim=1).cpu().numpy()


@dataclass
class DigestBook:
    """Digests recorded when pages were computed, by page content."""

    num_units: int
    book: dict[int, np.ndarray] = field(default_factory=dict)  # content -> [variants, units]
    variants: int = 0  # contents computed more than once with different bytes

    def expected(self, contents: np.ndarray) -> list[np.ndarray]:
        """The accepted digest rows [variants, units] of each content (KeyError: never recorded)."""
        return [self.book[key] for key in contents.tolist()]

    def record(self, contents: np.ndarray, digests: np.ndarray) -> None:
        for key, row in zip(contents.tolist(), digests):
            known = self.book.get(key)
            if known is None:
                self.book[key] = row[None, :].copy()
            elif not (known == row).all(axis=1).any():
                self.book[key] = np.vstack([known, row])
                self.variants += 1

    def check(self, contents: np.ndarray, digests: np.ndarray) -> np.ndarray:
        """bool [n, units]: does each unit equal a digest recorded for its content?"""
        ok = np.zeros(digests.shape, bool)
        for i, key in enumerate(contents.tolist()):
            known = self.book.get(key)
            if known is not None:
                ok[i] = (known == digests[i]).any(axis=0)
        return ok


@dataclass
class IntegrityTally:
    """What the byte checks covered and found (the replay report's integrity keys)."""

    checked_pages: int = 0
    checked_units: int = 0
    expected_units: int = 0  # reused pages x units, counted apart from the checker
    checked_l2_units: int = 0
    digest_variants: int = 0  # contents computed more than once with different bytes
    mismatches: int = 0
    restore_checked_units: int = 0  # units of loaded pages checked before use (`RestoreGuard`)
    refused_loads: int = 0  # loads failed because a restored unit matched no digest
    refused_units: int = 0  # those units (also counted in `mismatches`)
    examples: list[UnitMismatch] = field(default_factory=list)

    def add(self, found: list[UnitMismatch]) -> None:
        self.mismatches += len(found)
        room = MAX_EXAMPLES - len(self.examples)
        self.examples.extend(found[:room])
        for m in found[:room]:
            logger.warning("integrity mismatch: %s", m)


class RestoreGuard:
    """The byte check of restored pages before use (module docstring, (a)).

    Runs on every rank over the pages it owns; one host sync per call. A
    failed check sets the load's error, as a failed copy does: the next
    agreed poll aborts the load on every rank (docs/invariants.md rule 7: nothing here
    decides alone)."""

    def __init__(self, digester: Digester, book: DigestBook, tally: IntegrityTally, *, rank: int, cp_size: int) -> None:
        self.digester = digester
        self.book = book
        self.tally = tally
        self.rank = rank
        self.cp_size = cp_size

    def check(self, request: int, load: LoadOp, hashes: np.ndarray) -> bool:
        """Digest this rank's share of `load`'s pages (every copy of it must have
        landed) against the digests of their contents (`hashes`: the request's
        page hashes by position). False: the load is failed, the hit refused."""
        positions = load.first_position + np.arange(load.num_pages)
        mine = cp_mapping.owned_mask(load.device_pages, self.rank, self.cp_size)
        pos = positions[mine]
        if not len(pos):
            return True
        digests = self.digester.digests(cp_mapping.to_physical(load.device_pages[mine], self.cp_size))
        ok = self.book.check(hashes[pos], digests)
        self.tally.restore_checked_units += ok.size
        bad = np.argwhere(~ok)
        if not len(bad):
            return True
        units = self.digester.units
        found = [
            UnitMismatch(request, int(pos[i]), units[u][0].part.value, units[u][1], "l2", self.rank,
                         _node_at(load, int(pos[i])), refused=True)
            for i, u in bad
        ]  # fmt: skip
        self.tally.add(found)
        self.tally.refused_loads += 1
        self.tally.refused_units += len(found)
        first = found[0]
        load.error = load.error or ConsistencyError(
            f"restored bytes differ from what prefill computed ({len(found)} units); the hit is refused",
            node=first.node, pages=pos[np.unique(bad[:, 0])], part=first.part, layer=first.layer, rank=self.rank,
            details={"request": request, "position": first.position},
        )  # fmt: skip
        logger.warning("request %d: load %d refused: %s", request, load.id, load.error)
        return False


def _node_at(load: LoadOp, position: int) -> int | None:
    for node in load.nodes:
        if node.first_position <= position < node.first_position + node.num_pages:
            return int(node.id)
    return None


@dataclass
class OutputCheck:
    """One compared request of the output oracle."""

    request: int
    prompt_tokens: int
    hit_tokens: int
    l2_hit_tokens: int
    max_abs_err: float
    tolerance: float
    same_argmax: bool  # the greedy first token agrees
    #: The MTP draft's last-token logits and proposed token, held to the same tolerance.
    draft_max_abs_err: float = 0.0
    draft_tolerance: float = 0.0
    draft_same_token: bool = True

    @property
    def ok(self) -> bool:
        return self.max_abs_err <= self.tolerance

    @property
    def draft_ok(self) -> bool:
        return self.draft_max_abs_err <= self.draft_tolerance

    @property
    def draft_near_tie(self) -> bool:
        """The draft's logits are within the tolerance but its proposed token differs:
        two logits closer than the tolerance swapped (as the speculation oracle's near ties)."""
        return self.draft_ok and not self.draft_same_token


def recompute_logits(model: Any, ids: np.ndarray, chunk_tokens: int | None = None) -> torch.Tensor:
    """Last-token logits of a prompt computed from scratch by the model's own
    forward (transformers' cache object, no paging, no hicache): float32 [vocab]
    on the CPU. `chunk_tokens` prefills in chunks through `past_key_values`
    (exact against one forward, docs/platform.md) to bound the indexer's
    [tokens, heads, tokens] scores on long prompts."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    x = torch.from_numpy(np.asarray(ids, np.int64))[None].to(device)
    step = chunk_tokens or x.shape[1]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        for start in range(0, x.shape[1], step):
            out = model(input_ids=x[:, start : start + step], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float().cpu()


def recompute_outputs(
    m: Any, ids: np.ndarray, chunk_tokens: int | None = None, next_token: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, draft) last-token logits of a prompt computed from scratch, float32 on the CPU.

    The target runs as in `recompute_logits` (its own forward and cache
    object); a forward hook keeps the last decoder layer's output (the hidden
    state the MTP layer reads, before the final norm). The draft layer
    (`HfModel.draft`) then runs with its own cache over entries 1..n, one
    position ahead of the target as in transformers' MTP decoding: entry j
    reads token j (for j = n the target's greedy first token, or `next_token`
    when given) and the target hidden at j - 1; its logits are the shared head
    over its output at entry n.

    The output oracle passes the served run's first token as `next_token`, so
    both drafts read the same token: where two target logits closer than the
    tolerance swap, the served draft read the other one, and its logits
    (8.5 apart on the H200 at ef4f07b, serve-h200.json request 18) said
    nothing about the restored draft state."""
    from transformers import DynamicCache

    target, base, dev = m.target, m.target.model, m.device
    x = torch.from_numpy(np.asarray(ids, np.int64))[None].to(dev)
    n = x.shape[1]
    step = chunk_tokens or n
    hidden: list[torch.Tensor] = []
    hook = base.layers[-1].register_forward_hook(lambda mod, inp, out: hidden.append(out[0] if isinstance(out, tuple) else out))
    cache = DynamicCache(config=target.config)
    try:
        with torch.no_grad():
            for start in range(0, n, step):
                out = target(input_ids=x[:, start : start + step], past_key_values=cache, use_cache=True, logits_to_keep=1)
    finally:
        hook.remove()
    logits = out.logits[0, -1].float()
    h = torch.cat(hidden, dim=1)
    first = logits.argmax().view(1, 1) if next_token is None else torch.tensor([[next_token]], device=dev)
    draft_ids = torch.cat([x[:, 1:], first], dim=1)
    dcache = DynamicCache(config=m.draft_config)
    with torch.no_grad():
        for start in range(0, n, step):
            end = min(n, start + step)
            pos = torch.arange(start, end, device=dev)[None]
            emb = base.embed_tokens(draft_ids[:, start:end])
            mask = torch.zeros((end - start, end), dtype=m.dtype, device=dev)
            mask.masked_fill_(torch.arange(end, device=dev)[None] > pos[0][:, None], torch.finfo(m.dtype).min)
            d = m.draft(
                inputs_embeds=emb, previous_hidden_state=h[:, start:end],
                position_embeddings=base.rotary_emb(emb, position_ids=pos + 1), attention_mask=mask[None, None],
                position_ids=pos + 1, past_key_values=dcache, use_cache=True,
            )  # fmt: skip
        draft_logits = target.lm_head(d[:, -1]).float()[0]
    return logits.cpu(), draft_logits.cpu()


def compare_logits(restored: torch.Tensor, reference: torch.Tensor, atol: float, rtol: float) -> tuple[float, float, bool]:
    """(max |restored - reference|, the tolerance it is held to, same argmax)."""
    err = float((restored.float() - reference.float()).abs().max())
    return err, atol + rtol * float(reference.abs().max()), int(restored.argmax()) == int(reference.argmax())
