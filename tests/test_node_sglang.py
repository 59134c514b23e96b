"""The node tier under `--radix-cache-backend hicache-cp` (SGLang 0.5.23's real classes, on
CPU): a restarted server adopts the segment and serves a prompt it never computed from it,
every byte of every part checked by the stand-in forward (tests/test_sglang_radix.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="sglang not installed (scripts/install_sglang.sh)")

from hicache_harness.sglang.env import import_sglang  # noqa: E402
from hicache_harness.sglang.server import SGLangPrefillServer, ServerSpec  # noqa: E402
from hostmem.segment import find_segment  # noqa: E402

import_sglang()
import test_sglang_radix as S  # noqa: E402

pytestmark = pytest.mark.slow  # importing SGLang costs ~10 s once per process



def _server(path: Path, seg_name: str, **env: str) -> SGLangPrefillServer:
    values = {"HICACHE_HOST_BUDGET_BYTES": str(S.budget(32)), "HICACHE_IO_BACKEND": "cpu", "HICACHE_DEBUG_CHECKS": "true",
              "HICACHE_PIN_HOST": "false", "HICACHE_L2_FREE_ROOM": "0", "HICACHE_NODE_SEGMENT": seg_name, **env}  # fmt: skip
    return SGLangPrefillServer(ServerSpec(), path, tree_cache_kwargs={"env": values})


def test_a_restarted_sglang_server_serves_the_adopted_copy_checked(tmp_path: Path, seg_name: str) -> None:
    first = _server(tmp_path / "model", seg_name)
    tokens = S.prompt(4, 5)
    S.serve(first, tokens)
    S.clean(first)
    assert first.tree_cache.cache.stats()["node_journal_commits"] == 5
    model_id = first.tree_cache.resolved.config.node_model_id
    assert model_id.endswith("@main") and len(model_id) > len("@main")  # the served model's identity
    first.close()
    again = _server(tmp_path / "model", seg_name)  # the same model
    try:
        stats = again.tree_cache.cache.stats()
        assert stats["node_adopted"] and stats["node_adopted_pages"] == 5
        r = S.serve(again, tokens)  # a server that never computed it: every whole page from the segment
        assert r.host_hit_length == 5 * S.PAGE and again.forward.report.checked_bytes == 5 * S.PAGE * S.TOKEN_BYTES
        S.clean(again)
        assert again.tree_cache.cache.stats()["node_verified_pages"] == 5
        again.tree_cache.reset()  # SGLang's flush_cache: the journal forgets every copy
        stats = again.tree_cache.cache.stats()
        assert stats["node_adopted_pages"] == 0 and stats["node_journal_commits"] == 0
        assert again.tree_cache.cache._node.journal.committed_pages().size == 0
    finally:
        again.close()
    other = _server(tmp_path / "other-model", seg_name, HICACHE_NODE_DROP_ON_CLOSE="true")
    try:  # another model with the same geometry: its segment is not adopted
        stats = other.tree_cache.cache.stats()
        assert not stats["node_adopted"] and stats["node_adopted_pages"] == 0
    finally:
        other.close()
    assert find_segment(seg_name) is None
