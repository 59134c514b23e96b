"""The real engine's oracles for the MTP draft, speculation, and faults on one rank.

- The draft runs one position ahead of the target (its entry j reads token j
  and the target's hidden state at j - 1, as in transformers' MTP decoding),
  so a cached page's draft KV depends on its prefix only: a forward over
  restored pages gives the draft logits of a recompute.
- The draft oracle sees what the target's does not: a prefix whose draft
  state was lost (the fork's bug) leaves the target's logits intact.
- Speculation from a restored prefix, fed the recompute's tokens, repeats the
  recompute's accept lengths, tokens and proposals; from a wrong prefix it
  does not. A pick flipped by less than the tolerance is a near tie, not a
  mismatch; one flipped by more is a mismatch.
- Faults in L2 on the real model at CP 1: corrupt draft KV, corrupt indexer
  keys, a failed copy. Never served: refused (exit 1, named) or recomputed.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", minversion="5.20")

from hicache_harness.cli import main  # noqa: E402
from hicache_harness.engines import hf_model  # noqa: E402
from hicache_harness.engines.hf_cp import PrefixExchange, PrefixSource  # noqa: E402
from hicache_harness.engines.hf_faults import FaultKind, HfFault  # noqa: E402
from hicache_harness.engines.hf_forward import PagedForward, PagedKV, ScratchKV, SeqChunk, SeqPlan  # noqa: E402
from hicache_harness.engines.hf_oracle import OutputCheck, recompute_outputs  # noqa: E402
from hicache_harness.engines.hf_spec import Flip, Sample, SpecCheck, SpecRun, Speculator  # noqa: E402
from hicache_harness.errors import InputError  # noqa: E402
from hicache_harness.replay.report import integrity_failures  # noqa: E402
from hicache_cp.layout import Model, Part  # noqa: E402

PS = 8


@pytest.fixture(scope="module")
def model() -> hf_model.HfModel:
    return hf_model.build("tiny")


def prefill(m: hf_model.HfModel, fw: PagedForward, bufs: Any, ids: np.ndarray, pages: np.ndarray, first: int = 0) -> Any:
    """Compute `ids` into `pages` from position `first` on (positions before it are
    in the pages already), in chunks of 32 new tokens, as the scheduler does."""
    n_whole = len(ids) // PS * PS
    progress, r = first, None
    while True:
        start = max(0, progress - 1)
        end = min(len(ids), progress + 32)
        if end < len(ids):
            end = end // PS * PS
        seq = SeqChunk(ids[start:end], start, pages, progress, max(progress, min(end, n_whole)),
                       None if end == len(ids) else int(ids[end]))  # fmt: skip
        plan = SeqPlan.build(seq, PS)
        r = fw.run([(plan, PagedKV(bufs, plan))])
        progress = end
        if end == len(ids):
            return r


def test_draft_on_restored_pages_equals_a_recompute_and_depends_on_its_own_kv(model: hf_model.HfModel) -> None:
    """A prompt continued over pages another prompt computed (a shared prefix of 5
    pages, followed by different tokens) gives the target and draft logits of a
    recompute; zeroing the shared pages' draft KV moves the draft's logits only."""
    m, fw = model, PagedForward(model)
    rng = np.random.default_rng(7)
    shared = rng.integers(0, m.vocab_size, 5 * PS)
    a = np.concatenate([shared, rng.integers(0, m.vocab_size, 12)])
    b = np.concatenate([shared, rng.integers(0, m.vocab_size, 21)])
    bufs = m.kv_buffers(32)
    prefill(m, fw, bufs, a, np.arange(1, 8))
    pages_b = np.concatenate([np.arange(1, 6), np.arange(10, 14)])
    r = prefill(m, fw, bufs, b, pages_b, first=5 * PS)  # reuses a's 5 pages
    ref, draft_ref = recompute_outputs(m, b)
    assert float((r.logits[0] - ref).abs().max()) < 1e-5
    assert float((r.draft_logits[0] - draft_ref).abs().max()) < 1e-5
    assert int(r.draft_tokens[0]) == int(draft_ref.argmax())
    for part in (Part.DRAFT_KV, Part.DRAFT_STATE):  # the draft state is lost on a hit
        for t in bufs[part]:
            t[1:6] = 0
    lost = prefill(m, fw, bufs, b, pages_b, first=5 * PS)
    assert float((lost.logits[0] - ref).abs().max()) < 1e-5  # the target's oracle passes
    assert float((lost.draft_logits[0] - draft_ref).abs().max()) > 1e-3  # the draft's does not


def test_the_recomputed_draft_reads_the_served_first_token(model: hf_model.HfModel, monkeypatch) -> None:
    """A near tie in the target's logits makes the served first token differ from
    the recompute's; the served draft then read another token. The oracle feeds
    the recompute's draft the served token, so only a draft-state fault moves it."""
    from hicache_harness.engines import hf as hf_engine

    m = model
    ids = np.random.default_rng(11).integers(0, m.vocab_size, 3 * PS + 7)
    ref, own = recompute_outputs(m, ids)
    first = int(ref.argmax())
    _, same = recompute_outputs(m, ids, next_token=first)
    _, other = recompute_outputs(m, ids, next_token=(first + 1) % m.vocab_size)
    assert torch.equal(own, same)
    assert float((own - other).abs().max()) > 1e-3  # another token: another draft output
    seen: list[int | None] = []

    def spy(model_: Any, ids_: np.ndarray, chunk: int | None = None, next_token: int | None = None) -> Any:
        seen.append(next_token)
        return recompute_outputs(model_, ids_, chunk, next_token)

    monkeypatch.setattr(hf_engine, "recompute_outputs", spy)
    assert main(["replay", "--engine", "hf", "--limit", "30", "--check-outputs", "3"]) == 0
    assert len(seen) == 3 and all(isinstance(t, int) for t in seen), seen  # the served token, never None


