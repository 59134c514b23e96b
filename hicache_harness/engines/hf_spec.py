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

It runs twice per sampled request:

    recomputed  the whole prompt computed from scratch, then the steps, greedy
    restored    the snapshot's prefix (all-gathered to the full logical prefix
                under CP, `hf_cp.PrefixExchange`) up to the position the server
                resumed at (`scheduler.resume_position`), the rest of the prompt
                computed on top of it, then the same steps teacher-forced: every
                forward (target and draft) is fed the recomputed run's token

Forcing makes forward i of both runs see the same tokens, so only the prefix
KV can make them differ: every forward's target and draft logits are held to
the output oracle's tolerance, and every forward's picks (target token, draft
proposal) are compared. Left free, the restored run's greedy tokens would part
from the recompute's at the first near-tie argmax flip (bf16 rounding of a
batched, chunked forward: on the H200 at 01aa747 restored and recomputed
logits differed by 0.08-0.13, about 1% of the largest, against a tolerance of
3%), and every later forward would compare different contexts: there one
request of 8 failed that way (`max_abs_err` 11.3 against 0.246) while the
byte oracle found every page right. A differing pick is a *near tie* when both runs
hold the two tokens within the tolerance of each other, recorded and not a
mismatch; beyond it the runs decided differently and it is a mismatch. The
restored run's accept lengths are its own decisions at the recompute's steps
(`Speculator.run`), so they differ only where a pick does. With random
weights the lengths themselves mean little (the draft rarely proposes the
target's token); a draft whose prefix KV was restored wrong moves its logits,
and proposes other tokens once the difference is large, and a target
restored wrong verifies differently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hicache_cp.cp import mapping as cp_mapping
from hicache_harness.engines.hf_cp import Buffers, PrefixExchange, PrefixSource
from hicache_harness.engines.hf_forward import ForwardResult, PagedForward, ScratchKV, SeqChunk, SeqPlan
from hicache_harness.engines.scheduler import resume_position
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
    """One speculation run: per step its accept length, and every forward's picks.

    Forward 0 is the prompt's last position; forward i > 0 computes the
    token fed to it at position len(prompt) + i - 1: the run's own pick of
    forward i - 1 (greedy), or the reference's (`forced`). A run of K steps
    makes 1 + sum(accept_lengths) forwards."""

    accept_lengths: list[int] = field(default_factory=list)
    #: Per forward, (the target's greedy token, the draft's proposal for the token after it).
    picks: list[tuple[int, int]] = field(default_factory=list)
    proposals: list[int] = field(default_factory=list)  # the draft token each step verified
    #: Every forward's last-token logits, target and draft side by side (CPU float32 [2, vocab]).
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)
    forced: bool = False  # fed the reference's tokens, not its own picks

    @property
    def tokens(self) -> list[int]:
        """The target's pick of every forward: for a greedy run the first token,
        then what each step emitted."""
        return [t for t, _ in self.picks]

    @property
    def mean_accept(self) -> float:
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else 0.0


@dataclass(frozen=True)
class Flip:
    """A forward where the restored run's pick differs from the recompute's, on
    the same context. `margin` is the larger of the two runs' logit gaps
    between the two tokens (the recompute's logit of its pick minus that of the
    restored pick, and the other way round): within the tolerance it is a near
    tie, which rounding explains; beyond it the two runs decided differently."""

    forward: int
    model: Model
    recomputed: int
    restored: int
    margin: float

    def record(self) -> dict[str, Any]:
        return {"forward": self.forward, "model": self.model.value, "recomputed": self.recomputed,
                "restored": self.restored, "margin": self.margin}  # fmt: skip


