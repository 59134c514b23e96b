"""The real model under CP shared KV: `hicache-cp replay --engine hf --cp-size 2`.

Two rank processes (gloo on the CPU) serve the embedded workload with a tiny
DeepSeek-V3.2 and its MTP draft; each rank keeps and backs up only the pages
it owns, a hit loads each rank's share from its own L2, and the forward
(replicated) reads the full prefix through a per-layer all-gather of the
owned pages (`hf_cp`). The same replay at CP 1 is the reference: the hit
rate must be the same, each rank's L2 about half of CP 1's, and every oracle
clean - bytes, target outputs, the draft's own outputs, and the accept
lengths of speculation from the restored prefix against a recompute.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", minversion="5.20")

from hicache_cp.cp import mapping as cp_mapping  # noqa: E402
from hicache_harness.cli import main  # noqa: E402
from hicache_harness.engines import hf_model  # noqa: E402
from hicache_harness.engines.hf_cp import KVView, PrefixExchange, SharedView  # noqa: E402
from hicache_harness.engines.hf_forward import NoHooks, PagedForward, SeqChunk, SeqPlan  # noqa: E402
from hicache_harness.engines.hf_oracle import recompute_outputs  # noqa: E402
from hicache_harness.launch import RankContext, spawn_ranks  # noqa: E402
from hicache_cp.layout import Part  # noqa: E402

REPLAY = ["replay", "--engine", "hf", "--limit", "40", "--check-outputs", "5"]


def replay(path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    rc = main([*REPLAY, *extra, "--json", str(path)])
    return rc, json.loads(path.read_text())


@pytest.fixture(scope="module")
def cp1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    rc, r = replay(tmp_path_factory.mktemp("cp1") / "cp1.json")
    assert rc == 0, r.get("integrity_failures")
    return r


def assert_clean(r: dict[str, Any]) -> None:
    # bytes: every reused (page, part, layer) unit checked on its owner, none differs
    assert r["integrity_mismatches"] == 0 and r["loads_refused"] == 0, r["mismatch_examples"]
    assert r["integrity_checked_units"] == r["integrity_expected_units"] > 0
    assert r["integrity_checked_l2_units"] > 0 and r["integrity_restore_checked_units"] > 0
    # the target's and the draft's outputs against a recompute
    assert r["outputs_checked"] == 5 and r["outputs_mismatches"] == 0
    assert r["draft_outputs_checked"] == 5 and r["draft_outputs_mismatches"] == 0
    assert r["draft_outputs_same_token"] == 5 and r["draft_outputs_max_abs_err"] < 1e-4
    assert any(c["l2_hit_tokens"] > 0 for c in r["output_checks"])  # restored from L2, not only L1 hits
    # speculation from the restored prefix against a recompute: the same accept lengths
    assert r["spec_checked"] == 5 and r["spec_mismatches"] == 0 and r["spec_steps"] > 0
    for c in r["spec_checks"]:
        assert c["accept_lengths_restored"] == c["accept_lengths_recomputed"], c
        assert len(c["accept_lengths_restored"]) == r["spec_steps"] and c["tokens_restored"] == c["tokens_recomputed"]
    assert r["spec_accept_mean_restored"] == r["spec_accept_mean_recomputed"]
    assert r["spec_max_abs_err"] < 1e-4  # every step's target and draft logits, restored against recomputed


@pytest.mark.slow
def test_cp2_matches_cp1_with_half_the_l2_per_rank(cp1: dict[str, Any], tmp_path: Path) -> None:
    rc, r = replay(tmp_path / "cp2.json", "--cp-size", "2")
    assert rc == 0, r.get("integrity_failures")
    assert r["cp_size"] == 2 and cp1["cp_size"] == 1 and r["served_requests"] == 40
    assert_clean(cp1)
    assert_clean(r)
    # The same decisions: hits per tier, computed tokens, forwards.
    for key in ("hit_rate", "l1_hit_tokens", "l2_hit_tokens", "miss_tokens", "prefill_tokens_computed", "forwards"):
        assert r[key] == cp1[key], key
    assert r["l2_hit_tokens"] > 0
    # Each rank keeps its own pages: about half of CP 1's L2, and of its backups.
    ranks = r["per_rank"]
    assert [p["rank"] for p in ranks] == [0, 1]
    for p in ranks:
        assert 0.45 <= p["host_bytes"] / cp1["host_bytes"] <= 0.55, p
        assert 0.4 <= p["bytes_d2h"] / cp1["bytes_d2h"] <= 0.6, p
        assert p["integrity_mismatches"] == 0 and p["integrity_checked_units"] > 0
        assert p["cp_exchange_collectives"] > 0  # the prefix came through the all-gather
        assert p["draft_outputs_max_abs_err"] < 1e-4 and p["outputs_max_abs_err"] < 1e-4  # every rank's outputs
    assert sum(p["bytes_d2h"] for p in ranks) == cp1["bytes_d2h"]  # together: every page once
    assert cp1["cp_exchange_collectives"] == 0


@pytest.mark.slow
def test_cp2_faults_are_refused_or_recomputed_never_served(tmp_path: Path) -> None:
    """Three faults on three loads: rank 1's L2 draft KV corrupted, rank 0's L2
    indexer keys corrupted, rank 1's copy of a load failing. The corrupt hits are
    refused before use (named by node, page, part, layer and rank, exit 1), the
    failed copy aborts the load on both ranks; every request is recomputed and
    its outputs match a recompute."""
    faults = ["corrupt:draft_kv:0@1", "corrupt:target_state:1@0#2", "fail-copy:target_kv:2@1#3"]
    # The engine's own restore digests (`hf_oracle.RestoreGuard`), with the library's checks
    # off (they would refuse the corrupt copies first: the next test).
    rc, r = replay(tmp_path / "faults.json", "--cp-size", "2", "--set", "verify_restores=off",
                   *(a for f in faults for a in ("--hf-fault", f)))
    assert rc == 1 and r["integrity_failures"]
    injected = {f["fault"]: f for f in r["faults_injected"]}
    assert len(injected) == 3
    draft, state, copy = (injected[f if "#" in f else f + "#1"] for f in faults)
    assert (draft["rank"], draft["page"] % 2, state["rank"], state["page"] % 2, copy["rank"]) == (1, 1, 0, 0, 1)
    examples = r["mismatch_examples"]
    for f in (draft, state):  # refused at its own request, named in full
        name = (f"request {f['request']} page {f['page']} {f['part']} layer {f['layer']} "
                f"(l2, rank {f['rank']} node {f['node']}; hit refused)")  # fmt: skip
        assert name in examples, (name, examples)
    assert r["integrity_mismatches"] == r["integrity_refused_units"] == r["loads_refused"] == len(examples)
    assert r["per_rank"][1]["loads_refused"] >= 1 and r["per_rank"][0]["loads_refused"] >= 1
    # every faulted request was recomputed (its load aborted on both ranks), and served right
    rows = {p["request"]: p for p in r["per_request"]}
    assert all(rows[f["request"]]["redone"] for f in injected.values())
    checked = {c["request"] for c in r["output_checks"]}
    assert {f["request"] for f in injected.values()} <= checked
    assert r["outputs_mismatches"] == 0 and r["draft_outputs_mismatches"] == 0 and r["spec_mismatches"] == 0


def test_cp2_corrupt_copies_are_caught_by_the_library_checks_first(tmp_path: Path) -> None:
    """The same corrupt L2 copies with the library's restore checks on (the default): each
    load fails its check on the rank that holds the bad page, aborts on both ranks, the
    copy is dropped on both, and the request is recomputed with right outputs; the
    engine's digests then see nothing wrong (exit 1: the checks caught corruption)."""
    faults = ["corrupt:draft_kv:0@1", "corrupt:target_state:1@0#2"]
    rc, r = replay(tmp_path / "checked.json", "--cp-size", "2", *(a for f in faults for a in ("--hf-fault", f)))
    assert rc == 1 and any("restore checks caught" in f for f in r["integrity_failures"])
    assert r["verify_failures"] == 2 and r["verify_failures_l2_draft_kv"] == 1 and r["verify_failures_l2_target_state"] == 1
    assert r["loads_refused"] == 0 and r["integrity_mismatches"] == 0  # nothing reached the engine's digests
    rows = {p["request"]: p for p in r["per_request"]}
    assert all(rows[f["request"]]["redone"] for f in r["faults_injected"])
    assert r["outputs_mismatches"] == 0 and r["draft_outputs_mismatches"] == 0 and r["spec_mismatches"] == 0