def _speculation_sample(m: hf_model.HfModel) -> tuple[np.ndarray, Speculator, Sample, int]:
    """A 6-page prompt prefilled into pages 1..6, a 6-step speculator, and the
    oracle's sample of that prefix resumed at its last reused position."""
    fw = PagedForward(m)
    ids = np.random.default_rng(3).integers(0, m.vocab_size, 6 * PS + 5)
    bufs = m.kv_buffers(16)
    pages = np.arange(1, 7)
    prefill(m, fw, bufs, ids, pages)
    start = 6 * PS - 1  # the server resumes at the last reused position
    sample = Sample(0, ids, 6, 6, 1, PrefixSource(bufs, pages, np.zeros(6, np.int64), start))
    return ids, Speculator(fw, 32, steps=6), sample, start


def test_speculation_from_restored_kv_repeats_the_recompute(model: hf_model.HfModel) -> None:
    """From a prefix restored exactly (a snapshot of its pages, rebuilt by the
    exchange) the steps equal the recompute's; from a prefix whose draft KV is
    noise the draft proposes other tokens."""
    m = model
    ids, spec, sample, start = _speculation_sample(m)
    exact = spec.restored_prefixes(PrefixExchange(m, 0, 1), [sample])[0]
    check = spec.check(0, ids, exact, start, m.preset.logits_atol, m.preset.logits_rtol)
    assert check.same and len(check.restored.accept_lengths) == 6 and check.max_abs_err < 1e-5
    assert check.restored.accept_lengths == check.recomputed.accept_lengths and not check.flips
    assert check.restored.tokens == check.recomputed.tokens and check.restored.proposals == check.recomputed.proposals
    assert sum(check.restored.accept_lengths) + 1 == len(check.restored.tokens)
    assert sample.snapshot is not None
    for part in (Part.DRAFT_KV, Part.DRAFT_STATE):  # the pool the sample's prefix lies in
        for t in sample.snapshot.buffers[part]:
            t[1:7] = torch.randn_like(t[1:7]) * 10
    noisy = spec.restored_prefixes(PrefixExchange(m, 0, 1), [sample])[0]
    wrong = spec.check(0, ids, noisy, start, m.preset.logits_atol, m.preset.logits_rtol)
    assert not wrong.same and wrong.restored.proposals != wrong.recomputed.proposals
    assert wrong.decided_differently and all(f.model is Model.DRAFT for f in wrong.flips)  # the target's KV is right
    assert wrong.restored.tokens == wrong.recomputed.tokens


