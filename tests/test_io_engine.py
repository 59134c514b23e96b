"""Copy-engine contract tests.

CPU: the backend registry (selection and its error), the cpu backend's byte
contract (exact bytes both ways, destination pages outside the set and the
source untouched), input errors and failure reporting.

GPU (marked `gpu`, skipped without CUDA): the same byte contract for every
CUDA backend over random page sets of 1, 7, 64 and 1000 pages (and more than
one kernel launch carries), every kernel mode, the DMA routing of coalesced
copies, the FAILED path, ordering (a backup submitted right after compute
wrote a layer copies the new bytes), and a submission's host time that does
not grow with the page count.

CPU: the DMA descriptors of a copy (`runs.dma_plan`) cover every byte once
and never cross a registration chunk.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch

from hicache_harness.bench.io_variants import register_bench_backends
from hicache_cp.io import kernels
from hicache_cp.io.base import CopyFailed, Direction, TicketState, backend_names, make_engine
from hicache_cp.layout import KVLayout, Part
from hicache_cp.pools import DevicePool, HostPool

register_bench_backends()  # the benchmark-only engines are tested too
CUDA_BACKENDS = ("hybrid", "kernel", "direct", "staging")
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


def small_layout(page_bytes_per_token: int = 40) -> KVLayout:
    # Index skip on the state part: layers 1 and 3 only (compact slots 0 and 1).
    return KVLayout.build(
        page_size=4, num_layers=4, kv_bytes_per_token=page_bytes_per_token,
        state_bytes_per_token=12, state_layers=(1, 3),
    )


def random_pairs(rng: np.random.Generator, n: int, dev_pages: int, host_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """n distinct device pages and n distinct host pages, random order, page 0 excluded."""
    dev = rng.choice(np.arange(1, dev_pages), size=n, replace=False).astype(np.int64)
    host = rng.choice(np.arange(1, host_pages), size=n, replace=False).astype(np.int64)
    return dev, host


# -- registry ---------------------------------------------------------------------------


def test_unknown_backend_lists_supported_names() -> None:
    layout = small_layout()
    dev = DevicePool(layout, 8)
    with HostPool(layout, 8 * layout.bytes_per_page, pin=False) as host:
        with pytest.raises(ValueError) as err:
            make_engine("nope", dev, host)
    msg = str(err.value)
    for name in ("auto", "cpu", *CUDA_BACKENDS):
        assert name in msg, msg


def test_registry_has_every_backend_and_auto_picks_cpu_for_host_pools() -> None:
    assert set(backend_names()) >= {"cpu", *CUDA_BACKENDS}
    layout = small_layout()
    dev = DevicePool(layout, 8)
    with HostPool(layout, 8 * layout.bytes_per_page, pin=False) as host:
        engine = make_engine("auto", dev, host)
        assert engine.name == "cpu"
        engine.close()


def test_the_settings_offer_the_product_backends_only() -> None:
    """`cpu` and `direct` are the product: built in, and all a configuration may name
    (with "auto"). The SM-kernel and staging engines exist for the benchmarks, which
    register them; a process that never imported the benchmarks refuses them with the
    supported names. (A fresh interpreter: this test module registered them here.)"""
    import subprocess
    import sys
    from pathlib import Path

    from hicache_cp.io.base import BUILTIN

    assert set(BUILTIN) == {"cpu", "direct"}
    script = (
        "from hicache_cp.config import Config\n"
        "from hicache_cp.errors import ConfigError\n"
        "for name in ('kernel', 'hybrid', 'staging'):\n"
        "    try:\n"
        "        Config(io_backend=name)\n"
        "    except ConfigError as exc:\n"
        "        print(exc)\n"
        "    else:\n"
        "        print('accepted', name)\n"
        "Config(io_backend='direct'); Config(io_backend='cpu')\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", script], cwd=root, env={"PYTHONPATH": str(root)},
                         capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()  # fmt: skip
    assert len(out) == 3 and all("unknown backend" in line and "supported: auto, cpu, direct" in line for line in out), out


@pytest.mark.parametrize("name", CUDA_BACKENDS)
def test_cuda_backends_refuse_host_memory_device_pools(name: str) -> None:
    layout = small_layout()
    dev = DevicePool(layout, 8)
    with HostPool(layout, 8 * layout.bytes_per_page, pin=False) as host:
        with pytest.raises(ValueError, match="CUDA device pool"):
            make_engine(name, dev, host)


# -- cpu backend contract ---------------------------------------------------------------


@pytest.fixture
def cpu_pools():
    layout = small_layout()
    dev = DevicePool(layout, 64)
    host = HostPool(layout, 80 * layout.bytes_per_page, pin=False)
    yield layout, dev, host
    host.close()


@pytest.mark.parametrize("seed", range(5))
def test_cpu_backend_copies_exact_bytes_both_ways(cpu_pools, seed: int) -> None:
    layout, dev, host = cpu_pools
    rng = np.random.default_rng(seed)
    engine = make_engine("cpu", dev, host)
    try:
        for p in layout.parts:
            for layer in p.layer_ids:
                slot = p.slot(layer)
                n = int(rng.integers(1, 40))
                d_pages, h_pages = random_pairs(rng, n, dev.physical_pages, host.physical_pages)
                dview, hview = dev.layer_view(p.part, slot), host.layer_view(p.part, slot)
                # Backup: fresh source bytes, poisoned destination.
                dview[:] = rng.integers(0, 256, dview.shape, dtype=np.uint8)
                hview[:] = 0xAB
                src_before, dst_before = dview.copy(), hview.copy()
                engine.submit_backup(p.part, layer, d_pages, h_pages).wait()
                np.testing.assert_array_equal(hview[h_pages], dview[d_pages])
                untouched = np.setdiff1d(np.arange(host.physical_pages), h_pages)
                np.testing.assert_array_equal(hview[untouched], dst_before[untouched])
                np.testing.assert_array_equal(dview, src_before)
                # Load: fresh host bytes, poisoned device.
                hview[:] = rng.integers(0, 256, hview.shape, dtype=np.uint8)
                dview[:] = 0xCD
                src_before, dst_before = hview.copy(), dview.copy()
                t = engine.submit_load(p.part, layer, h_pages, d_pages)
                t.make_compute_wait()
                assert t.query() is TicketState.DONE
                np.testing.assert_array_equal(dview[d_pages], hview[h_pages])
                untouched = np.setdiff1d(np.arange(dev.physical_pages), d_pages)
                np.testing.assert_array_equal(dview[untouched], dst_before[untouched])
                np.testing.assert_array_equal(hview, src_before)
    finally:
        engine.close()


def test_cpu_backend_rejects_bad_input(cpu_pools) -> None:
    _, dev, host = cpu_pools
    engine = make_engine("cpu", dev, host)
    try:
        with pytest.raises(ValueError, match="counts differ"):
            engine.submit_backup(Part.TARGET_KV, 0, np.array([1, 2]), np.array([3]))
        with pytest.raises(TypeError, match="numpy"):
            engine.submit_backup(Part.TARGET_KV, 0, [1, 2], np.array([3, 4]))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="has no layer 0"):
            engine.submit_load(Part.TARGET_STATE, 0, np.array([1]), np.array([1]))
    finally:
        engine.close()


def test_cpu_fault_hook_gives_failed_ticket(cpu_pools) -> None:
    _, dev, host = cpu_pools

    def fault(direction: Direction, part: Part, layer: int) -> None:
        if layer == 2:
            raise RuntimeError("injected")

    engine = make_engine("cpu", dev, host, fault=fault)
    try:
        ok = engine.submit_backup(Part.TARGET_KV, 1, np.array([1]), np.array([1]))
        bad = engine.submit_backup(Part.TARGET_KV, 2, np.array([1]), np.array([1]))
        ok.wait()
        with pytest.raises(CopyFailed, match="injected"):
            bad.wait()
        assert bad.query() is TicketState.FAILED  # query never raises
        assert ok.query() is TicketState.DONE
        assert isinstance(bad.error, RuntimeError)
    finally:
        engine.close()


# -- CUDA backends ----------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@pytest.fixture(scope="module")
def cuda_pools():
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    # 1040 B pages (16-byte vectors) on the kv part, 48 B (16 B) on the state part,
    # plus a 1036 B layout below for the 4-byte vector path.
    layout = small_layout(260)
    dev = DevicePool(layout, 1200, device="cuda")
    host = HostPool(layout, 1500 * layout.bytes_per_page, pin=True)
    host.wait_ready()
    yield layout, dev, host
    host.close()


def _check_roundtrip(engine, layout: KVLayout, dev: DevicePool, host: HostPool, rng: np.random.Generator, n: int) -> None:
    for p in layout.parts:
        layer = p.layer_ids[-1]
        slot = p.slot(layer)
        d_pages, h_pages = random_pairs(rng, n, dev.physical_pages, host.physical_pages)
        dbuf = dev.buffer(p.part)[slot]
        hview = host.torch_view(p.part)[slot]
        # Backup.
        dbuf.copy_(torch.randint(0, 256, dbuf.shape, dtype=torch.uint8, device=dbuf.device))
        hview.fill_(0xAB)
        src_before, dst_before = dbuf.cpu(), hview.clone()
        engine.submit_backup(p.part, layer, d_pages, h_pages).wait()
        assert torch.equal(hview[h_pages], src_before[d_pages]), (engine.name, p.part, n)
        untouched = np.setdiff1d(np.arange(host.physical_pages), h_pages)
        assert torch.equal(hview[untouched], dst_before[untouched])
        assert torch.equal(dbuf.cpu(), src_before)
        # Load.
        hview.copy_(torch.randint(0, 256, hview.shape, dtype=torch.uint8))
        dbuf.fill_(0xCD)
        src_before, dst_before = hview.clone(), dbuf.cpu()
        t = engine.submit_load(p.part, layer, h_pages, d_pages)
        t.make_compute_wait()
        after = dbuf.cpu()  # ordered after the load by make_compute_wait
        assert t.query() is TicketState.DONE
        assert torch.equal(after[d_pages], src_before[h_pages]), (engine.name, p.part, n)
        untouched = np.setdiff1d(np.arange(dev.physical_pages), d_pages)
        assert torch.equal(after[untouched], dst_before[untouched])
        assert torch.equal(hview, src_before)


@gpu
@needs_cuda
@pytest.mark.parametrize("name", CUDA_BACKENDS)
@pytest.mark.parametrize("n", [1, 7, 64, 1000])
def test_cuda_backend_copies_exact_bytes(cuda_pools, name: str, n: int) -> None:
    layout, dev, host = cuda_pools
    engine = make_engine(name, dev, host)
    try:
        _check_roundtrip(engine, layout, dev, host, np.random.default_rng(n), n)
    finally:
        engine.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("name", CUDA_BACKENDS)
def test_cuda_backend_odd_page_sizes(name: str) -> None:
    # 1036 B pages: 4-byte vectors; 13 B pages: byte copies.
    for bpt in (259, 13):
        layout = KVLayout.build(page_size=4, num_layers=2, kv_bytes_per_token=bpt) if bpt != 13 else \
            KVLayout.build(page_size=1, num_layers=2, kv_bytes_per_token=bpt)
        dev = DevicePool(layout, 300, device="cuda")
        with HostPool(layout, 400 * layout.bytes_per_page, pin=True) as host:
            host.wait_ready()
            engine = make_engine(name, dev, host)
            try:
                for n in (1, 64, 250):
                    _check_roundtrip(engine, layout, dev, host, np.random.default_rng(n), n)
            finally:
                engine.close()


@gpu
@needs_cuda
def test_auto_picks_a_cuda_backend(cuda_pools) -> None:
    _, dev, host = cuda_pools
    engine = make_engine("auto", dev, host)
    assert engine.name in CUDA_BACKENDS
    engine.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("name", CUDA_BACKENDS)
def test_cuda_out_of_range_pages_rejected(cuda_pools, name: str) -> None:
    _, dev, host = cuda_pools
    engine = make_engine(name, dev, host)
    try:
        with pytest.raises(ValueError, match="outside the pool"):
            engine.submit_backup(Part.TARGET_KV, 0, np.array([dev.physical_pages]), np.array([1]))
        with pytest.raises(ValueError, match="outside the pool"):
            engine.submit_load(Part.TARGET_KV, 0, np.array([-1]), np.array([1]))
        empty = engine.submit_backup(Part.TARGET_KV, 0, np.empty(0, np.int64), np.empty(0, np.int64))
        assert empty.query() is TicketState.DONE
    finally:
        engine.close()


@gpu
@needs_cuda
def test_cuda_submission_failure_gives_failed_ticket(cuda_pools, monkeypatch) -> None:
    _, dev, host = cuda_pools
    engine = make_engine("kernel", dev, host)

    def boom(*args, **kwargs):
        raise RuntimeError("injected launch failure")

    monkeypatch.setattr(engine.kernels, "launch", boom)
    try:
        t = engine.submit_backup(Part.TARGET_KV, 0, np.array([1, 2]), np.array([3, 4]))
        assert t.query() is TicketState.FAILED
        with pytest.raises(CopyFailed, match="injected"):
            t.wait()
        with pytest.raises(CopyFailed):
            t.make_compute_wait()
    finally:
        engine.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("name", CUDA_BACKENDS)
def test_backup_sees_compute_written_right_before(cuda_pools, name: str) -> None:
    """Compute writes a layer after a long matmul; the backup submitted right
    after must copy the new bytes (the copy stream waits on compute)."""
    layout, dev, host = cuda_pools
    engine = make_engine(name, dev, host)
    rng = np.random.default_rng(7)
    try:
        for value in (0x11, 0x77):
            d_pages, h_pages = random_pairs(rng, 300, dev.physical_pages, host.physical_pages)
            hview = host.torch_view(Part.TARGET_KV)[0]
            hview.fill_(0)
            a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
            for _ in range(8):  # tens of ms of compute queued before the write
                a = a @ a
                a = a / a.abs().amax().clamp(min=1)
            dev.buffer(Part.TARGET_KV)[0].fill_(value)
            t = engine.submit_backup(Part.TARGET_KV, 0, d_pages, h_pages)
            t.wait()
            assert bool((hview[h_pages] == value).all()), (name, value)
    finally:
        engine.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("name", CUDA_BACKENDS)
def test_loads_overlap_per_layer(cuda_pools, name: str) -> None:
    """Loads of all layers submitted up front; the forward waits per layer and
    reads each layer's new bytes."""
    layout, dev, host = cuda_pools
    engine = make_engine(name, dev, host)
    rng = np.random.default_rng(3)
    p = layout.part(Part.TARGET_KV)
    try:
        d_pages, h_pages = random_pairs(rng, 500, dev.physical_pages, host.physical_pages)
        for layer in p.layer_ids:
            host.torch_view(Part.TARGET_KV)[p.slot(layer)].fill_(layer + 1)
            dev.buffer(Part.TARGET_KV)[p.slot(layer)].fill_(0)
        tickets = [engine.submit_load(Part.TARGET_KV, layer, h_pages, d_pages) for layer in p.layer_ids]
        idx = torch.from_numpy(d_pages).cuda()
        sums = []
        for layer, t in zip(p.layer_ids, tickets):
            t.make_compute_wait()
            sums.append(dev.buffer(Part.TARGET_KV)[p.slot(layer)].index_select(0, idx).to(torch.int64).sum())
        expect = [(layer + 1) * len(d_pages) * p.page_bytes for layer in p.layer_ids]
        assert [int(s) for s in sums] == expect
    finally:
        engine.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("name", CUDA_BACKENDS)