# ---- the exchange alone, on two real ranks ------------------------------------------------------

PS = 8


def _prompts() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    shared = rng.integers(0, 512, 5 * PS)
    return np.concatenate([shared, rng.integers(0, 512, 12)]), np.concatenate([shared, rng.integers(0, 512, 21)])


def _tables(cp: int) -> tuple[np.ndarray, np.ndarray]:
    """Logical pages: a's 6 whole pages, b = a's first 5 and 2 of its own (lane = position mod cp)."""
    def logical(positions: np.ndarray, first_q: int) -> np.ndarray:
        lane = positions % cp
        return (positions // cp + first_q - 1) * cp + lane + 1

    return logical(np.arange(6), 1), np.concatenate([logical(np.arange(5), 1), logical(np.arange(5, 7), 8)])


def _prefill(fw: PagedForward, view: KVView, ids: np.ndarray, table: np.ndarray, cp: int, first: int = 0) -> Any:
    """The scheduler's chunking (32 new tokens a chunk, each after the first one
    position early) through `view`, from position `first` on."""
    pages = cp_mapping.to_physical(table, cp)
    n_whole = len(table) * PS
    progress = first
    while True:
        start, end = max(0, progress - 1), min(len(ids), progress + 32)
        if end < len(ids):
            end = end // PS * PS
        plan = SeqPlan.build(SeqChunk(ids[start:end], start, pages, progress, max(progress, min(end, n_whole)),
                                      None if end == len(ids) else int(ids[end])), PS)  # fmt: skip
        stores = view.stores([(table, plan)])
        r = fw.run(list(zip([plan], stores)), view.hooks(NoHooks(), stores))
        progress = end
        if end == len(ids):
            return r


def _exchange_rank(ctx: RankContext) -> dict[str, Any]:
    """Rank body: L1 poisoned with NaN, a computed, then b over a's first 5 pages."""
    m = hf_model.build("tiny")  # seeded: the same weights on every rank
    cp = ctx.world_size
    bufs = m.kv_buffers(16)
    for layers in bufs.values():
        for t in layers:
            t.fill_(float("nan"))
    view = SharedView(bufs, PrefixExchange(m, ctx.rank, cp))
    fw = PagedForward(m)
    (a, b), (ta, tb) = _prompts(), _tables(cp)
    ra = _prefill(fw, view, a, ta, cp)
    rb = _prefill(fw, view, b, tb, cp, first=5 * PS)
    finite = {p.value: [sorted(np.flatnonzero(torch.isfinite(t).all(dim=(1, 2)).numpy()).tolist()) for t in layers]
              for p, layers in bufs.items()}  # fmt: skip
    plain = lambda t: t.cpu().numpy().copy()  # noqa: E731 - numpy crosses the queue (tensors would share memory)
    return {"logits": [plain(ra.logits[0]), plain(rb.logits[0])], "draft": [plain(ra.draft_logits[0]), plain(rb.draft_logits[0])],
            "finite": finite, "collectives": view.exchange.collectives}  # fmt: skip


@pytest.mark.slow
def test_two_ranks_read_only_what_they_hold_or_receive() -> None:
    """Each rank's L1 starts as NaN; only the pages it owns are written, no other
    byte of its pools changes, and both ranks' target and draft logits equal a
    recompute: every prefix page came from its owner's pool through the
    all-gather (a read of an unwritten page would be NaN)."""
    cp = 2
    reports = spawn_ranks(_exchange_rank, cp, timeout_s=300, backend="gloo")
    m = hf_model.build("tiny")
    (a, b), (ta, tb) = _prompts(), _tables(cp)
    refs = [recompute_outputs(m, a), recompute_outputs(m, b)]
    used = np.unique(np.concatenate([ta, tb]))
    for rank, rep in enumerate(reports):
        for got, got_draft, (ref, draft_ref) in zip(rep["logits"], rep["draft"], refs):
            assert float(np.abs(got - ref.numpy()).max()) < 1e-5, rank
            assert float(np.abs(got_draft - draft_ref.numpy()).max()) < 1e-5, rank
        owned = sorted(cp_mapping.to_physical(used[cp_mapping.owned_mask(used, rank, cp)], cp).tolist())
        assert owned and len(owned) < len(used)
        for part in Part:
            assert rep["finite"][part.value] == [owned] * len(rep["finite"][part.value]), (rank, part)
        assert rep["collectives"] > 0