@contextlib.contextmanager
def nudged_head(m: hf_model.HfModel, call: int, above: float) -> Iterator[None]:
    """While open, the `call`-th output of the shared head (0-based; a final
    forward calls it for the target, then for the draft) has its runner-up
    logit raised to the top logit + `above`: that forward's target pick flips."""
    calls = 0

    def hook(mod: Any, inp: Any, out: torch.Tensor) -> torch.Tensor | None:
        nonlocal calls
        calls += 1
        if calls - 1 != call:
            return None
        out = out.clone()
        top = out[0].topk(2)
        out[0, top.indices[1]] = top.values[0] + above
        return out

    handle = m.target.lm_head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
    assert calls > call, f"the head was called {calls} times, never the {call}-th"


def test_speculation_near_tie_flip_is_a_tie_and_a_larger_flip_a_mismatch(model: hf_model.HfModel) -> None:
    """The H200 failure on the tiny model: the restored run's target pick at one
    forward flips to the runner-up (its logit raised past the top, by less than
    the tolerance). Fed the recompute's tokens, the restored run compares every
    later forward on the same context: one near tie, the logits within the
    tolerance, not a mismatch. Left free (greedy, the comparison before forcing),
    the tokens part there and the later logits differ far beyond the tolerance.
    The same flip by more than the tolerance is a mismatch."""
    m = model
    ids, spec, sample, start = _speculation_sample(m)

    def restored_store() -> ScratchKV:  # a run appends to its store: a fresh copy of the prefix each time
        return spec.restored_prefixes(PrefixExchange(m, 0, 1), [sample])[0]

    recomputed = spec.run(ids, ScratchKV(), 0)
    k = 2  # the forward whose target pick flips (the head's call 2k: one prompt chunk, then one token a forward)
    top = recomputed.logits[k][0].topk(2)
    gap = float(top.values[0] - top.values[1])  # the recompute's top-2 gap at forward k
    runner_up = int(top.indices[1])
    tol = 2 * gap
    # near tie: the runner-up moves by 1.5 gap (< tol) and leads by 0.5 gap
    with nudged_head(m, 2 * k, above=gap / 2):
        restored = spec.run(ids, restored_store(), start, forced=recomputed)
    check = SpecCheck(0, start, restored, recomputed, tol)
    (flip,) = check.flips
    assert (flip.forward, flip.model, flip.recomputed, flip.restored) == (k, Model.TARGET, recomputed.tokens[k], runner_up)
    assert flip.margin == pytest.approx(gap, abs=1e-5)  # the recompute's gap; the restored side's is 0.5 gap
    assert check.same and check.near_ties == [flip] and not check.decided_differently
    # every other forward, the draft at k included (it read the recompute's token), compares the same context
    assert check.max_abs_err == pytest.approx(1.5 * gap, abs=1e-5)
    assert [i for i, (a, b) in enumerate(zip(restored.tokens, recomputed.tokens)) if a != b] == [k]
    assert len(restored.accept_lengths) == 6 and len(restored.logits) == len(recomputed.logits)
    # the free-running comparison: the flipped token is fed on, and the later forwards' logits move
    with nudged_head(m, 2 * k, above=gap / 2):
        free = spec.run(ids, restored_store(), start)
    assert free.tokens[: k + 1] == restored.tokens[: k + 1] and free.tokens[k + 1 :] != recomputed.tokens[k + 1 :]
    later = max(float((a - b).abs().max()) for a, b in zip(free.logits[k + 1 :], recomputed.logits[k + 1 :]))
    assert later > 5 * tol, (later, tol)
    # beyond the tolerance: the runner-up moves by 6 gap and leads by 5 gap
    with nudged_head(m, 2 * k, above=5 * gap):
        restored = spec.run(ids, restored_store(), start, forced=recomputed)
    check = SpecCheck(0, start, restored, recomputed, tol)
    assert not check.same and check.max_abs_err > tol
    (flip,) = check.decided_differently
    assert (flip.forward, flip.restored) == (k, runner_up) and flip.margin == pytest.approx(5 * gap, abs=1e-5)
    assert not check.near_ties


def _run(picks: list[tuple[int, int]], logits: list[list[list[float]]], forced: bool) -> SpecRun:
    return SpecRun([1], picks, [picks[0][1]], [torch.tensor(x) for x in logits], forced)


