"""The checksum kernel (`hicache_cp.io.checksum_gpu`) and the CUDA engines' restore checks.

* On CPU: the Triton kernel in Triton's interpreter (TRITON_INTERPRET=1, a
  subprocess) gives the bits numpy gives, through raw addresses as on the GPU.
* On the GPU (marked `gpu`): the compiled kernel equals numpy, writing into
  device memory and into pinned host memory (the host pool's checksum arena);
  a HiCache on the `direct` backend stores every backup's checksums, catches a
  flipped bit in host memory, and catches a forward writing into slots a load
  filled (ordered after the copy, and racing it), never deciding such a load DONE.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache_cp import checksum
from hicache_cp.layout import KVLayout, Model, Part

ROOT = Path(__file__).resolve().parent.parent
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def layout() -> KVLayout:
    # page bytes 16 x 40 = 640 (80 words: several kernel blocks of 8 in the interpreter),
    # index skip on the state, a draft part
    return KVLayout.build(page_size=16, num_layers=3, kv_bytes_per_token=40, state_bytes_per_token=8,
                          state_layers=(0, 2), draft_layers=1, draft_kv_bytes_per_token=16)  # fmt: skip


@needs_triton
def test_kernel_equals_numpy_in_the_triton_interpreter() -> None:
    script = textwrap.dedent("""
        import numpy as np, torch
        from hicache_cp import checksum
        from hicache_cp.io import checksum_gpu as g
        from tests.test_checksum_gpu import layout
        lay = layout()
        rng = np.random.default_rng(0)
        n = 12
        bufs = {p.part: torch.from_numpy(rng.integers(0, 256, (p.num_slots, n, p.page_bytes), dtype=np.uint8))
                for p in lay.parts}
        tables = g.DeviceTables(lay, lambda part, slot: bufs[part][slot].data_ptr(), torch.device("cpu"))
        pages = np.array([9, 2, 5, 11], dtype=np.int64)
        out_index = np.array([0, 3, 1, 2], dtype=np.int64)
        for programs in (4, 3, 1):  # a program a page, and fewer programs taking several pages each
            for p in lay.parts:
                out = np.zeros((p.num_slots, 4), dtype=np.uint64)
                t = tables.parts[p.part]
                g._kernel()[(programs, p.num_slots)](t.layer_ptrs, 0, torch.from_numpy(pages), 4, out.ctypes.data,
                                                     4, torch.from_numpy(out_index), tables.mult_a, tables.mult_b,
                                                     t.salts, t.words, BLOCK=8)  # fmt: skip
                for slot, lay_id in enumerate(p.layer_ids):
                    want = checksum.checksums(bufs[p.part][slot].numpy()[pages], p.part, lay_id)
                    assert np.array_equal(out[slot, out_index], want), (programs, p.part, slot)
        print("EQUAL")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "EQUAL" in done.stdout, done.stderr[-3000:]


@needs_triton
def test_the_kernel_is_compiled_once_per_page_size() -> None:
    """The first slot, the page count, the output's address and its row length change
    between launches (an op's first landed layer, its pages, a backup's or a load's
    output): none selects a compiled variant, so the engines' `warm_up` compiles the
    only ones a run launches (one per page size) and no step compiles."""
    from hicache_cp.io import checksum_gpu as g

    params = {p.name: p for p in g._kernel().params}
    assert {n for n, p in params.items() if p.do_not_specialize} == {"slot0", "n", "out_base", "out_row"}
    assert not params["words"].do_not_specialize  # the loop bound: its divisibility helps the loads


def test_a_launch_needs_at_least_one_program() -> None:
    from hicache_cp.io import checksum_gpu as g

    with pytest.raises(ValueError, match="max_programs"):
        g.DeviceTables(layout(), lambda part, slot: 0, torch.device("cpu"), max_programs=0)


