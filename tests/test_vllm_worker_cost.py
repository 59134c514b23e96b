"""What the vLLM worker asks of its copy engine per step, under vLLM 0.33.0's real `Scheduler`.

The worker's host time per step is its engine calls (docs/bench/vllm.md):

* a step's saves, whatever the number of requests: one plan, then one
  submission per layer (the layer hook's whole cost beyond a few lookups);
* a load: one plan and one submission for every layer; every loaded page is
  checked against its stored checksum (CPU and CUDA alike);
* a step with no job and nothing in flight: no engine call;
* CUDA: the checks' kernel is compiled at start-up (`CopyEngine.warm_up`), and
  a load's restore checks follow its copies, not the forward, so the step's end
  (which reports failed loads in that step) does not wait for the forward to
  finish.

Skipped where vLLM is not installed; the CUDA cases are GPU tests.
"""

from __future__ import annotations

import pytest
import numpy as np
import torch

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base", reason="vLLM not installed (scripts/install_vllm.sh)"
)

import test_vllm_bench as H  # noqa: E402

from hicache_cp import BACKUP_SUBMITS_PER_FORWARD, backup_layer_group  # noqa: E402
from hicache_cp.io.base import Direction  # noqa: E402

P = list(range(100, 185))  # 85 tokens: 5 whole pages
PROMPTS = [[1000 * i + t for t in P] for i in range(3)]  # three requests, one step of 255 tokens
D2H, H2D = Direction.D2H, Direction.H2D


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return H.write_model_dir(tmp_path_factory.mktemp("tiny-deepseek"))


def observe(engine) -> list[tuple[str, Direction]]:
    """Test double (an observer): record the engine's public submissions and plans, each
    (method, direction), outermost calls only (a generic `submit_layers` calls `submit_layer`)."""
    calls: list[tuple[str, Direction]] = []
    depth = [0]

    def wrap(name: str, direction_of):
        real = getattr(engine, name)

        def call(*a, **kw):
            if not depth[0]:
                calls.append((name, direction_of(*a)))
            depth[0] += 1
            try:
                return real(*a, **kw)
            finally:
                depth[0] -= 1

        setattr(engine, name, call)

    wrap("plan", lambda direction, *_: direction)
    wrap("submit_layer", lambda plan, *_: plan.direction)
    wrap("submit_layers", lambda plan, *_: plan.direction)
    wrap("submit_backup", lambda *_: D2H)
    wrap("submit_load", lambda *_: H2D)
    return calls


@pytest.mark.parametrize("device", H.DEVICES)
def test_vllm_worker_plans_each_op_once_and_submits_a_group_of_layers_in_one_call(model_dir, device):
    b = H.make_bench(model_dir, device=device)
    try:
        engine = b.worker.worker_side.engine
        calls = observe(engine)
        for p in PROMPTS:
            b.add(p)
        s = b.step()  # the three prefills in one step: 15 pages to save
        assert len(s.saves) == 3 and not s.loads
        layers = b.cache.layout.num_target_layers
        groups = -(-layers // backup_layer_group(layers, BACKUP_SUBMITS_PER_FORWARD))
        # Not one call per request and layer: one per group of layers (the last after the forward).
        assert calls == [("plan", D2H)] + [("submit_layers", D2H)] * groups
        b.run()
        assert b.cache.metrics.backups_committed == 3
        calls.clear()
        b.drop_vllm_prefix_cache()
        checked_before = engine.integrity.snapshot()[0].get("l2", 0)
        for p in PROMPTS:
            b.add(p)
        s = b.step()  # three loads of 5 pages; the 5 tokens computed complete no page
        assert sorted(s.loads) == [("r4", 0, 5), ("r5", 0, 5), ("r6", 0, 5)] and not s.saves
        assert calls == [("plan", H2D), ("submit_layers", H2D)] * 3  # every layer of a load in one call
        assert engine.integrity.snapshot()[0]["l2"] - checked_before == 3 * 5 * layers  # every loaded page checked
        calls.clear()
        b.run()  # steps with no job: no engine call
        assert calls == [] and b.mismatches == []
    finally:
        b.close()


@pytest.mark.parametrize(("submits", "calls_per_op"), [(None, 7), (2, 2)], ids=["default", "two-submits"])
def test_vllm_worker_saves_a_deep_model_in_groups_of_layers(tmp_path, caplog, submits, calls_per_op):
    """20 layers: the save hooks gather groups of `backup_layer_group(20, submits)` layers
    (3 at the default 8 submits a step, 10 with `backup_submits_per_forward = 2`), one
    engine call each as a group is complete, the last group after the forward; no layer
    is reported as hookless, and every save commits and is loaded back whole."""
    assert backup_layer_group(20, submits or BACKUP_SUBMITS_PER_FORWARD) == (3 if submits is None else 10)
    extra = {} if submits is None else {"backup_submits_per_forward": submits}
    b = H.make_bench(H.write_model_dir(tmp_path / "deep", layers=20), extra_config=extra)
    try:
        calls = observe(b.worker.worker_side.engine)
        for p in PROMPTS:
            b.add(p)
        s = b.step()
        assert len(s.saves) == 3 and calls == [("plan", D2H)] + [("submit_layers", D2H)] * calls_per_op
        b.run()
        assert b.cache.metrics.backups_committed == 3
        assert not [r for r in caplog.records if "no save_kv_layer hook" in r.getMessage()]
        b.drop_vllm_prefix_cache()
        for p in PROMPTS:
            b.add(p)
        s = b.step()
        assert sorted(s.loads) == [("r4", 0, 5), ("r5", 0, 5), ("r6", 0, 5)]
        b.run()
        assert b.mismatches == []
    finally:
        b.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/device/vllm_race.sh runs it)")
