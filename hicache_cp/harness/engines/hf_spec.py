"""The output oracles' samples, and MTP speculation from a restored prefix against a recompute.

`OracleSamples` picks, while serving, the hit requests the output oracles
check (`--check-outputs N`): requests whose hit was refused or whose load
aborted first (they were recomputed: is what they served right?), then
those restored from L2, then L1-only hits, each in the order they finished
(replicated, so every CP rank picks the same ones). When speculation is
measured it also keeps a *snapshot* of each candidate's reused prefix: this
rank's owned pages of every part and layer, copied out of its L1 while the
request still holds them (up to 3N snapshots are held at once).

Speculation (`speculate`), greedy, with the one MTP draft layer: after the
prompt, the draft has proposed the token after the first token. A step lets
the target verify the pending proposal: the target computes the pending
token; if its greedy next token equals the proposal, the proposal is
accepted and the target computes it too, giving the bonus token (accept
length 2); otherwise the target's token replaces it (accept length 1). After
each target token the draft layer runs on it and proposes the next. The
target verifies token by token rather than the pending pair in one forward:
with greedy decoding and one draft token a step the decisions are the same,
and the engine's forward needs no per-position logits.

It runs twice per sampled request, from the same start:

    restored    the snapshot's prefix (all-gathered to the full logical prefix
                under CP, `hf_cp.PrefixExchange`) up to the position the server
                resumed at (`scheduler.resume_position`), the rest of the prompt
                computed on top of it, then the steps
    recomputed  the whole prompt computed from scratch, then the steps

and the two runs' accept lengths, tokens and proposals are compared, and
every forward's target and draft logits within the output oracle's
tolerance. With random weights the lengths themselves mean little (the
draft rarely proposes the target's token); a draft whose prefix KV was
restored wrong moves its logits, and proposes other tokens once the
difference is large, and a target restored wrong verifies differently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hicache_cp.cp import mapping as cp_mapping
from hicache_cp.harness.engines.hf_cp import Buffers, PrefixExchange, PrefixSource
from hicache_cp.harness.engines.hf_forward import ForwardResult, PagedForward, ScratchKV, SeqChunk, SeqPlan
from hicache_cp.harness.engines.scheduler import resume_position
from hicache_cp.layout import Model


@dataclass
class Sample:
    """A request the output oracles check."""

    request: int
    ids: np.ndarray
    reused_pages: int
    restored_pages: int  # of them, restored from L2
    priority: int  # 0: recomputed after a refused or aborted load, 1: L2 hit, 2: L1 hit
    snapshot: PrefixSource | None = None


class OracleSamples:
    """See the module docstring. `offer` is the scheduler's `on_finish`."""

    def __init__(self, n: int, *, snapshots: bool, buffers: Buffers, rank: int, cp_size: int, page_size: int,
                 flagged: Any = frozenset()) -> None:  # fmt: skip
        self.n = n
        self.snapshots = snapshots
        self.buffers = buffers
        self.rank = rank
        self.cp_size = cp_size
        self.ps = page_size
        self.flagged = flagged  # requests a fault hit (`hf_faults`): checked first
        self.kept: list[list[Sample]] = [[], [], []]

    def offer(self, seq: Any) -> None:
        """A finished request (`scheduler.Seq`, its pages still held)."""
        reused = int(seq.reuse_pages)
        redone = seq.redo_load is not None or seq.req.index in self.flagged
        if not reused and not redone:
            return
        restored = max(0, reused - int(seq.m.device_len))
        priority = 0 if redone else 1 if restored else 2
        bucket = self.kept[priority]
        if len(bucket) >= self.n:
            return
        snap = self._snapshot(seq, reused) if self.snapshots else None
        bucket.append(Sample(seq.req.index, seq.ids, reused, restored, priority, snap))

    def chosen(self) -> list[Sample]:
        return [s for bucket in self.kept for s in bucket][: self.n]

    def _snapshot(self, seq: Any, reused: int) -> PrefixSource:
        """This rank's owned pages of the reused prefix, copied out of L1."""
        table = seq.table[:reused]
        owners = cp_mapping.owner(table, self.cp_size)
        mine = np.flatnonzero(owners == self.rank)
        idx = torch.from_numpy(np.ascontiguousarray(seq.pages[mine], np.int64)).to(next(iter(self.buffers.values()))[0].device)
        copy = {p: [t.index_select(0, idx) for t in layers] for p, layers in self.buffers.items()}
        physical = np.zeros(reused, np.int64)
        physical[mine] = np.arange(len(mine))
        return PrefixSource(copy, physical, owners, resume_position(reused, self.ps, len(seq.ids)))


@dataclass
class SpecRun:
    """One speculation run: per step its accept length, and every token it produced."""

    accept_lengths: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the first token, then what each step emitted
    proposals: list[int] = field(default_factory=list)  # the draft token each step verified
    #: Every forward's last-token logits, target and draft side by side (CPU float32 [2, vocab]).
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def mean_accept(self) -> float:
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else 0.0