@gpu
@needs_cuda
@pytest.mark.parametrize("max_programs", [None, 7])
@pytest.mark.parametrize("pages", [1, 37, 1024])
def test_kernel_equals_numpy_into_device_and_pinned_host_memory(pages: int, max_programs: int | None) -> None:
    from hicache_cp.io import checksum_gpu as g
    from hicache_cp.pools import DevicePool, HostPool

    lay = KVLayout.build(page_size=64, num_layers=4, kv_bytes_per_token=656, state_bytes_per_token=132,
                         draft_layers=1, draft_kv_bytes_per_token=656, draft_state_bytes_per_token=132)  # fmt: skip
    dev = DevicePool(lay, pages + 3, device="cuda")
    host = HostPool(lay, lay.bytes_per_page * (pages + 3), pin=True, checksums=True)
    try:
        g_rng = torch.Generator(device="cuda").manual_seed(pages)
        for p in lay.parts:
            dev.buffer(p.part).copy_(torch.randint(0, 256, dev.buffer(p.part).shape, generator=g_rng, device="cuda",
                                                   dtype=torch.uint8))  # fmt: skip
        tables = g.DeviceTables(lay, dev.layer_ptr, dev.device, max_programs)
        rng = np.random.default_rng(pages)
        src = rng.permutation(np.arange(1, pages + 3))[:pages].astype(np.int64)
        dst = rng.permutation(np.arange(1, host.physical_pages))[:pages].astype(np.int64)
        stream = torch.cuda.Stream()
        for p in lay.parts:
            g.launch(tables, p.part, 0, p.num_slots, torch.from_numpy(src).cuda(), host.sums_address(p.part),
                     host.physical_pages, torch.from_numpy(dst).cuda(), stream)  # fmt: skip
        stream.synchronize()
        for p in lay.parts:
            for slot, layer in enumerate(p.layer_ids):
                want = checksum.checksums(dev.layer(p.part, slot).cpu().numpy()[src], p.part, layer)
                assert np.array_equal(host.sums(p.part)[slot, dst], want), (p.part, layer)
                got = g.device_checksums(dev, p.part, layer, src)  # into device memory
                assert np.array_equal(got, want)
    finally:
        host.close()


def _cuda_cache(**cfg):  # type: ignore[no-untyped-def]
    from conftest import tiny_config

    from hicache_cp.cache import HiCache

    config = tiny_config(l1_pages=64, host_pages=64, io_backend="direct", pin_host=True, **cfg)
    return HiCache(config, device="cuda")


def _a_load(cache):  # type: ignore[no-untyped-def]
    """A prompt of 8 pages served, gone from L1, matched and loaded back: (prompt, match, load)."""
    from hicache_harness.engines.synthetic import ReferenceServer

    prompt = np.arange(8 * 16, dtype=np.int64)
    ReferenceServer(cache).serve(0, prompt)
    cache.evict_device()
    m = cache.match_prefix(prompt, request=1)
    load = cache.load_back(m)
    assert load is not None
    return prompt, m, load


@gpu
@needs_cuda
def test_backups_store_the_checksums_of_what_they_copied_and_a_flip_is_caught() -> None:
    from hicache_harness.engines.synthetic import ReferenceServer

    cache = _cuda_cache()
    with cache:
        server = ReferenceServer(cache)
        prompt = np.arange(6 * 16, dtype=np.int64)
        server.serve(0, prompt)
        host = np.concatenate([n.host_pages for n in cache.tree.match(prompt)])
        for p in cache.layout.parts:  # the stored checksums are those of the landed host bytes
            for slot, layer in enumerate(p.layer_ids):
                want = checksum.checksums(cache.host_pool.layer_view(p.part, slot)[host], p.part, layer)
                assert np.array_equal(cache.host_pool.sums(p.part)[slot, host], want), (p.part, layer)
        cache.evict_device()
        server.serve(1, prompt)  # a clean load passes
        assert cache.stats()["loads_done"] == 1 and cache.stats()["verified_pages"] == 6
        cache.evict_device()
        cache.host_pool.layer_view(Part.TARGET_STATE, 1)[host[3], 7] ^= 0x20
        server.serve(2, prompt)
        stats = cache.stats()
        assert stats["loads_aborted"] == 1 and stats["verify_failures_l2_target_state"] == 1
        assert stats["integrity_dropped_pages"] == 6
        assert server.integrity.mismatches == 0 and server.integrity.complete
        cache.drain()
        cache.check_invariants()


