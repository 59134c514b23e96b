"""Two instances behind a prefix-aware router that reads their KV events (`hicache_harness.router`).

Routed on the GPU tier's events only, a request whose prefix left L1 but is
still in one instance's L2 goes wherever load sends it; routed on the GPU
and host tiers' events, it goes where L2 holds it. The same requests must
get at least as many host-hit tokens the second way (here, strictly more),
with every reused byte verified.
"""

from __future__ import annotations

import pytest

from events_support import SHARED_TRACE
from hicache_cp.config import Config
from hicache_harness.router import compare
from hicache_harness.trace import load_trace, request_tokens, unique_blocks
from hicache_harness.workload import default_workload

PAGE = 16

pytestmark = pytest.mark.slow


def sized(requests, l2_fraction: float, l1_longest: float) -> Config:  # type: ignore[no-untyped-def]
    """Per instance: L2 a fraction of the unique footprint, L1 a multiple of the longest request."""
    l2 = max(8, int(l2_fraction * unique_blocks(requests)))
    l1 = max(l2 // 8, int(l1_longest * max(len(r.hash_ids) for r in requests)))
    page = Config(model="tiny").layout().bytes_per_page
    return Config(model="tiny", l1_pages=l1 + 1, host_budget_bytes=(l2 + 1) * page, io_backend="cpu", pin_host=False)


@pytest.mark.parametrize("workload,fmt", [("embedded", "sglang"), ("embedded", "vllm"), ("trace", "sglang")])
def test_host_tier_events_route_to_more_host_hits(workload: str, fmt: str) -> None:
    pytest.importorskip("sglang" if fmt == "sglang" else "vllm.distributed.kv_events")
    from hicache_harness.kv_events import engine_format

    if workload == "trace" and SHARED_TRACE is None:
        pytest.skip("the public trace (shared/traces/synthetic_trace.jsonl beside the checkout) is not here")
    requests = load_trace(SHARED_TRACE) if workload == "trace" else default_workload(seed=0)
    config = sized(requests, 0.1, 3.0 if workload == "trace" else 1.2)  # the embedded prompts are longer
    out = compare([request_tokens(r, PAGE) for r in requests], config, engine_format(fmt))
    gpu, both = out["gpu_events"], out["gpu_and_host_events"]
    assert gpu["integrity_mismatches"] == both["integrity_mismatches"] == 0
    assert gpu["prompt_tokens"] == both["prompt_tokens"]
    assert both["l2_hit_tokens"] > gpu["l2_hit_tokens"], (gpu, both)