def test_vllm_cuda_a_loads_checks_do_not_wait_for_the_forward(model_dir):
    """The step's end waits for the loads and their checks; a forward still running on the
    compute stream (a 0.2 s spin queued after every layer's wait) is not waited for."""
    b = H.make_bench(model_dir, device="cuda")
    try:
        assert b.worker.worker_side.engine._checks is not None  # made, kernel compiled, at start-up (warm_up)
        b.add(P)
        b.run()
        b.drop_vllm_prefix_cache()
        b.add(P)
        so = b.sched.schedule()
        assert [(j.req_id, len(j.device_pages)) for j in so.kv_connector_metadata.loads] == [("r2", 5)]
        w = b.worker
        w.handle_preemptions(so.kv_connector_metadata)
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(H._HookedContext())
        for name in H.LAYERS:
            w.wait_for_layer_load(name)
        torch.cuda._sleep(400_000_000)  # the rest of the forward: about 0.2 s on the compute stream
        w.wait_for_save()
        checked = w.worker_side.engine.integrity.snapshot()[0].get("l2", 0)
        assert w.get_block_ids_with_load_errors() == set()
        assert w.worker_side.engine.integrity.snapshot()[0]["l2"] - checked == 5 * len(H.LAYERS)  # checked now
        assert not torch.cuda.current_stream().query()  # ... while the forward still runs
        torch.cuda.synchronize()
        assert w.build_connector_worker_meta().results == {so.kv_connector_metadata.loads[0].job_id: (1, None)}
    finally:
        torch.cuda.synchronize()
        b.close()


def test_vllm_scheduler_submits_each_op_in_one_call_per_model(tmp_path):
    """The scheduler side's copies are tickets its workers resolve (`RemoteCopyEngine`):
    a step's save op is planned at its reservation and hands every layer of a model to
    that engine in one call (not one per layer), as a load does. V3.2's shape: every
    target layer in one call, the MTP draft's one layer in another (`submit_layer`)."""
    b = H.make_bench(H.write_model_dir(tmp_path / "deep", layers=4), shape="v32")
    try:
        calls = observe(b.cache.engine)
        for p in PROMPTS:
            b.add(p)
        s = b.step()
        assert len(s.saves) == 3
        assert calls == [("plan", D2H), ("submit_layers", D2H), ("submit_layer", D2H)] * 3
        b.run()
        assert b.cache.metrics.backups_committed == 3  # every ticket of every layer resolved
        calls.clear()
        b.drop_vllm_prefix_cache()
        b.add(PROMPTS[0])
        s = b.step()
        assert s.loads == [("r4", 0, 5)] and calls == [("plan", H2D), ("submit_layers", H2D)]
        b.run()
        assert b.mismatches == [] and b.side.in_flight_jobs() == 0
    finally:
        b.close()


def test_vllm_scheduler_converts_a_requests_tokens_once_per_length(model_dir):
    """The scheduler side keeps one int64 copy of a request's tokens: a lookup and the
    step's saves read views of it; the copy is remade only when a longer prefix is
    asked for (decode appended tokens), and always equals vLLM's token ids."""
    b = H.make_bench(model_dir)
    try:
        rid = b.add(P, max_tokens=40)
        b.step()  # lookup (85 tokens) and the save of 5 pages (80): one copy
        st = b.side._reqs[rid]
        first = st.token_ids
        assert first is not None and len(first) == 85
        assert st.tokens(80).base is first and st.tokens(85).base is first
        for _ in range(20):  # decode: 20 more tokens, a sixth page completes at 96
            b.step()
        assert st.token_ids is not first  # remade once a longer prefix (the sixth page) was asked for
        req = b.sched.requests[rid]
        assert np.array_equal(st.tokens(req.num_tokens), np.asarray(req.all_token_ids, dtype=np.int64))
        with pytest.raises(ValueError, match="tokens asked"):
            st.tokens(req.num_tokens + 1)
        b.run()
        assert b.mismatches == []
    finally:
        b.close()