@dataclass
class SpecCheck:
    """Restored against recomputed, for one request."""

    request: int
    restored_tokens: int  # prefix tokens the restored run took from the cache
    restored: SpecRun
    recomputed: SpecRun
    tolerance: float = 0.0  # on the logits of every forward, target's and draft's

    @property
    def max_abs_err(self) -> float:
        """The largest |restored - recomputed| logit over the forwards both runs made alike."""
        pairs = zip(self.restored.logits, self.recomputed.logits)
        return max((float((a - b).abs().max()) for a, b in pairs), default=0.0)

    @property
    def same(self) -> bool:
        """Equal accept lengths, tokens and proposals, and logits within the tolerance
        (a draft prefix restored wrong may keep the argmax of random weights)."""
        a, b = self.restored, self.recomputed
        exact = (a.accept_lengths, a.tokens, a.proposals) == (b.accept_lengths, b.tokens, b.proposals)
        return exact and self.max_abs_err <= self.tolerance


class Speculator:
    """Runs `SpecRun`s of one model (module docstring)."""

    def __init__(self, forward: PagedForward, chunk_tokens: int, steps: int) -> None:
        self.fw = forward
        self.ps = forward.m.preset.page_size
        self.chunk = chunk_tokens
        self.steps = steps

    def restored_prefixes(self, exchange: PrefixExchange, samples: Sequence[Sample]) -> list[ScratchKV]:
        """Each sample's snapshot as a full logical prefix in a private store (one
        exchange per layer of each model: collectives, on every rank alike)."""
        stores = [ScratchKV() for _ in samples]
        sources = [s.snapshot for s in samples]
        assert all(src is not None for src in sources), "speculation needs the samples' snapshots"
        # the draft reads one entry more than the target (`hf_forward`)
        draft = [dataclasses.replace(src, tokens=src.tokens + 1 if src.tokens else 0) for src in sources]  # type: ignore[type-var]
        for model, layers, rows in ((Model.TARGET, self.fw.m.num_layers, sources), (Model.DRAFT, 1, draft)):
            for layer in range(layers):
                full = exchange.gather(exchange.parts_of(model, layer), rows)  # type: ignore[arg-type]
                for store, prefix in zip(stores, full):
                    for key, t in prefix.items():
                        store.kv[key] = t[0]
        return stores

    def run(self, ids: np.ndarray, store: ScratchKV, start: int) -> SpecRun:
        """Compute positions [start, len(ids)) over `store`'s prefix [0, start), then the steps."""
        out = SpecRun()
        r = self._prompt(ids, store, start)
        n = len(ids)
        pending, proposal = self._keep(out, r)
        out.tokens.append(pending)
        for _ in range(self.steps):
            out.proposals.append(proposal)
            nxt, after = self._one(out, store, pending, n)
            n += 1
            if nxt == proposal:  # accepted: the target computes it and gives the bonus token
                bonus, proposal = self._one(out, store, nxt, n)
                n += 1
                out.accept_lengths.append(2)
                out.tokens += [nxt, bonus]
                pending = bonus
            else:
                out.accept_lengths.append(1)
                out.tokens.append(nxt)
                pending, proposal = nxt, after
        return out

    def _prompt(self, ids: np.ndarray, store: ScratchKV, start: int) -> ForwardResult:
        pos = start
        r: ForwardResult | None = None
        while pos < len(ids):
            end = min(len(ids), pos + self.chunk)
            nxt = None if end == len(ids) else int(ids[end])
            plan = SeqPlan.build(SeqChunk(ids[pos:end], pos, None, 0, 0, nxt), self.ps)
            r = self.fw.run([(plan, store.bind(plan))])
            pos = end
        assert r is not None, f"nothing to compute: start {start} of {len(ids)} tokens"
        return r

    def _one(self, out: SpecRun, store: ScratchKV, token: int, position: int) -> tuple[int, int]:
        """The target and the draft on one token: (target's next token, draft's proposal after it)."""
        plan = SeqPlan.build(SeqChunk(np.array([token], np.int64), position, None, 0, 0, None), self.ps)
        return self._keep(out, self.fw.run([(plan, store.bind(plan))]))

    @staticmethod
    def _keep(out: SpecRun, r: ForwardResult) -> tuple[int, int]:
        """Record a final forward's logits; (its sampled token, the draft's proposal)."""
        out.logits.append(torch.stack([r.logits[0], r.draft_logits[0]]).float().cpu())  # type: ignore[index]
        return int(r.next_tokens[0]), int(r.draft_tokens[0])  # type: ignore[index]


def spec_report(checks: Sequence[SpecCheck], steps: int) -> dict[str, Any]:
    """The report keys of the speculation comparison."""
    restored = [x for c in checks for x in c.restored.accept_lengths]
    recomputed = [x for c in checks for x in c.recomputed.accept_lengths]
    return {
        "spec_steps": steps,
        "spec_checked": len(checks),
        "spec_mismatches": sum(not c.same for c in checks),
        "spec_accept_mean_restored": float(np.mean(restored)) if restored else None,
        "spec_accept_mean_recomputed": float(np.mean(recomputed)) if recomputed else None,
        "spec_max_abs_err": max((c.max_abs_err for c in checks), default=0.0),
        "spec_checks": [
            {"request": c.request, "restored_tokens": c.restored_tokens, "same": c.same,
             "max_abs_err": c.max_abs_err, "tolerance": c.tolerance,
             "accept_lengths_restored": c.restored.accept_lengths, "accept_lengths_recomputed": c.recomputed.accept_lengths,
             "tokens_restored": c.restored.tokens, "tokens_recomputed": c.recomputed.tokens,
             "proposals_restored": c.restored.proposals, "proposals_recomputed": c.recomputed.proposals}
            for c in checks
        ],
    }  # fmt: skip