def test_submissions_take_events_from_the_pool_filled_at_start_up(cuda_pools, name: str, monkeypatch) -> None:
    """`RESERVED_OPS` planned ops of every layer each way, their tickets all held,
    create no event on the submitting thread: a `cuEventCreate` there takes the
    driver lock an issue worker may hold."""
    from hicache_cp.io import cuda as cuda_io

    layout, dev, host = cuda_pools
    engine = make_engine(name, dev, host)
    created: list[int] = []
    create = engine._drv.event_create
    me = threading.get_ident()  # events the issue workers create are theirs, not the submitter's
    monkeypatch.setattr(engine._drv, "event_create", lambda: (threading.get_ident() == me and created.append(1)) or create())
    rng = np.random.default_rng(11)
    try:
        tickets = []
        for direction in Direction:
            for _ in range(cuda_io.RESERVED_OPS):
                d_pages, h_pages = random_pairs(rng, 64, dev.physical_pages, host.physical_pages)
                plan = engine.plan(direction, d_pages, h_pages)
                for layer in range(layout.num_target_layers):
                    parts = tuple(p.part for p in layout.parts if layer in p.layer_ids)
                    tickets += engine.submit_layer(plan, parts, layer)
        for t in tickets:
            if t is not None:
                t.wait()
        assert not created, f"{name}: {len(created)} events created while submitting {len(tickets)} layers"
    finally:
        engine.close()