def test_a_differing_pick_is_a_near_tie_only_when_both_runs_hold_it_within_the_tolerance() -> None:
    """Tolerance 0.1, two forwards of a 3-token vocabulary (rows: target, draft)."""
    second = [[1.0, 0.5, 0.0], [0.85, 1.0, 0.0]]  # forward 1 of the recompute: the draft picks 1 by 0.15
    ref = _run([(0, 2), (0, 1)], [[[1.0, 0.95, 0.0], [0.0, 0.0, 1.0]], second], False)
    # forward 0's target: restored 0.97 / 0.99 against 1.0 / 0.95: gaps 0.05 and 0.02, a near tie
    tie = _run([(1, 2), (0, 1)], [[[0.97, 0.99, 0.0], [0.0, 0.0, 1.0]], second], True)
    check = SpecCheck(0, 8, tie, ref, 0.1)
    assert check.same and check.near_ties == [Flip(0, Model.TARGET, 0, 1, pytest.approx(0.05))]
    # forward 1's draft: restored 0.93 / 0.92, every logit within 0.1 (0.08), but the
    # recompute holds its pick 0.15 ahead: the runs decided differently
    apart = _run([(0, 2), (0, 0)], [[[1.0, 0.95, 0.0], [0.0, 0.0, 1.0]], [second[0], [0.93, 0.92, 0.0]]], True)
    check = SpecCheck(0, 8, apart, ref, 0.1)
    assert check.max_abs_err == pytest.approx(0.08) and not check.same and not check.near_ties
    assert check.decided_differently == [Flip(1, Model.DRAFT, 1, 0, pytest.approx(0.15))]
    # picks alike, one logit 0.2 off: a mismatch
    off = _run([(0, 2), (0, 1)], [[[1.0, 0.95, 0.2], [0.0, 0.0, 1.0]], second], True)
    check = SpecCheck(0, 8, off, ref, 0.1)
    assert not check.flips and not check.same


def test_fault_specs_parse_or_fail_as_one_line() -> None:
    f = HfFault.parse("corrupt:draft_kv:0@1#2")
    assert (f.kind, f.part, f.layer, f.rank, f.nth) == (FaultKind.CORRUPT, Part.DRAFT_KV, 0, 1, 2)
    assert HfFault.parse("fail-copy:target_kv:2@0").nth == 1
    for bad in ("corrupt:draft_kv:0", "melt:draft_kv:0@0", "corrupt:kv:0@0", "corrupt:draft_kv:x@0", "corrupt:draft_kv:0@0#0"):
        with pytest.raises(InputError):
            HfFault.parse(bad)


