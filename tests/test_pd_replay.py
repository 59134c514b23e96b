"""`hicache-cp replay --pd`: a real decode peer process receives every
request's KV over Mooncake's TransferEngine (TCP on 127.0.0.1) and verifies
every byte; with CP each rank sends only the pages it owns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_harness.cli import main

mooncake = pytest.importorskip("mooncake.engine", reason="Mooncake TransferEngine not importable (libibverbs1?)")
pytestmark = pytest.mark.mooncake


@pytest.mark.parametrize("cp_size,per_layer", [(1, False), (1, True), (2, False), (2, True)])
def test_replay_with_pd_verifies_every_request(cp_size: int, per_layer: bool, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """After insert and per layer (from the forward's hooks), one rank and two:
    every room verified by the decode peer, the partial last pages included,
    the forward-end-to-decode time measured for every room."""
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    out = tmp_path / "pd.json"
    argv = ["replay", "--pd", "--limit", "40", "--cp-size", str(cp_size), "--json", str(out), "--pd-timeout-s", "90"]
    assert main(argv + (["--pd-per-layer"] if per_layer else [])) == 0
    report = json.loads(out.read_text())
    assert report["integrity_mismatches"] == 0
    assert report["pd"]["decode_verified_rooms"] == 40
    assert report["pd"]["decode_open_rooms_at_exit"] == [] and report["pd"]["decode_draining_rooms_at_exit"] == []
    assert report["config"]["pd_timeout_s"] == {"value": 90.0, "source": "cli"}
    assert report["config"]["pd_per_layer"]["value"] is per_layer
    ranks = report["per_rank"]
    assert len(ranks) == cp_size
    assert all(r["pd_timeout_s"] == 90.0 and r["pd_per_layer"] is per_layer for r in ranks)  # what the sender ran
    assert sum(r["pd_rooms"] for r in ranks) == 40 * cp_size
    assert all(r["pd_failed_rooms"] == 0 and r["pd_mismatches"] == 0 for r in ranks)
    assert all(r["pd_ready_rooms"] == 40 and r["pd_ready_s_p50"] >= 0 for r in ranks)
    assert sum(r["pd_tail_pages"] for r in ranks) == 40  # the embedded prompts all end in a partial page
    # L2-resident pages were sent straight from host memory; descriptors never
    # exceed pages x layers (coalescing can only merge).
    assert sum(r["pd_pages_from_l2"] for r in ranks) > 0
    layers = 4 + 2 + 1 + 1  # tiny: target kv, target state (2 layers), draft kv, draft state
    assert 0 < sum(r["pd_descriptors"] for r in ranks) <= sum(r["pd_pages"] for r in ranks) * layers


def _short_trace(path: Path) -> Path:
    """Requests of zero length, shorter than a page, shorter than a block, and whole ones."""
    lines = [
        {"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []},
        {"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1]},
        {"timestamp": 2, "input_length": 300, "output_length": 1, "hash_ids": [2]},
        {"timestamp": 3, "input_length": 1100, "output_length": 1, "hash_ids": [3, 4, 5]},
        {"timestamp": 4, "input_length": 1100, "output_length": 1, "hash_ids": [3, 4, 6]},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_replay_with_pd_takes_requests_shorter_than_a_block(tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    trace = _short_trace(tmp_path / "t.jsonl")
    assert main(["replay", "--pd", "--trace", str(trace), "--tokens-per-block", "64", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (rank,) = report["per_rank"]
    # The decode peer asks for the whole prompt: only the empty request has nothing to send. Each
    # of the other four ends in a partial page (its partial trace block scales to a few tokens, not
    # a multiple of the 16-token page; 5 tokens is a partial page alone), sent as the room's last
    # position and verified there.
    assert rank["pd_requests_without_pages"] == 1
    assert rank["pd_rooms"] == 4 and rank["pd_failed_rooms"] == 0
    assert rank["pd_tail_pages"] == 4
    assert report["pd"]["decode_verified_rooms"] == 4


def test_replay_with_pd_exits_1_when_a_room_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One byte of one L2 page is flipped while its room is sent (and restored
    after): the decode peer's check fails that room, and the replay exits 1."""
    from hicache_harness import pd_replay
    from hicache_cp.layout import Part

    real_send = pd_replay.PdSink.send_request
    flipped: list[int] = []

    def send_with_a_bad_byte(self, request, node, hashes, cache, **kw):  # type: ignore[no-untyped-def]
        homes = pd_replay.page_homes(cache, node, hashes) if len(hashes) else None
        l2 = None if homes is None else homes.pages[homes.tier == pd_replay.L2]
        if flipped or l2 is None or not len(l2):
            return real_send(self, request, node, hashes, cache, **kw)
        view = cache.host_pool.layer_view(Part.TARGET_KV, 0)
        view[int(l2[0]), 7] ^= 0xFF
        flipped.append(request)
        try:
            return real_send(self, request, node, hashes, cache, **kw)
        finally:
            view[int(l2[0]), 7] ^= 0xFF

    monkeypatch.setattr(pd_replay.PdSink, "send_request", send_with_a_bad_byte)
    out = tmp_path / "pd.json"
    assert main(["replay", "--pd", "--limit", "40", "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    assert flipped and report["per_rank"][0]["pd_failed_rooms"] == 1
    assert report["integrity_mismatches"] == 0  # the cache's own bytes were never wrong
    assert any("PD rooms failed" in f for f in report["integrity_failures"])


@pytest.mark.gpu
@pytest.mark.parametrize("per_layer", [False, True])
def test_replay_with_pd_on_cuda(per_layer: bool, tmp_path: Path) -> None:
    """L1 in GPU memory: per-layer sends wait on each layer's CUDA event (off the
    forward's thread), after-insert sends sync the forward's end; every byte verified."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "pd.json"
    argv = ["replay", "--pd", "--device", "cuda", "--limit", "60", "--json", str(out)]
    assert main(argv + (["--pd-per-layer"] if per_layer else [])) == 0
    report = json.loads(out.read_text())
    (rank,) = report["per_rank"]
    assert report["pd"]["decode_verified_rooms"] == 60 and rank["pd_failed_rooms"] == 0
    assert rank["pd_mismatches"] == 0 and rank["pd_ready_rooms"] == 60


@pytest.mark.slow
@pytest.mark.parametrize("per_layer", [False, True])
def test_replay_with_pd_on_the_hf_engine(per_layer: bool, tmp_path: Path) -> None:
    """The real model's KV (transformers, tiny preset), batched and chunked: per layer
    the scheduler's forward hooks (target layers, then the MTP draft layer) submit each
    layer; the decode peer checks every unit against the digests prefill recorded."""
    pytest.importorskip("transformers")
    out = tmp_path / "pd.json"
    argv = ["replay", "--engine", "hf", "--hf-preset", "tiny", "--pd", "--limit", "6", "--json", str(out)]
    assert main(argv + (["--pd-per-layer"] if per_layer else [])) == 0
    report = json.loads(out.read_text())
    (rank,) = report["per_rank"]
    assert report["pd"]["decode_verified_rooms"] == 6
    assert rank["pd_rooms"] == 6 and rank["pd_failed_rooms"] == 0 and rank["pd_mismatches"] == 0
    assert rank["pd_per_layer"] is per_layer
    assert rank["pd_ready_rooms"] == 6  # the forward's end is known from its hooks, either way
