"""What a GPU server needs of `--radix-cache-backend hicache-cp` that CPU scenarios let through.

Issue 42's blockers, each tested on SGLang 0.5.23's real classes through the
harness (`hicache_harness.sglang.server`), on CPU where a CPU test can
show the contract and on CUDA (marked `gpu`) where only the GPU can:

- loads and scheduler-thread backups ordered behind the forward in flight;
- the MTP draft's pools handed to the plug-in under speculative decoding;
- decisions agreed over SGLang's DP-aware cache group;
- full prefill CUDA-graph replays; PD and CP/PP modes refused at start;
- no device-to-host read per request on the scheduler thread;
- LoRA adapters and extra keys never hit across each other;

and issue 48's missing SGLang tests (duplicates freed under a backup, device
eviction before the flush, the forward boundary, a backup computed on a
load that fails).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("sglang", reason="sglang not installed (scripts/install_sglang.sh)")

from test_sglang_radix import (  # noqa: E402
    CUDA, HAS_CUDA, PAGE, clean, evict_device, in_l2_only, make_cpu_server, make_cuda_server, make_server, prompt,
    serve, server_env,
)  # fmt: skip

from hicache_cp import Model, Part  # noqa: E402
from hicache_harness.sglang.server import SGLangPrefillServer, ServerSpec  # noqa: E402
from hicache_cp.integrations.sglang.fence import ForwardFence  # noqa: E402
from hicache_cp.io.base import Direction  # noqa: E402

pytestmark = pytest.mark.slow
PLUGIN_DIR = os.path.join("hicache_cp", "integrations", "sglang")
__all__ = ["make_cpu_server", "make_cuda_server", "make_server"]  # fixtures shared with test_sglang_radix


# ---- 1. copies ordered behind the forward in flight ---------------------------------------------


class RecordingFence(ForwardFence):
    """The fence with a flag while a submission is ordered behind the forward stream."""

    def __init__(self) -> None:
        super().__init__(None)
        self.active = False

    @contextlib.contextmanager
    def behind_forward(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False


def _record_submissions(s: SGLangPrefillServer) -> list[tuple[str, str]]:
    """Every copy the plug-in submits, and every pin of its loads' checks ("pin"), with
    where: inside the forward (its start or its layers), behind the fence, or neither
    (on the scheduler thread, unordered)."""
    fence = RecordingFence()
    s.tree_cache.fence = fence
    in_forward = {"on": False}
    seen: list[tuple[str, str]] = []
    engine = s.tree_cache.cache.engine

    def where() -> str:
        return "forward" if in_forward["on"] else "fence" if fence.active else "scheduler"

    for name in ("submit_layer", "submit_layers"):
        real = getattr(engine, name)

        def wrapped(plan, *args, _real=real, **kwargs):  # type: ignore[no-untyped-def]
            seen.append((plan.direction.value, where()))
            return _real(plan, *args, **kwargs)

        setattr(engine, name, wrapped)
    real_pin = engine.pin_checks_order

    def pin(plans):  # type: ignore[no-untyped-def]
        seen.append(("pin", where()))
        return real_pin(plans)

    engine.pin_checks_order = pin
    real_forward = s.run_forward

    def forward(reqs):  # type: ignore[no-untyped-def]
        in_forward["on"] = True
        try:
            return real_forward(reqs)
        finally:
            in_forward["on"] = False

    s.run_forward = forward  # type: ignore[method-assign]
    return seen


def test_every_copy_is_ordered_inside_the_forward_or_behind_it(make_cpu_server) -> None:
    """Overlap scheduling, chunked prompts sharing a prefix, an L2 hit: SGLang's scheduler
    thread works while the previous forward still runs on the forward stream. Every H2D
    (a load) is submitted at the forward's start, on its stream, and every D2H is
    submitted by the forward's layer hooks or, from the scheduler thread (a checkpoint,
    the flush), behind the fence: none is ordered only behind the schedule stream. The
    loads' checks are pinned behind their forward the same way, never on the schedule
    stream (where SGLang queues a wait for the next forward before deciding them)."""
    s = make_cpu_server(chunk_tokens=2 * PAGE, overlap=True)
    system = prompt(60, 2, tail=0)
    a, b = system + prompt(61, 3), system + prompt(62, 3)
    serve(s, system + [5, 5, 5])
    evict_device(s)  # the system prompt is in L2 only: the next requests load it
    seen = _record_submissions(s)
    s.submit(a)
    s.submit(b)
    s.run_until_idle()
    s.settle()
    assert ("h2d", "forward") in seen and ("d2h", "forward") in seen and ("d2h", "fence") in seen
    assert any(what == "pin" for what, _ in seen), seen
    assert [x for x in seen if x[1] == "scheduler"] == [], seen
    assert all(where == "forward" for direction, where in seen if direction == "h2d")
    clean(s)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_whole_hit_pins_its_loads_checks_behind_its_forward(make_cpu_server, overlap: bool) -> None:
    """A request whose every whole page is in L2 (a load, nothing to back up) is the last
    forward before its checkpoint: its loads' checks are pinned behind that forward from
    the scheduler thread, through the fence, not on the schedule stream."""
    s = make_cpu_server(overlap=overlap)
    tokens = in_l2_only(s, 64)
    seen = _record_submissions(s)
    r = serve(s, tokens)
    assert r.host_hit_length == 5 * PAGE
    assert ("h2d", "forward") in seen and not any(what == "d2h" for what, _ in seen), seen
    assert [where for what, where in seen if what == "pin"] in (["fence"], ["forward"]), seen
    clean(s)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_load_waits_for_the_forward_still_writing_its_slots(make_cuda_server) -> None:
    """CUDA, overlap scheduling. A forward still in flight on the forward stream writes
    every free device page (after a delay, so the host is far ahead of it); the next
    request's load is allocated from those pages. The load must land after that write:
    the forward that reads it checks every byte on the GPU."""
    s = make_cuda_server(overlap=True)
    a = in_l2_only(s, 63)
    stream = s.forward_stream
    free = s.allocator.get_all_free_pages().clone()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the forward in flight, still writing slots it gave back
        torch.cuda._sleep(200_000_000)
        for part in s.tree_cache.kv.parts:
            for view in part.views:
                view[free] = 0x5A
    r = serve(s, a)
    assert r.host_hit_length == 5 * PAGE
    clean(s)


# ---- 2. the MTP draft's pools under speculative decoding ---------------------------------------


def _spec_worker(algorithm: str, draft_pools: tuple[Any, ...]) -> Any:
    """A speculative worker as `BaseSpecWorker._build_hicache_draft_plan` reads one: the
    target runner and the draft runners (test doubles around SGLang's real draft pools);
    its `_draft_model_runners` is SGLang's own."""
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    spec = SpeculativeAlgorithm.from_string(algorithm)
    target = types.SimpleNamespace(spec_algorithm=spec, mtp_draft_device_pools=(), mtp_draft_mamba_pools=())
    runners = [types.SimpleNamespace(token_to_kv_pool=p, model_config=types.SimpleNamespace(num_nextn_predict_layers=1))
               for p in draft_pools]  # fmt: skip
    worker = types.SimpleNamespace(target_worker=types.SimpleNamespace(model_runner=target),
                                   draft_worker=types.SimpleNamespace(draft_runners=runners))  # fmt: skip
    worker._draft_model_runners = types.MethodType(BaseSpecWorker._draft_model_runners, worker)
    return worker


def test_mtp_draft_pools_reach_the_plugin_without_sglangs_hicache(tmp_path: Path) -> None:
    """SGLang hands a tree cache the draft's pools only with --enable-hierarchical-cache.
    Under --radix-cache-backend hicache-cp the plug-in's hook (applied by SGLang's own
    plug-in loader) hands an MTP draft's pools over, refuses a draft whose KV it cannot
    hold, and a speculative server the hook never ran in is refused at start."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

    from hicache_cp.integrations.sglang.drafts import require_draft_pools

    s = SGLangPrefillServer(ServerSpec(), tmp_path / "pools")
    draft_pool = s.drafts[0]
    s.close()
    from hicache_harness.sglang.env import publish_server_args

    publish_server_args(tmp_path / "spec", radix_cache_backend="hicache-cp")
    load_plugins()  # every scheduler process runs it: the plug-in's hooks are applied
    worker = _spec_worker("EAGLE", (draft_pool,))
    plan = BaseSpecWorker._build_hicache_draft_plan(worker)
    runner = worker.target_worker.model_runner
    assert plan.mode.value == "none"  # SGLang's own HiCache plan is untouched
    assert runner.mtp_draft_device_pools == (draft_pool,)  # kv_cache_builder passes these to the factory
    require_draft_pools(types.SimpleNamespace(speculative_algorithm="EAGLE"), worker.target_worker)
    with pytest.raises(ValueError, match="--speculative-algorithm EAGLE3"):
        BaseSpecWorker._build_hicache_draft_plan(_spec_worker("EAGLE3", (draft_pool,)))
    unhooked = types.SimpleNamespace(model_runner=types.SimpleNamespace())
    with pytest.raises(ValueError, match="did not reach the plug-in"):
        require_draft_pools(types.SimpleNamespace(speculative_algorithm="EAGLE"), unhooked)
    require_draft_pools(types.SimpleNamespace(speculative_algorithm="NGRAM"), unhooked)  # no draft KV
    publish_server_args(tmp_path / "plain")  # another backend: the hook hands nothing over
    other = _spec_worker("EAGLE", (draft_pool,))
    BaseSpecWorker._build_hicache_draft_plan(other)
    assert other.target_worker.model_runner.mtp_draft_device_pools == ()


# ---- 3. decisions agreed over SGLang's DP-aware cache group -------------------------------------


def _dp_rank_worker(ctx, workdir: str) -> dict:
    """Two TP ranks, each its own DP rank (attention DP, attention-TP size 1): SGLang's
    TP group spans both, its cache group (`tp_cache_group`) each rank alone. The ranks
    serve different requests; the plug-in's agreement comes from the factory."""
    import torch.distributed as dist

    groups = [dist.new_group([r], backend="gloo") for r in range(ctx.world_size)]  # every rank creates each
    tp_group = types.SimpleNamespace(cpu_group=dist.group.WORLD)  # SGLang's GroupCoordinator: what the factory reads
    spec = ServerSpec()
    env = server_env(64, spec)
    s = SGLangPrefillServer(spec, Path(workdir) / f"rank{ctx.rank}", tree_cache_kwargs={"env": env},
                            groups=(tp_group, groups[ctx.rank]))  # fmt: skip
    try:
        for i in range(1 + ctx.rank):  # rank 1 serves more requests than rank 0: different op counts
            a = prompt(70 + 10 * ctx.rank + i, 5)
            s.submit(a)
        s.run_until_idle()
        s.settle()
        evict_device(s)
        again = serve(s, prompt(70 + 10 * ctx.rank, 5))
        return {
            "agreement": type(s.tree_cache._agreement).__name__,
            "committed": s.tree_cache.cache.stats()["backups_committed"],
            "host_hit": again.host_hit_length,
            "mismatched": s.forward.report.mismatched_bytes,
        }
    finally:
        s.close()


def test_dp_ranks_agree_within_their_cache_group_not_the_tp_group(tmp_path: Path) -> None:
    from hicache_harness.launch import spawn_ranks

    r0, r1 = spawn_ranks(_dp_rank_worker, 2, (str(tmp_path),), timeout_s=120)
    # Each DP rank decides alone (its cache group has one rank): no collective with a rank
    # that serves other requests, whose op lists differ.
    assert r0["agreement"] == r1["agreement"] == "NoneType"
    assert (r0["committed"], r1["committed"]) == (1, 2)
    assert r0["host_hit"] == r1["host_hit"] == 5 * PAGE and r0["mismatched"] == r1["mismatched"] == 0


# ---- 4. prefill CUDA graphs; PD, CP and PP modes --------------------------------------------------


@pytest.mark.parametrize("attention", ["dsa", "mha"])
def test_a_full_prefill_graph_replay_backs_up_only_after_it_ran(make_server, attention: str) -> None:
    """SGLang's full prefill CUDA-graph replay: one wait_until(last layer) before it when
    the forward has loads, no hook inside. That wait must not be taken for "every layer
    below was written": every backup layer is submitted after the replay, and the bytes
    backed up are the replay's. A request with a 2-page L2 hit computing 3 pages more."""
    s = make_server(attention=attention, full_graph=True)
    p = prompt(80, 2, tail=0)
    serve(s, p + [9, 9])
    evict_device(s)
    events: list[str] = []
    cache, forward = s.tree_cache.cache, s.forward
    real_end, real_run = cache.on_layers_end, forward.run

    def on_layers_end(model, layers, backups):  # type: ignore[no-untyped-def]
        events.append(f"backup {model.value} {list(layers)}")
        return real_end(model, layers, backups)

    def run(reqs):  # type: ignore[no-untyped-def]
        events.append("replay")
        real_run(reqs)
        events.append("replayed")

    cache.on_layers_end, forward.run = on_layers_end, run
    a = p + prompt(81, 3)
    r = serve(s, a)
    assert r.host_hit_length == 2 * PAGE
    first_backup = next(i for i, e in enumerate(events) if e.startswith("backup"))
    assert first_backup > events.index("replayed"), events
    evict_device(s)
    r2 = serve(s, a)  # the replay's bytes came back from L2: every byte verifies
    assert r2.host_hit_length == 5 * PAGE
    clean(s)


@pytest.mark.parametrize(
    ("args", "flag"),
    [({"disaggregation_mode": "prefill"}, "--disaggregation-mode prefill"),
     ({"disaggregation_mode": "decode"}, "--disaggregation-mode decode"),
     ({"tp_size": 2, "attn_cp_size": 2}, "--attn-cp-size 2"), ({"pp_size": 2}, "--pp-size 2")],
)  # fmt: skip
def test_modes_the_plugin_cannot_serve_are_refused_at_start_naming_the_flag(
    tmp_path: Path, args: dict[str, object], flag: str
) -> None:
    """SGLang's own ServerArgs for each mode, handed to the factory as SGLang hands it."""
    import hicache_cp.integrations.sglang as plugin
    from hicache_harness.sglang.env import publish_server_args
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    s = SGLangPrefillServer(ServerSpec(), tmp_path / "pools")
    try:
        server_args = publish_server_args(tmp_path / "mode", page_size=PAGE, **args)
        ctx = TreeCacheBuildContext(
            server_args=server_args, params=s.params, is_hybrid_swa=False, is_hybrid_ssm=False,
            enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=s.worker,
            model_config=s.model_config, tp_size=1, tp_rank=0, tp_group=None, is_dsa=True,
        )  # fmt: skip
        with pytest.raises(ValueError, match=flag):
            plugin.build_tree_cache(ctx, env=server_env(8, s.spec))
    finally:
        s.close()


# ---- 5. no device-to-host read per request on the scheduler thread ------------------------------


class _DeviceReads:
    """Counts host reads (`.cpu()`, `.numpy()`, `.tolist()`, `.item()`) of SGLang's device
    index tensors (the request-to-token table, the allocator's slots) made by the plug-in's
    own code (the calling frame is in hicache_cp/integrations/sglang/)."""

    def __init__(self, s: SGLangPrefillServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.watched = {s.req_to_token_pool.req_to_token.untyped_storage().data_ptr()}
        self.reads: list[str] = []
        for name in ("alloc", "alloc_extend"):
            real = getattr(s.allocator, name)

            def alloc(*args, _real=real, **kwargs):  # type: ignore[no-untyped-def]
                out = _real(*args, **kwargs)
                if isinstance(out, torch.Tensor):
                    self.watched.add(out.untyped_storage().data_ptr())
                return out

            monkeypatch.setattr(s.allocator, name, alloc)
        for method in ("cpu", "numpy", "tolist", "item"):
            real = getattr(torch.Tensor, method)

            def read(t, *args, _real=real, _name=method, **kwargs):  # type: ignore[no-untyped-def]
                caller = sys._getframe(1).f_code.co_filename
                if PLUGIN_DIR in caller and t.untyped_storage().data_ptr() in self.watched:
                    self.reads.append(f"{_name} in {Path(caller).name}")
                return _real(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, method, read)


def test_the_scheduler_reads_page_ids_once_a_forward_not_once_a_request(make_cpu_server, monkeypatch) -> None:
    """Four requests in one batch, each loading 2 pages from L2 and reserving 3: no
    scheduling call reads a device index tensor on the host, and the page ids of the
    whole step reach the host in one batched read at the forward's start."""
    s = make_cpu_server()
    system = prompt(90, 2, tail=0)
    serve(s, system + [3, 3])
    evict_device(s)
    reads = _DeviceReads(s, monkeypatch)
    for i in range(4):
        s.submit(system + prompt(91 + i, 3))
    s.run_until_idle()
    monkeypatch.undo()
    s.settle()
    assert s.forward.report.forwards == 2 and s.tree_cache.stats.loaded_tokens == 4 * 2 * PAGE
    assert reads.reads == [], reads.reads
    # One batched read a forward: the second's covers 4 loads and 4 reservations.
    assert s.tree_cache.indices.resolves == 2 and s.tree_cache.indices.reads == 1 + 4 + 4
    clean(s)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_scheduling_calls_never_synchronise_with_the_gpu(make_cuda_server) -> None:
    """CUDA: the plug-in's per-request scheduling calls run under torch's sync-debug mode
    "error": any device-to-host synchronisation in them raises. The pool has room, so
    admission evicts nothing (SGLang's own eviction frees device tensors with a sync)."""
    s = make_cuda_server(device_pages=128)
    system = prompt(92, 2, tail=0)
    serve(s, system + [3, 3])
    evict_device(s)
    for name in ("match_prefix", "init_load_back", "prefix_device_indices", "maybe_hand_to_session"):
        real = getattr(s.tree_cache, name)

        def strict(*args, _real=real, **kwargs):  # type: ignore[no-untyped-def]
            torch.cuda.set_sync_debug_mode("error")
            try:
                return _real(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        setattr(s.tree_cache, name, strict)
    for i in range(3):
        s.submit(system + prompt(93 + i, 3))
    s.run_until_idle()
    s.settle()
    assert s.tree_cache.stats.loaded_tokens == 3 * 2 * PAGE
    clean(s)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_page_ids_reuse_one_pinned_buffer_and_read_exact_values() -> None:
    """CUDA: `HostIndices` stages int32 rows (SGLang's req_to_token) and int64 tensors,
    strided views included, in one reused pinned buffer that grows past its first size
    mid-forward; every forward reads back exactly what was staged, and what a resolve
    returned is not changed by the next forward's copies into the same buffer."""
    from hicache_cp.integrations.sglang.page_ids import INITIAL_VALUES, HostIndices

    indices = HostIndices()
    gen = torch.Generator(device="cpu").manual_seed(3)
    table = torch.randint(0, 1 << 30, (8, 4096), generator=gen, dtype=torch.int32).cuda()
    kept: list[tuple[list, list]] = []
    for forward in range(3):
        want = [table[forward, : 64 * (k + 1) : 64] for k in range(3)]  # strided, as a request's page starts
        want.append(torch.arange(forward, forward + 5, dtype=torch.int64, device="cuda"))
        want.append(table[forward + 1].to(torch.int64).repeat(2 + INITIAL_VALUES // 4096))  # outgrows the buffer
        handles = [indices.add(t) for t in want]
        got = indices.resolve()
        assert [len(got[h]) for h in handles] == [t.numel() for t in want]
        for h, t in zip(handles, want):
            assert got[h].dtype == np.int64 and (got[h] == t.cpu().numpy()).all(), (forward, h)
        kept.append((got, [t.cpu().numpy() for t in want]))
    for got, want in kept:  # earlier results are arrays of their own
        assert all((g == w).all() for g, w in zip(got, want))
    assert indices.waits == 3 and indices.resolves == 3


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_page_ids_keep_every_page_start_of_a_whole_row(device: str) -> None:
    """`add(row, step)` keeps every `step`-th slot of a request's row from the first:
    exactly a page's first slots, whatever the row's length; strided tensors are still
    read exactly, and a tensor that is not 1-D is refused."""
    from hicache_cp.integrations.sglang.page_ids import HostIndices

    indices = HostIndices()
    gen = torch.Generator(device="cpu").manual_seed(5)
    table = torch.randint(0, 1 << 30, (4, 1024), generator=gen, dtype=torch.int32).to(device)
    rows = [table[1, :640], table[2, :64], table[3, :1000], table[0, :512:64]]
    steps = [64, 64, 64, 1]
    handles = [indices.add(t, step) for t, step in zip(rows, steps)]
    got = indices.resolve()
    for h, t, step in zip(handles, rows, steps):
        want = t.cpu().numpy()[::step]
        assert got[h].dtype == np.int64 and np.array_equal(got[h], want), (h, step)
    with pytest.raises(ValueError, match="step 0"):
        indices.add(rows[0], 0)
    with pytest.raises(ValueError, match="1-D"):
        indices.add(table, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_page_ids_never_wait_behind_device_to_host_copies_in_flight() -> None:
    """CUDA: a forward's page ids reach the host while a large D2H copy (a backup) is still
    in flight on another stream: `resolve` waits for the schedule stream's kernels only,
    not for the copy engines' queue."""
    from hicache_cp.integrations.sglang.page_ids import HostIndices

    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB: about 20 ms over PCIe
    target = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=True)
    slots = torch.arange(0, 64 * 40, dtype=torch.int32, device="cuda")
    indices = HostIndices()
    indices.add(slots[:64], 64)
    indices.resolve()  # the kernel is built before the race below
    backup, landed = torch.cuda.Stream(), torch.cuda.Event()
    torch.cuda.synchronize()
    with torch.cuda.stream(backup):
        target.copy_(source, non_blocking=True)
        landed.record()
    handle = indices.add(slots, 64)
    got = indices.resolve()
    assert not landed.query(), "the page ids waited for the D2H copy in flight"
    assert np.array_equal(got[handle], np.arange(0, 64 * 40, 64))
    landed.synchronize()


# ---- 6. LoRA adapters and extra keys -------------------------------------------------------------


def test_lora_adapters_and_extra_keys_never_hit_across_each_other(make_server) -> None:
    """The same tokens under adapter A, adapter B, an extra key and the base model: their KV
    differs (the harness salts each token's bytes with the request's extra key), so a hit
    across them would read wrong bytes. None of them is offered another's L2 copy, and
    none but the base model's reaches L2 at all (SGLang keys its device tree by the extra
    key, hicache-cp's tree by tokens only: keyed requests are not eligible)."""
    s = make_server()
    tokens = prompt(100, 5)
    serve(s, tokens)  # the base model's copy: in L2
    reserved = s.tree_cache.stats.reserved_pages
    evict_device(s)
    for lora_id, extra_key in (("adapter-a", None), ("adapter-b", None), (None, "salt-1"), ("adapter-a", None)):
        req = s.submit(tokens, lora_id=lora_id, extra_key=extra_key)
        s.run_until_idle()
        s.settle()
        assert req.host_hit_length == 0, (lora_id, extra_key)
        evict_device(s)
    assert s.tree_cache.stats.offered_tokens == 0 and s.tree_cache.stats.reserved_pages == reserved
    r = serve(s, tokens)  # the base model's copy is still the only one, intact
    assert r.host_hit_length == 5 * PAGE
    clean(s)


# ---- issue 48: the missing SGLang tests ----------------------------------------------------------


def test_a_backup_reading_slots_freed_as_duplicates_is_waited_for_before_reuse(make_cpu_server) -> None:
    """Two requests compute the same 5 pages in one batch: the first reserves them in L2,
    the second finds them pending. Results are processed second-first (the plug-in must not
    rely on the batch's order): the second inserts its pages, and the first's insert frees
    the first's slots as duplicates while its backup still reads them (its D2H is held).
    Its checkpoint waits for that backup before anything can allocate the slots again."""
    from conftest import Faults

    s = make_cpu_server()
    a = prompt(110, 5)
    r1, r2 = s.submit(a), s.submit(a)
    reqs = s.prepare_batch()
    assert reqs == [r1, r2]
    faults = Faults()
    s.tree_cache.cache.engine.fault = faults
    faults.hold()  # every copy waits at the gate: r1's backup keeps reading r1's slots
    s.run_forward(reqs)
    done = threading.Event()

    def results() -> None:
        s.process_results([r2, r1])
        done.set()

    worker = threading.Thread(target=results)
    worker.start()
    try:
        time.sleep(0.3)
        assert not done.is_set() and s.tree_cache.stats.duplicate_waits == 1  # r1's checkpoint waits
    finally:
        faults.open()
    worker.join(timeout=10)
    assert done.is_set()
    s.tree_cache.cache.engine.fault = None
    s.tree_cache.flush_pending_backups()
    s.settle()
    evict_device(s)
    r = serve(s, a)  # the copy r1's backup made is whole: every byte verifies
    assert r.host_hit_length == 5 * PAGE
    clean(s)


def test_device_eviction_before_the_flush_waits_for_the_copies_that_read_its_slots(make_cpu_server) -> None:
    """Between a request's checkpoint and the after-batch flush its backup is undecided
    (its D2H held in flight). SGLang's device tree holds the request's pages unlocked, so
    an eviction then frees them, but it returns only once the copies reading them have
    returned: nothing can allocate those slots under a copy. The backup is still decided
    at the flush, and commits whole."""
    from conftest import Faults
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    s = make_cpu_server()
    a = prompt(111, 5)
    req = s.submit(a)
    faults = Faults()
    s.tree_cache.cache.engine.fault = faults
    reqs = s.prepare_batch()
    faults.hold()
    done = threading.Event()
    try:
        s.run_forward(reqs)
        s.process_results(reqs)  # checkpoint: inserted into the device tree, backup undecided
        (op,) = [op for flow in s.tree_cache._flows.values() for op in flow.backups]
        assert s.tree_cache.protected_size() == 0 and s.tree_cache.evictable_size() == 5 * PAGE
        free = s.allocator.available_size()

        def evict() -> None:
            s.tree_cache.evict(EvictParams(num_tokens=10**9))
            done.set()

        worker = threading.Thread(target=evict)
        worker.start()
        time.sleep(0.3)
        assert not done.is_set() and op.inflight  # the eviction waits for the held copies
    finally:
        faults.open()
    worker.join(timeout=30)
    assert done.is_set() and s.tree_cache.stats.eviction_waits == 1
    assert s.allocator.available_size() == free + 5 * PAGE and op.active  # freed; the decision is the flush's
    s.tree_cache.cache.engine.fault = None
    s.settle()
    assert s.tree_cache.cache.stats()["backups_committed"] == 1 and req.finished_reason is not None
    assert serve(s, a).host_hit_length == 5 * PAGE  # the copy it waited for is whole
    clean(s)


def test_a_round_that_admits_nothing_never_waits_for_a_flush(make_cpu_server) -> None:
    """SGLang 0.5.23's scheduler calls nothing of a registered tree cache in a round that
    admits nothing and runs no batch (`on_idle` returns early while requests wait,
    `check_hicache_events` is for its own HiCache, `flush_pending_backups` follows a
    batch). A's backup is still copying at the flush after A's batch, so it is undecided
    until some later flush; B needs the device pages A's path holds. B's admission evicts
    them (the copies that read them have returned by then), so the server goes on: no
    decision is needed to free device room, and A's copy still commits whole later."""
    from conftest import Faults

    s = make_cpu_server(device_pages=12)  # 11 pages of room: A's 8 and B's 9 do not fit together
    a, b = prompt(120, 8), prompt(121, 8)
    faults = Faults()
    s.tree_cache.cache.engine.fault = faults
    faults.hold()  # A's D2H waits at the gate: undecided at the flush after A's batch
    ra = s.submit(a)
    s.step()  # forward, checkpoint (A inserted into SGLang's tree), flush
    assert ra.finished()
    (op,) = [op for flow in s.tree_cache._flows.values() for op in flow.backups]
    assert op.active
    faults.open()
    for ticket in op.inflight:  # the copies return; nothing polls them before the next flush
        ticket.wait()
    s.tree_cache.cache.engine.fault = None
    rb = s.submit(b)
    s.run_until_idle(max_steps=50)  # SGLang's rounds: admission (match, PrefillAdder, evict) and the batch
    assert rb.finished() and s.admissions[rb.rid] == (0, 0)
    s.settle()
    assert s.tree_cache.cache.stats()["backups_committed"] == 2
    evict_device(s)
    assert serve(s, a).host_hit_length == 8 * PAGE  # A's copy, decided after its pages left the device
    clean(s)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_round_that_admits_nothing_never_waits_for_a_flush_on_cuda(make_cuda_server) -> None:
    """The CPU test's stall with CUDA copies: the copy engine's D2H stream is kept busy
    (about 0.2 s) before A's forward, so A's backup is still copying at the flush after
    A's batch. B's admission evicts A's pages, its eviction waiting for those copies on
    the GPU (a bounded host wait), and every byte B and the later L2 hit read verifies."""
    s = make_cuda_server(device_pages=12)
    a, b = prompt(122, 8), prompt(123, 8)
    ra = s.submit(a)
    reqs = s.prepare_batch()  # allocation first (SGLang's Triton kernels compile on first use)
    with torch.cuda.stream(s.tree_cache.cache.engine.stream(Direction.D2H)):
        torch.cuda._sleep(400_000_000)
    s.run_batch(reqs)  # forward, checkpoint, flush
    (op,) = [op for flow in s.tree_cache._flows.values() for op in flow.backups]
    assert ra.finished() and op.active
    rb = s.submit(b)
    s.run_until_idle(max_steps=50)
    assert rb.finished() and s.admissions[rb.rid] == (0, 0) and s.tree_cache.stats.eviction_waits == 1
    s.settle()
    assert s.tree_cache.cache.stats()["backups_committed"] == 2
    evict_device(s)
    assert serve(s, a).host_hit_length == 8 * PAGE
    clean(s)


@pytest.mark.parametrize("consumer_index", [-1, 0, 1, 2])
def test_a_forward_start_finishes_the_previous_forwards_backups_whatever_the_index(
    make_cpu_server, consumer_index: int
) -> None:
    """The backup layers no hook reported (the last target layer, the draft layer) are
    submitted at the next forward's start, whatever consumer index SGLang passes, and at
    the checkpoint when no forward follows."""
    s = make_cpu_server()
    s.worker.set_hicache_consumer = lambda _index, _real=s.worker.set_hicache_consumer: _real(consumer_index)
    s.submit(prompt(112, 5))
    first = s.prepare_batch()
    s.run_forward(first)
    (op,) = s.tree_cache._flows[first[0].cache_request_handle].backups
    assert op.missing_layers()  # the forward's last layers: not reported by any hook
    s.submit(prompt(113, 5))
    second = s.prepare_batch()
    s.run_forward(second)  # the next forward's start
    assert not op.missing_layers()
    (op2,) = s.tree_cache._flows[second[0].cache_request_handle].backups
    s.process_results(first + second)  # the checkpoints
    assert not op2.missing_layers()
    s.tree_cache.flush_pending_backups()
    clean(s)


def test_a_backup_computed_on_a_failing_load_never_commits(make_cpu_server) -> None:
    """A request loads 2 pages from L2 and computes 3 more, which its forward derives from
    the loaded ones: their backup is computed on the load, whose draft copy fails. Under
    overlap scheduling polls run between that forward and the request's checkpoint (the
    previous batch's flush); one of them comes after every copy returned, the backup's
    landed whole. It must abort with the load, never commit: nothing of the request
    reaches L2 (a later request finds only the 2 old pages)."""
    from conftest import Faults
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    s = make_cpu_server()
    p = prompt(114, 2, tail=0)
    serve(s, p + [4, 4])
    evict_device(s)
    faults = Faults()
    faults.fail_on.add((Direction.H2D, Part.DRAFT_STATE, 0))
    s.tree_cache.cache.engine.fault = faults
    a = p + prompt(115, 3)
    r = s.submit(a)
    reqs = s.prepare_batch()
    s.run_forward(reqs)
    s.tree_cache.flush_pending_backups()  # the previous batch's flush: the forward's last layers go out
    s.tree_cache.cache.settle()  # a later poll, once every copy returned: the backup landed whole
    s.process_results(reqs)  # the checkpoint: the load failed, the request fails
    s.tree_cache.flush_pending_backups()
    s.tree_cache.cache.engine.fault = None
    assert isinstance(r.finished_reason, FINISH_ABORT)
    stats = s.tree_cache.cache.stats()
    assert stats["backups_committed"] == 1 and stats["backups_aborted"] == 1  # the first serve's; this one's
    s.forward.report.mismatched_bytes = 0  # the failed forward read a draft layer that never landed
    s.forward.report.mismatches.clear()
    evict_device(s)
    assert serve(s, a).host_hit_length == 2 * PAGE
    clean(s)


def test_kv_pools_of_a_quantized_mha_cache_are_refused_loudly(tmp_path: Path) -> None:
    """A quantized MHA pool keeps per-token scales beside K and V: a part the plug-in does
    not hold, so it refuses the pool at start rather than serve hits without scales."""
    from hicache_cp.integrations.sglang.pools import SGLangKV

    s = SGLangPrefillServer(ServerSpec(attention="mha"), tmp_path)
    try:
        kv = SGLangKV.from_pools(s.target, s.drafts)
        assert kv.kinds == ((Model.TARGET, "mha"), (Model.DRAFT, "mha")) and not kv.read_ahead
        assert [p.part for p in kv.parts] == [Part.TARGET_KV, Part.TARGET_STATE, Part.DRAFT_KV, Part.DRAFT_STATE]
        s.target.k_scale_buffer = [torch.zeros(1)]
        with pytest.raises(ValueError, match="scales"):
            SGLangKV.from_pools(s.target, s.drafts)
    finally:
        s.close()


def test_gqa_pools_with_a_narrower_v_keep_every_byte(make_server) -> None:
    """GQA with V narrower than K: SGLang allocates K and V apart (not the halves of one
    tensor); both parts load and back up whole, every byte verifies."""
    s = make_server(attention="mha", kv_heads=2, head_dim=32, v_head_dim=16)
    kv = s.tree_cache.kv
    assert kv.part(Part.TARGET_KV).bytes_per_token == 2 * kv.part(Part.TARGET_STATE).bytes_per_token
    a = in_l2_only(s, 116)
    r = serve(s, a)
    assert r.host_hit_length == 5 * PAGE
    assert s.forward.report.checked_bytes == 5 * PAGE * s.spec.token_bytes
    clean(s)