def test_the_event_pool_is_filled_before_the_first_submission() -> None:
    from hicache_cp.io.cuda import reserved_events
    from hicache_cp.io.engine_sync import EngineSync

    made = iter(range(1, 10_000))

    class Events:
        def event_create(self) -> int:
            return next(made)

    sync = EngineSync(Events(), 0, 0)  # type: ignore[arg-type]
    n = reserved_events(small_layout())
    sync.reserve(n)
    taken = {sync.event() for _ in range(n)}
    assert taken == set(range(1, n + 1))  # every one from the reserve, none created on the way
    assert sync.event() == n + 1  # an empty pool still creates


@given(
    runs=st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 3000)), min_size=1, max_size=20),
    chunk=st.sampled_from([256, 1000, 1024, 4096]),
)
def test_split_at_chunks_covers_every_byte_and_never_crosses(runs: list[tuple[int, int]], chunk: int) -> None:
    """Runs cut at the arena's registration chunks: same bytes, same pairing, no piece crosses."""
    from hicache_cp.io.cuda import split_at_chunks

    host = np.array([h for h, _ in runs], dtype=np.int64)
    sizes = np.array([n for _, n in runs], dtype=np.int64)
    other = np.cumsum(np.concatenate([[0], sizes[:-1]])) + 10**6  # distinct device ranges
    h, o, n = split_at_chunks(host, other, sizes, chunk)
    assert (n > 0).all() and n.sum() == sizes.sum()
    assert ((h // chunk) == ((h + n - 1) // chunk)).all()
    want = {(int(a) + k, int(b) + k) for a, b, s in zip(host, other, sizes) for k in range(int(s))}
    got = {(int(a) + k, int(b) + k) for a, b, s in zip(h, o, n) for k in range(int(s))}
    assert got == want


# -- per-layer device buffers (an engine's own KV tensors) ----------------------------------


def test_device_pool_takes_one_engine_tensor_per_layer() -> None:
    """An engine that allocates every layer separately, in its own dtype and
    shape (page-major), hands those tensors in: copies land in them, and the
    bytes outside the copied pages stay as they were."""
    layout = small_layout()
    pages = 16
    own = {
        p.part: [torch.zeros((pages, p.page_bytes // 2), dtype=torch.bfloat16) for _ in p.layer_ids]
        for p in layout.parts
    }
    dev = DevicePool(layout, pages, buffers=own)
    rng = np.random.default_rng(0)
    with HostPool(layout, 20 * layout.bytes_per_page, pin=False) as host:
        engine = make_engine("cpu", dev, host)
        try:
            for p in layout.parts:
                for layer in p.layer_ids:
                    slot = p.slot(layer)
                    hview = host.layer_view(p.part, slot)
                    hview[:] = rng.integers(0, 256, hview.shape, dtype=np.uint8)
                    d_pages, h_pages = random_pairs(rng, 5, pages, host.physical_pages)
                    engine.submit_load(p.part, layer, h_pages, d_pages).wait()
                    got = own[p.part][slot].view(torch.uint8).numpy()  # the engine's tensor itself
                    np.testing.assert_array_equal(got[d_pages], hview[h_pages])
                    untouched = np.setdiff1d(np.arange(pages), d_pages)
                    assert not got[untouched].any()
                    assert dev.layer_ptr(p.part, slot) == own[p.part][slot].data_ptr()
        finally:
            engine.close()


def test_device_pool_rejects_layer_tensors_of_the_wrong_size() -> None:
    layout = small_layout()
    bad = {p.part: [torch.zeros((8, p.page_bytes + 2), dtype=torch.uint8) for _ in p.layer_ids] for p in layout.parts}
    with pytest.raises(ValueError, match="expected 8 pages"):
        DevicePool(layout, 8, buffers=bad)
    short = {p.part: [torch.zeros((8, p.page_bytes), dtype=torch.uint8)] for p in layout.parts}
    with pytest.raises(ValueError, match="layer buffers given"):
        DevicePool(layout, 8, buffers=short)


# -- bounded host cost: DMA plans and the worker-issued direct backend ----------------------------


@given(
    pairs=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), min_size=0, max_size=40, unique_by=(lambda x: x[0], lambda x: x[1])),
    page_bytes=st.sampled_from([16, 48, 1040]),
    chunk_pages=st.sampled_from([1, 3, 7, 64]),
    slot=st.integers(0, 2),
)
def test_dma_plan_moves_every_page_once_and_never_crosses_a_chunk(
    pairs: list[tuple[int, int]], page_bytes: int, chunk_pages: int, slot: int
) -> None:
    """The direct backend's descriptors: each (device page, host page) pair's bytes
    exactly once, no host range crossing a registration chunk, and never more
    descriptors than pages (plus one per chunk boundary crossed)."""
    from hicache_cp.io.runs import dma_plan

    dev = np.array([d for d, _ in pairs], dtype=np.int64)
    host = np.array([h for _, h in pairs], dtype=np.int64)
    chunk = chunk_pages * page_bytes + 16 * (chunk_pages % 2)  # chunks not aligned to pages too
    dev_base, host_base, host_pages = 1 << 40, 1 << 44, 64
    layer_off = slot * host_pages * page_bytes
    d_addr, h_addr, sizes = dma_plan(dev, host, page_bytes, dev_base, host_base, layer_off, chunk)
    assert d_addr.dtype == h_addr.dtype == sizes.dtype == np.uint64
    assert (sizes > 0).all() and int(sizes.sum()) == len(pairs) * page_bytes
    off = h_addr.astype(np.int64) - host_base
    assert ((off // chunk) == ((off + sizes.astype(np.int64) - 1) // chunk)).all()
    got = {(int(a) + k, int(b) + k) for a, b, n in zip(d_addr, h_addr, sizes) for k in range(0, int(n), 8)}
    want = {
        (dev_base + d * page_bytes + k, host_base + layer_off + h * page_bytes + k)
        for d, h in pairs for k in range(0, page_bytes, 8)
    }
    assert got == want
    crossings = sum(((layer_off + h * page_bytes) // chunk) != ((layer_off + (h + 1) * page_bytes - 1) // chunk) for _, h in pairs)
    assert len(sizes) <= len(pairs) + crossings


@given(
    runs=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), min_size=1, max_size=12),
    limit=st.integers(1, 8),
    chunk_pages=st.sampled_from([1, 3, 64]),
)
def test_few_run_plan_matches_the_general_plan(runs: list[tuple[int, int]], limit: int, chunk_pages: int) -> None:
    """The hybrid backend's cheap path (`run_starts` + `plan_runs`) gives the
    descriptors of `dma_plan` (in another order where runs are cut at chunks)
    when a copy has at most `limit` runs, and declines (None) exactly when it
    has more."""
    from hicache_cp.io.runs import coalesce_in_order, dma_plan, plan_runs, run_starts

    dev, host, d, h = [], [], 1, 1000
    for gap, length in runs:  # gap 0 continues the previous run on both sides
        d, h = d + 2 * gap, h + 3 * gap
        dev += range(d, d + length)
        host += range(h, h + length)
        d, h = d + length, h + length
    dev_a, host_a = np.array(dev, dtype=np.int64), np.array(host, dtype=np.int64)
    true_runs = len(coalesce_in_order(dev_a, host_a)[2])
    starts = run_starts(dev_a, host_a, limit)
    assert (starts is None) == (true_runs > limit)
    if starts is not None:
        page_bytes = 48
        chunk = chunk_pages * page_bytes + 16
        got = plan_runs(dev_a, host_a, starts, page_bytes, 1 << 40, 1 << 44, 5 * page_bytes, chunk)
        want = dma_plan(dev_a, host_a, page_bytes, 1 << 40, 1 << 44, 5 * page_bytes, chunk)
        assert sorted(zip(*got)) == sorted(zip(*(a.tolist() for a in want)))  # same descriptors, any order


def test_coalesce_in_order_merges_neighbours_only() -> None:
    from hicache_cp.io.runs import coalesce_in_order

    d0, h0, n = coalesce_in_order(np.array([3, 4, 5, 9, 10, 2]), np.array([7, 8, 20, 21, 22, 1]))
    # (3,7)(4,8) is a run; (5,20) breaks on the host side, (9,21) on the device side,
    # (9,21)(10,22) is a run, (2,1) breaks on both. Pairs are never reordered.
    assert d0.tolist() == [3, 5, 9, 2] and h0.tolist() == [7, 20, 21, 1] and n.tolist() == [2, 1, 2, 1]


@pytest.fixture(scope="module")
def big_cuda_pools():
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    layout = KVLayout.build(page_size=4, num_layers=2, kv_bytes_per_token=260)  # 1040 B pages
    dev = DevicePool(layout, 9000, device="cuda")
    host = HostPool(layout, 9000 * layout.bytes_per_page, pin=True)
    host.wait_ready()
    yield layout, dev, host
    host.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("name", CUDA_BACKENDS)
def test_cuda_backend_many_pages_exact_bytes(big_cuda_pools, name: str) -> None:
    """More pages than one kernel launch takes (kernels.LARGE_PAGES) and than one
    batch of small copies: several launches / descriptors, same byte contract."""

    layout, dev, host = big_cuda_pools
    engine = make_engine(name, dev, host)
    try:
        _check_roundtrip(engine, layout, dev, host, np.random.default_rng(11), 2 * kernels.LARGE_PAGES + 17)
    finally:
        engine.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["simt", "l2hint", "tma"])
def test_kernel_modes_copy_exact_bytes(cuda_pools, mode: str) -> None:
    """Every way the kernel moves bytes (SM loads, loads with an L2 fetch hint,
    the bulk-copy unit) keeps the byte contract; the 48 B state pages (16-byte
    multiples) take the same mode, odd sizes fall back to simt (checked below)."""
    layout, dev, host = cuda_pools
    engine = make_engine("kernel", dev, host, mode=mode, dma_runs=0)
    try:
        for n in (1, 64, 300, 1000):
            _check_roundtrip(engine, layout, dev, host, np.random.default_rng(n + 100), n)
    finally:
        engine.close()


@gpu
@needs_cuda
@pytest.mark.parametrize(("unroll", "tail"), [(1, "loop"), (8, "pred"), (16, "loop")])
def test_kernel_shapes_copy_exact_bytes(cuda_pools, unroll: int, tail: str) -> None:
    """The simt kernel's other shapes (loads in flight per thread, an unrolled
    last pass) keep the byte contract, the remainder pass included."""
    layout, dev, host = cuda_pools
    engine = make_engine("kernel", dev, host, unroll=unroll, tail=tail)
    try:
        for n in (1, 7, 300, 1000):
            _check_roundtrip(engine, layout, dev, host, np.random.default_rng(n + unroll), n)
    finally:
        engine.close()


def test_kernel_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="tail"):
        kernels.check_shape(4, "sideways")
    with pytest.raises(ValueError):
        kernels.check_shape(0, "loop")


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["l2hint", "tma"])
def test_kernel_modes_fall_back_on_odd_page_sizes(mode: str) -> None:
    layout = KVLayout.build(page_size=4, num_layers=2, kv_bytes_per_token=259)  # 1036 B pages: not 16-byte multiples
    dev = DevicePool(layout, 300, device="cuda")
    with HostPool(layout, 400 * layout.bytes_per_page, pin=True) as host:
        host.wait_ready()
        engine = make_engine("kernel", dev, host, mode=mode, dma_runs=0)
        try:
            _check_roundtrip(engine, layout, dev, host, np.random.default_rng(9), 250)
        finally:
            engine.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["simt", "tma"])
def test_kernel_many_pages_take_the_device_id_array(big_cuda_pools, mode: str) -> None:
    """Past kernels.LARGE_PAGES the ids travel through the launcher's device
    array: several copies in a row, each of a different size, exact bytes."""
    from hicache_cp.io import kernels

    layout, dev, host = big_cuda_pools
    engine = make_engine("kernel", dev, host, mode=mode, dma_runs=0)
    try:
        for n in (kernels.LARGE_PAGES + 1, 3 * kernels.LARGE_PAGES + 5, kernels.LARGE_PAGES + 100):
            _check_roundtrip(engine, layout, dev, host, np.random.default_rng(n), n)
    finally:
        engine.close()


@gpu
@needs_cuda
def test_kernel_dma_runs_routes_coalesced_copies_to_dma(big_cuda_pools) -> None:
    """With dma_runs=4 a copy of 3 runs (consecutive on both sides) goes to the
    DMA engines and a scattered one to the kernel; both exact."""
    layout, dev, host = big_cuda_pools
    engine = make_engine("kernel", dev, host, dma_runs=4)
    p = layout.part(Part.TARGET_KV)
    try:
        runs = [(10, 500, 40), (200, 90, 25), (3000, 7000, 60)]  # (device start, host start, length)
        d_pages = np.concatenate([np.arange(a, a + k) for a, _, k in runs])
        h_pages = np.concatenate([np.arange(b, b + k) for _, b, k in runs])
        dbuf, hview = dev.buffer(Part.TARGET_KV)[0], host.torch_view(Part.TARGET_KV)[0]
        dbuf.copy_(torch.randint(0, 256, dbuf.shape, dtype=torch.uint8, device=dbuf.device))
        hview.fill_(0)
        engine.submit_backup(Part.TARGET_KV, p.layer_ids[0], d_pages, h_pages).wait()
        assert engine.counts == {"kernel": 0, "dma": 1}
        assert torch.equal(hview[h_pages], dbuf.cpu()[d_pages])
        untouched = np.setdiff1d(np.arange(host.physical_pages), h_pages)
        assert not hview[untouched].any()
        scattered_d, scattered_h = random_pairs(np.random.default_rng(4), 50, dev.physical_pages, host.physical_pages)
        engine.submit_load(Part.TARGET_KV, p.layer_ids[0], scattered_h, scattered_d).wait()
        assert engine.counts == {"kernel": 1, "dma": 1}
        assert torch.equal(dbuf.cpu()[scattered_d], hview[scattered_h])
    finally:
        engine.close()


@gpu
@needs_cuda
def test_submit_host_time_does_not_grow_with_pages(big_cuda_pools) -> None:
    """One layer's kernel submission costs the caller's thread about the same
    for 16 and for 8000 scattered pages (bench-io measures the absolute numbers)."""
    import time

    layout, dev, host = big_cuda_pools
    engine = make_engine("kernel", dev, host)
    rng = np.random.default_rng(2)
    try:
        med = {}
        for n in (16, 8000):
            d_pages, h_pages = random_pairs(rng, n, dev.physical_pages, host.physical_pages)
            times = []
            for i in range(25):
                t0 = time.perf_counter()
                t = engine.submit_backup(Part.TARGET_KV, i % 2, d_pages, h_pages)
                times.append(time.perf_counter() - t0)
            t.wait()
            med[n] = float(np.median(times[5:]))
        assert med[8000] < max(4 * med[16], 200e-6), med
    finally:
        engine.close()
