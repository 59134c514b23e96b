"""The real-model engine end to end: `hicache-cp replay --engine hf` on the embedded workload.

A DeepSeek-V3.2 (transformers, tiny preset, random weights) serves 40
requests in batches, with chunked prefill, through L1 and L2; both oracles
run: every reused (page, part, layer) unit against the digest recorded when
it was computed, and the last-token logits of sampled hit requests against
the model's own full forward.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", minversion="5.20")

from hicache_harness.cli import main  # noqa: E402
from hicache_harness.engines import hf_model  # noqa: E402
from hicache_harness.engines.hf_forward import PagedForward, PagedKV, ScratchKV, SeqChunk, SeqPlan  # noqa: E402
from hicache_harness.engines.hf_oracle import recompute_logits, recompute_outputs  # noqa: E402
from hicache_cp.layout import Part  # noqa: E402


def test_replay_engine_hf_embedded(tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    assert main(["replay", "--engine", "hf", "--limit", "40", "--check-outputs", "5", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["engine"] == "hf" and r["requests"] == 40 and r["served_requests"] == 40
    # (a) byte identity: every reused unit checked, none differs.
    assert r["integrity_checked_pages"] > 0 and r["integrity_mismatches"] == 0
    assert r["integrity_checked_units"] == r["integrity_expected_units"] > 0
    assert r["integrity_checked_l2_units"] > 0  # restored from L2, not only L1 hits
    # (b) outputs: sampled hit requests equal a full recompute within the stated tolerance.
    assert r["outputs_checked"] == 5 and r["outputs_mismatches"] == 0
    assert r["outputs_max_abs_err"] < 1e-4
    assert r["l2_hit_tokens"] > 0 and r["max_batch_requests"] > 1
    assert r["l1_hit_tokens"] + r["l2_hit_tokens"] + r["miss_tokens"] == r["prompt_tokens"]
    assert r["backups_committed"] > 0 and r["bytes_h2d"] > 0
    assert 0 < r["prefill_compute_saved"] < 1 and r["prefill_tokens_per_s"] > 0
    assert r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"]
    assert len(r["per_request"]) == 40


def test_model_layout_is_the_latent_cache() -> None:
    """Bytes per token per layer come from the model: MLA latent + rope key, indexer key."""
    lay = hf_model.layout_of("dsv32-width")
    assert lay.kv_bytes_per_token == (512 + 64) * 2 and lay.state_bytes_per_token == 128 * 2
    assert lay.kv_bytes_per_token + lay.state_bytes_per_token == 1408  # docs/platform.md, bf16
    assert lay.state_layers == (0, 1, 2, 3) and lay.draft_layers == 1
    tiny = hf_model.layout_of("tiny")
    assert tiny.kv_bytes_per_token == (32 + 16) * 4 and tiny.draft_state_bytes_per_token == 32 * 4


def test_paged_batched_chunked_forward_matches_one_full_forward() -> None:
    """The layer-by-layer forward over pages, in chunks and in a ragged batch with
    different prefix and chunk lengths, gives the model's own logits, and the MTP
    draft's logits of a recompute (`recompute_outputs`); pages written by two
    computations of the same tokens agree (to rounding), the draft's too. A chunk
    after the first starts one position before the first it writes (the draft
    runs one position ahead and needs that hidden state)."""
    m = hf_model.build("tiny")
    ps = m.preset.page_size
    bufs = m.kv_buffers(64)
    fw = PagedForward(m)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, m.vocab_size, 100), rng.integers(0, m.vocab_size, 50)
    (ref_a, draft_a), (ref_b, draft_b) = recompute_outputs(m, a), recompute_outputs(m, b)
    assert float((ref_a - recompute_logits(m.target, a)).abs().max()) == 0.0
    pages_a = np.arange(1, 14)
    for first in range(0, 100, 32):  # chunks of 32 new tokens (4 pages), writing whole pages only
        start, end = max(0, first - 1), min(first + 32, 100)
        seq = SeqChunk(a[start:end], start, pages_a, first, min(end, 96), None if end == 100 else int(a[end]))
        plan = SeqPlan.build(seq, ps)
        r = fw.run([(plan, PagedKV(bufs, plan))])
    assert float((r.logits[0].cpu() - ref_a).abs().max()) < 1e-5
    assert float((r.draft_logits[0].cpu() - draft_a).abs().max()) < 1e-5  # type: ignore[index]
    # A batch: a's tail on 64 cached tokens, b from scratch, and a's tokens 32..70 on 32 cached.
    pages_c = np.concatenate([pages_a[:4], np.arange(30, 36)])
    seqs = [SeqChunk(a[63:], 63, pages_a, 96, 96, None), SeqChunk(b, 0, np.arange(40, 47), 0, 48, None),
            SeqChunk(a[31:70], 31, pages_c, 32, 64, None)]  # fmt: skip
    plans = [SeqPlan.build(seq, ps) for seq in seqs]
    assert [p.Qp - p.Q for p in plans] == [3, 6, 1]  # filler queries up to whole pages change nothing
    r = fw.run([(plan, PagedKV(bufs, plan)) for plan in plans])
    assert r.final_rows == [0, 1, 2]
    refs = [(ref_a, draft_a), (ref_b, draft_b), recompute_outputs(m, a[:70])]
    for row, (ref, draft) in enumerate(refs):
        assert float((r.logits[row].cpu() - ref).abs().max()) < 1e-5, row
        assert float((r.draft_logits[row].cpu() - draft).abs().max()) < 1e-5, row  # type: ignore[index]
    for part in Part:
        for layer in bufs[part]:
            assert torch.allclose(layer[pages_c[4:8]], layer[pages_a[4:8]], atol=1e-5), part
    # The recompute path (no pages) gives the same logits too.
    store = ScratchKV()
    for start in range(0, 100, 48):
        end = min(start + 48, 100)
        plan = SeqPlan.build(SeqChunk(a[start:end], start, None, 0, 0, None if end == 100 else int(a[end])), ps)
        r = fw.run([(plan, store.bind(plan))])
    assert float((r.logits[0].cpu() - ref_a).abs().max()) < 1e-5


def test_decode_peer_checks_every_unit_against_the_digests() -> None:
    """The decode peer's digest path (PD of the hf engine's real KV): clean
    pages pass; one flipped byte is named by position, part and layer."""
    from types import SimpleNamespace

    from hicache_harness.decode_peer import DecodePeer, _DecodeRoom
    from hicache_harness.engines.hf_oracle import unit_digests
    from hicache_cp.layout import KVLayout

    layout = KVLayout.build(page_size=8, num_layers=2, kv_bytes_per_token=16, state_bytes_per_token=8,
                            draft_layers=1, draft_kv_bytes_per_token=16, draft_state_bytes_per_token=8)  # fmt: skip
    rng = np.random.default_rng(0)
    views = {p.part: rng.integers(0, 256, (p.num_slots, 10, p.page_bytes), dtype=np.uint8) for p in layout.parts}
    dst = np.array([4, 7, 2])
    units = [(p.part, slot) for p in layout.parts for slot in range(p.num_slots)]
    rows = np.stack([unit_digests(torch.from_numpy(views[part][slot][dst])).numpy() for part, slot in units], axis=1)
    wrong = rows[:1] + 1  # a variant that matches nothing: the check needs one match per unit
    expected = [np.vstack([wrong, rows[i : i + 1]]) for i in range(3)]
    room = _DecodeRoom(1, 9, 3, 1, dst, 0.0, dones={0: (np.arange(3), np.zeros(3, np.uint64))}, digests={0: expected})
    peer = SimpleNamespace(layout=layout, views=views)
    assert DecodePeer._verify_digests(peer, room) == (0, [])  # type: ignore[arg-type]
    views[Part.TARGET_STATE][1][dst[2], 3] ^= 0x10
    count, found = DecodePeer._verify_digests(peer, room)  # type: ignore[arg-type]
    assert count == 1 and (found[0].request, found[0].position, found[0].part, found[0].layer) == (9, 2, "target_state", 1)


@pytest.mark.slow
def test_replay_engine_hf_with_an_l3_tier(tmp_path: Path) -> None:
    """`--engine hf --l3 mooncake`: the real model's KV goes through L3 too (the
    hf scheduler hands its sink digests: the L3 instance sink once refused them
    with an internal error, exit 3)."""
    from conftest import mooncake_store_available

    if not mooncake_store_available():
        pytest.skip("mooncake (store and master) not installed")
    out = tmp_path / "hf-l3.json"
    assert main(["replay", "--engine", "hf", "--device", "cpu", "--l3", "mooncake", "--limit", "6", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["engine"] == "hf" and r["l3"] == "mooncake" and r["served_requests"] == 6
    assert r["config"]["l3"]["value"]["backend"] == "mooncake"
    assert r["l3_put_keys"] > 0  # the real model's pages were written to the store
    assert r["integrity_mismatches"] == 0 and r["integrity_checked_units"] == r["integrity_expected_units"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("wait", [False, True])
def test_the_hf_scheduler_prefetches_waiting_requests_when_prefetch_does_not_wait(
    wait: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README, L3: with `prefetch_wait = false` the hf scheduler prefetches the
    first requests still waiting once each step's batch is built, each request
    once (`HiCache.prefetch_queued`, spied on and still run); a waiting tier
    prefetches at admission only."""
    from conftest import mooncake_store_available

    from hicache_cp.cache.hicache import HiCache

    if not mooncake_store_available():
        pytest.skip("mooncake (store and master) not installed")
    calls: list[np.ndarray] = []
    original = HiCache.prefetch_queued

    def spy(self: HiCache, tokens: np.ndarray):  # type: ignore[no-untyped-def]
        calls.append(tokens)  # held: no two requests' arrays share an id
        return original(self, tokens)

    monkeypatch.setattr(HiCache, "prefetch_queued", spy)
    out = tmp_path / "hf-l3.json"
    argv = ["replay", "--engine", "hf", "--device", "cpu", "--l3", "mooncake", "--limit", "12", "--l2-fraction", "0.1",
            "--set", f"l3.prefetch_wait={str(wait).lower()}", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["integrity_mismatches"] == 0 and r["config"]["l3"]["value"]["prefetch_wait"] is wait
    if wait:
        assert not calls
    else:
        assert 0 < len(calls) <= 12 and len({id(t) for t in calls}) == len(calls)