@gpu
@needs_cuda
@pytest.mark.parametrize("ordered", [True, False])
def test_a_forward_writing_into_loaded_slots_is_never_decided_done(ordered: bool) -> None:
    """A forward writes into L1 pages a load fills (two owners of one page). Ordered
    after the copy (the forward waited on the layer) the check always sees it; racing
    the copy on another stream, either the copy's bytes win (the load is right and
    DONE) or the check sees the write: a load is DONE only with the right bytes."""
    from hicache_harness import integrity
    from hicache_cp.keys import prefix_hashes
    from hicache_cp.ops import LoadState

    cache = _cuda_cache()
    with cache:
        prompt, m, load = _a_load(cache)
        side = torch.cuda.Stream()
        buf = cache.device_pool.buffer(Part.TARGET_KV)
        target = torch.from_numpy(load.device_pages[2:6].copy()).cuda()
        if ordered:
            for model in (Model.TARGET, Model.DRAFT):
                for layer in range(cache.layout.num_layers(model)):
                    load.wait_layer(layer, model)
            buf[1].index_fill_(0, target, 7)  # on the compute stream, after the copy
        else:
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000)
                buf[1].index_fill_(0, target, 7)  # unordered with the copy
            torch.cuda.current_stream().wait_stream(side)  # the forward joins it before the decision
        while load.active:
            cache.settle()
        expected = integrity.content_torch(prefix_hashes(prompt, 16), Part.TARGET_KV, 1,
                                           cache.layout.part(Part.TARGET_KV).page_bytes, "cuda")  # fmt: skip
        landed = buf[1].index_select(0, torch.from_numpy(load.device_pages).cuda())
        right = bool((landed == expected).all())
        if ordered:
            assert load.state is LoadState.ABORTED and cache.stats()["verify_failures_l2_target_kv"] >= 1
        else:
            assert (load.state is LoadState.DONE) == right, (load.state, right)
        cache.release(m.last_node)
        cache.drain()
        cache.check_invariants()


@gpu
@needs_cuda
@pytest.mark.parametrize("pin, write", [(True, False), (True, True), (False, False)])
def test_a_pinned_loads_checks_follow_its_forward_not_the_work_queued_after_it(pin: bool, write: bool) -> None:
    """Under overlap scheduling SGLang queues the next forward behind the one that read a
    load, and its own stream waits for it, before it decides the load. Pinned once its
    forward is enqueued (`HiCache.loads_read`), the load's checks follow that forward only:
    the load is decided while the next forward still runs, and a write the forward made
    into the loaded slots is still seen. Unpinned, they also wait for the next forward."""
    from hicache_cp.ops import LoadState

    cache = _cuda_cache()
    with cache:
        _, m, load = _a_load(cache)
        for model in (Model.TARGET, Model.DRAFT):  # the forward reads every layer
            for layer in range(cache.layout.num_layers(model)):
                load.wait_layer(layer, model)
        if write:  # the forward writes into slots the load filled
            target = torch.from_numpy(load.device_pages[2:6].copy()).cuda()
            cache.device_pool.buffer(Part.TARGET_KV)[1].index_fill_(0, target, 7)
        if pin:
            cache.loads_read([load])
        torch.cuda._sleep(3_000_000_000)  # the next forward, about 1-2 s
        later = torch.cuda.Event()
        later.record()
        deadline = time.monotonic() + (10.0 if pin else 0.3)
        while load.active and time.monotonic() < deadline:
            cache.poll()
            time.sleep(0.001)
        if pin:
            assert not later.query(), "the next forward ended before the load was decided"
            assert load.state is (LoadState.ABORTED if write else LoadState.DONE), load.state
        else:
            assert load.active and not later.query()  # its checks wait behind the next forward
            later.synchronize()
            while load.active:
                cache.settle()
            assert load.state is LoadState.DONE
        torch.cuda.synchronize()
        cache.release(m.last_node)
        cache.drain()
        cache.check_invariants()