def replay(path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    rc = main(["replay", "--engine", "hf", "--limit", "40", "--check-outputs", "5", *extra, "--json", str(path)])
    return rc, json.loads(path.read_text())


def test_cp1_faults_are_refused_or_recomputed_never_served(tmp_path: Path) -> None:
    """Corrupt draft KV (1st load), corrupt indexer keys (2nd), a failed copy (3rd):
    both corrupt hits are refused before use and named (exit 1), the failed copy
    aborts its load; each request is recomputed and its outputs are right."""
    faults = ["corrupt:draft_kv:0@0", "corrupt:target_state:1@0#2", "fail-copy:target_kv:2@0#3"]
    # the engine's own checks: the library's restore checks (off here) would refuse the corrupt copies first
    rc, r = replay(tmp_path / "faults.json", "--set", "verify_restores=off", *(a for f in faults for a in ("--hf-fault", f)))
    assert rc == 1 and r["integrity_failures"]
    injected = [f for f in r["faults_injected"]]
    assert [f["fault"].split("#")[0] for f in injected] == [f.split("#")[0] for f in faults]
    assert len({f["request"] for f in injected}) == 3  # three different loads
    for f in injected[:2]:
        name = (f"request {f['request']} page {f['page']} {f['part']} layer {f['layer']} "
                f"(l2, rank 0 node {f['node']}; hit refused)")  # fmt: skip
        assert name in r["mismatch_examples"], (name, r["mismatch_examples"])
    # Refused hits are byte mismatches caught before use; a later hit on the same corrupt copy is refused again.
    assert r["loads_refused"] >= 2 and r["integrity_mismatches"] == r["integrity_refused_units"] >= 2
    rows = {p["request"]: p for p in r["per_request"]}
    assert all(rows[f["request"]]["redone"] and rows[f["request"]]["served"] for f in injected)
    assert r["redone_requests"] >= 3
    checked = {c["request"]: c for c in r["output_checks"]}
    assert {f["request"] for f in injected} <= set(checked)
    assert r["outputs_mismatches"] == 0 and r["draft_outputs_mismatches"] == 0 and r["spec_mismatches"] == 0


def test_cp1_a_failed_copy_alone_is_recomputed_and_the_run_is_clean(tmp_path: Path) -> None:
    rc, r = replay(tmp_path / "copy.json", "--hf-fault", "fail-copy:draft_state:0@0")
    assert rc == 0 and not r["integrity_failures"]
    (f,) = r["faults_injected"]
    assert r["loads_refused"] == 0 and r["integrity_mismatches"] == 0
    assert r["integrity_checked_units"] == r["integrity_expected_units"] > 0
    assert r["per_request"][[p["request"] for p in r["per_request"]].index(f["request"])]["redone"]
    assert r["stats"]["loads_aborted"] == 1 and r["outputs_mismatches"] == 0 and r["draft_outputs_mismatches"] == 0


def test_outputs_beyond_the_tolerance_fail_the_run() -> None:
    """Target or draft logits of a sampled hit request past the tolerance are an
    integrity failure (exit 1), as speculation mismatches are; near ties are not."""
    clean = {"outputs_checked": 5, "outputs_mismatches": 0, "draft_outputs_checked": 5, "draft_outputs_mismatches": 0,
             "draft_outputs_near_ties": 2, "spec_near_ties": 1}  # fmt: skip
    assert integrity_failures(clean) == []
    assert integrity_failures({**clean, "outputs_mismatches": 2}) == [
        "the outputs of 2 of 5 sampled hit requests differ from a recompute beyond the tolerance"]
    assert integrity_failures({**clean, "draft_outputs_mismatches": 1}) == [
        "the MTP draft outputs of 1 of 5 sampled hit requests differ from a recompute beyond the tolerance"]


def test_a_draft_token_flip_within_the_tolerance_is_a_near_tie_not_a_mismatch() -> None:
    flip = OutputCheck(1, 64, 32, 32, 0.0, 1.0, True, draft_max_abs_err=0.01, draft_tolerance=0.02, draft_same_token=False)
    moved = OutputCheck(1, 64, 32, 32, 0.0, 1.0, True, draft_max_abs_err=0.03, draft_tolerance=0.02, draft_same_token=True)
    assert flip.draft_ok and flip.draft_near_tie
    assert not moved.draft_ok and not moved.draft_near_tie


def test_cp1_lost_draft_state_passes_the_target_oracle_and_fails_the_draft_oracle(tmp_path: Path) -> None:
    """The fork's bug without any byte check (--no-verify, and the library's restore
    checks off): one load's draft parts come back as zeros. The target's outputs are
    right; the draft's are not."""
    rc, r = replay(tmp_path / "draft.json", "--no-verify", "--set", "verify_restores=off",
                   "--hf-fault", "drop-draft:draft_kv:0@0")
    (f,) = r["faults_injected"]
    assert r["outputs_checked"] == 5 and r["outputs_mismatches"] == 0
    assert r["draft_outputs_mismatches"] >= 1
    bad = [c for c in r["output_checks"] if not (c["draft_max_abs_err"] <= c["draft_tolerance"] and c["draft_same_token"])]
    assert f["request"] in {c["request"] for c in bad}
    assert r["spec_mismatches"] >= 1  # speculation from that prefix: the draft's logits moved
    assert f["request"] in {c["request"] for c in r["spec_checks"] if not c["same"]}
    assert rc == 1 and any(m.startswith("speculation from") for m in r["integrity_failures"])
    assert any(m.startswith("the MTP draft outputs of") for m in r["integrity_failures"]), r["integrity_failures"]
    # with the engine's byte check the same fault is refused before use
    rc, r = replay(tmp_path / "draft2.json", "--set", "verify_restores=off", "--hf-fault", "drop-draft:draft_kv:0@0")
    assert rc == 1 and r["loads_refused"] >= 1 and r["draft_outputs_mismatches"] == 0
    assert {m.split(" layer")[0].split()[-1] for m in r["mismatch_examples"]} == {"draft_kv", "draft_state"}
    # and with the library's restore checks (the default) before the engine ever sees it
    rc, r = replay(tmp_path / "draft3.json", "--hf-fault", "drop-draft:draft_kv:0@0")
    assert rc == 1 and r["loads_refused"] == 0 and r["draft_outputs_mismatches"] == 0
    assert r["verify_failures_l2_draft_kv"] >= 1 and r["verify_failures_l2_draft_state"] >= 1


@pytest.mark.parametrize("extra", [
    ["--cp-size", "2", "--compare-no-l2"],
    ["--cp-size", "2", "--hf-fault", "corrupt:draft_kv:0@2"],  # no rank 2
    ["--hf-fault", "corrupt:draft_kv:1@0"],  # the draft has one layer
    ["--spec-steps", "-1"],
])  # fmt: skip
def test_options_the_cp_engine_cannot_run_with_fail_before_any_work(tmp_path: Path, extra: list[str]) -> None:
    out = tmp_path / "out.json"
    assert main(["replay", "--engine", "hf", "--limit", "3", *extra, "--json", str(out)]) == 2
    assert not out.exists()


class _ScriptedForward:
    """A forward double for the speculation loop: the target's greedy token after
    position p is 100 + p + 1; the draft proposes the token after that right
    (100 + p + 2) except at the positions in `wrong`."""

    def __init__(self, wrong: set[int]) -> None:
        from types import SimpleNamespace

        self.m = SimpleNamespace(preset=SimpleNamespace(page_size=PS))
        self.wrong = wrong
        self.fed: list[tuple[int, int | None]] = []  # per forward: (its last token, the token its draft was forced to)

    def run(self, batch: Any, hooks: Any = None) -> Any:
        from types import SimpleNamespace

        (plan, _), = batch
        self.fed.append((int(plan.seq.ids[-1]), plan.seq.forced_token))
        last = plan.seq.end - 1
        draft = 100 + last + 2 + (1000 if last in self.wrong else 0)
        logits = torch.zeros((1, 4))
        return SimpleNamespace(next_tokens=torch.tensor([100 + last + 1]), draft_tokens=torch.tensor([draft]),
                               logits=logits, draft_logits=logits)  # fmt: skip


def test_speculation_steps_accept_the_right_proposal_and_add_the_bonus_token() -> None:
    """The loop's accounting: a right proposal is accepted with the bonus token
    (length 2), a wrong one is replaced by the target's token (length 1); the
    tokens are the target's greedy sequence either way."""
    spec = Speculator(_ScriptedForward(wrong={10, 13}), 32, steps=4)  # type: ignore[arg-type]
    run = spec.run(np.arange(10), ScratchKV(), 0)  # prompt positions 0..9: first token 110, proposal 111
    # 1: 111 right -> accepted, bonus 112 (the draft at 10 was wrong, but the bonus step's proposal counts: 113)
    # 2: 113 right -> accepted, bonus 114, proposal from 13 wrong (1115)
    # 3: 1115 -> the target's 115 instead; 4: proposal 116 right -> accepted, bonus 117
    assert run.accept_lengths == [2, 2, 1, 2]
    assert run.proposals == [111, 113, 1115, 116]
    assert run.tokens == list(range(110, 118))  # the target's greedy tokens, whatever was proposed


def test_a_forced_run_is_fed_the_reference_tokens_and_decides_at_its_steps() -> None:
    """The restored run, forced: every forward is fed the reference's token (the
    draft too) and the steps start where the reference's did; each records this
    run's own decision there."""
    ref = Speculator(_ScriptedForward(wrong={10, 13}), 32, steps=4).run(np.arange(10), ScratchKV(), 0)
    assert ref.accept_lengths == [2, 2, 1, 2]  # steps at forwards 0, 2, 4, 5; 8 forwards
    fw = _ScriptedForward(wrong={10})  # its draft at position 13 is right
    run = Speculator(fw, 32, steps=4).run(np.arange(10), ScratchKV(), 0, forced=ref)  # type: ignore[arg-type]
    assert fw.fed == [(9, 110)] + [(t, t + 1) for t in range(110, 117)]  # (fed token, the draft's forced token)
    # 3 (at forward 4, position 13): its proposal 115 is the target's pick at forward 5: accepted
    # 4 (at forward 5, the reference's step): proposal 116, accepted
    assert run.forced and run.accept_lengths == [2, 2, 2, 2] and run.proposals == [111, 113, 115, 116]
    assert run.tokens == ref.tokens and len(run.logits) == len(ref.logits) == 8