@dataclass
class SpecCheck:
    """Restored against recomputed, for one request, teacher-forced.

    The recomputed run is greedy; the restored run is fed the recomputed
    run's tokens (`Speculator.check`), so forward i of both sees the same
    tokens and only the prefix KV differs: every forward's target and draft
    logits are compared, and so are the picks. A pick that differs (`Flip`)
    is a near tie when both runs hold the two tokens within the tolerance of
    each other, and a mismatch otherwise. The restored run's accept lengths
    and proposals are its own decisions at the recompute's steps, so they
    differ from the recompute's only where a pick differs."""

    request: int
    restored_tokens: int  # prefix tokens the restored run took from the cache
    restored: SpecRun
    recomputed: SpecRun
    tolerance: float = 0.0  # on the logits of every forward, target's and draft's

    def __post_init__(self) -> None:
        assert self.restored.forced and not self.recomputed.forced, "the restored run is fed the recompute's tokens"
        assert len(self.restored.logits) == len(self.recomputed.logits) == len(self.recomputed.picks), (
            f"request {self.request}: {len(self.restored.logits)} restored forwards, {len(self.recomputed.logits)} recomputed")

    @property
    def max_abs_err(self) -> float:
        """The largest |restored - recomputed| logit over every forward, target's and draft's."""
        pairs = zip(self.restored.logits, self.recomputed.logits)
        return max((float((a - b).abs().max()) for a, b in pairs), default=0.0)

    @property
    def flips(self) -> list[Flip]:
        """Every forward and model whose pick differs, in order. O(forwards)."""
        out = []
        for i, (a, b, la, lb) in enumerate(zip(self.restored.picks, self.recomputed.picks, self.restored.logits,
                                               self.recomputed.logits)):  # fmt: skip
            for row, model in enumerate((Model.TARGET, Model.DRAFT)):
                mine, ref = a[row], b[row]
                if mine != ref:
                    margin = max(float(lb[row, ref] - lb[row, mine]), float(la[row, mine] - la[row, ref]))
                    out.append(Flip(i, model, ref, mine, margin))
        return out

    @property
    def near_ties(self) -> list[Flip]:
        return [f for f in self.flips if f.margin <= self.tolerance]

    @property
    def decided_differently(self) -> list[Flip]:
        return [f for f in self.flips if f.margin > self.tolerance]

    @property
    def same(self) -> bool:
        """Every logit within the tolerance and every differing pick a near tie."""
        return self.max_abs_err <= self.tolerance and not self.decided_differently


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

    def check(self, request: int, ids: np.ndarray, store: ScratchKV, start: int, atol: float, rtol: float) -> SpecCheck:
        """Greedy steps over a recompute, then the same steps over `store`'s prefix
        [0, start), teacher-forced with the recompute's tokens. The tolerance is the
        output oracle's, atol + rtol * max |recomputed logit| over every forward."""
        recomputed = self.run(ids, ScratchKV(), 0)
        restored = self.run(ids, store, start, forced=recomputed)
        scale = max(float(t.abs().max()) for t in recomputed.logits)
        return SpecCheck(request, start, restored, recomputed, atol + rtol * scale)

    def run(self, ids: np.ndarray, store: ScratchKV, start: int, forced: SpecRun | None = None) -> SpecRun:
        """Compute positions [start, len(ids)) over `store`'s prefix [0, start), then the steps.

        Greedy (`forced` None): each forward is fed the previous forward's
        target pick, and each step's decision picks the next step's forwards.
        Forced: each forward is fed `forced`'s token instead (the draft too,
        `SeqChunk.forced_token`), the steps follow `forced`'s accept lengths,
        and each step records this run's own decision there: accept when its
        target's pick at the verifying forward equals its draft's proposal.
        Either way one forward per token: 1 + sum(accept lengths) forwards."""
        out = SpecRun(forced=forced is not None)
        n = len(ids)

        def pick(i: int) -> tuple[int, int]:
            """Forward i's picks, computing the forwards up to it."""
            while len(out.picks) <= i:
                j = len(out.picks)
                fed = forced.tokens[j - 1] if forced is not None else out.picks[j - 1][0]
                forced_next = forced.tokens[j] if forced is not None else None
                out.picks.append(self._one(out, store, fed, n + j - 1, forced_next))
            return out.picks[i]

        forced_first = forced.tokens[0] if forced is not None else None
        out.picks.append(self._keep(out, self._prompt(ids, store, start, forced_first)))
        at = 0  # the forward whose target pick is pending (its draft pick is the proposal)
        for k in range(self.steps):
            proposal = pick(at)[1]
            accepted = pick(at + 1)[0] == proposal  # then the forward after it gives the bonus token
            out.proposals.append(proposal)
            out.accept_lengths.append(2 if accepted else 1)
            at += forced.accept_lengths[k] if forced is not None else out.accept_lengths[-1]
        pick(at)  # the last step's bonus token, when it accepted
        return out

    def _prompt(self, ids: np.ndarray, store: ScratchKV, start: int, forced: int | None) -> ForwardResult:
        pos = start
        r: ForwardResult | None = None
        while pos < len(ids):
            end = min(len(ids), pos + self.chunk)
            nxt = None if end == len(ids) else int(ids[end])
            chunk = SeqChunk(ids[pos:end], pos, None, 0, 0, nxt, forced if nxt is None else None)
            plan = SeqPlan.build(chunk, self.ps)
            r = self.fw.run([(plan, store.bind(plan))])
            pos = end
        assert r is not None, f"nothing to compute: start {start} of {len(ids)} tokens"
        return r

    def _one(self, out: SpecRun, store: ScratchKV, token: int, position: int, forced: int | None) -> tuple[int, int]:
        """The target and the draft on one token: (target's next token, draft's proposal
        after it, or after `forced` when given)."""
        plan = SeqPlan.build(SeqChunk(np.array([token], np.int64), position, None, 0, 0, None, forced), self.ps)
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
        "spec_near_ties": sum(len(c.near_ties) for c in checks),
        "spec_comparison": "teacher-forced: the restored run is fed the recompute's tokens; a differing pick whose "
                           "two tokens both runs hold within the tolerance is a near tie, not a mismatch",
        "spec_checks": [
            {"request": c.request, "restored_tokens": c.restored_tokens, "same": c.same,
             "max_abs_err": c.max_abs_err, "tolerance": c.tolerance,
             "near_ties": [f.record() for f in c.near_ties],
             "decided_differently": [f.record() for f in c.decided_differently],
             "accept_lengths_restored": c.restored.accept_lengths, "accept_lengths_recomputed": c.recomputed.accept_lengths,
             "tokens_restored": c.restored.tokens, "tokens_recomputed": c.recomputed.tokens,
             "proposals_restored": c.restored.proposals, "proposals_recomputed": c.recomputed.proposals}
            for c in checks
        ],
    }  # fmt: skip

