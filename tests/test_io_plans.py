"""Planned copies: one op's pages planned once, submitted layer by layer (issue 28).

CPU: a `DescriptorTable` gives, for every layer and part set, exactly the
descriptors `layer_descriptors` computes for that layer alone (so the table's
offset arithmetic and its chunk cuts are right), every page's bytes once and
no range across a registration chunk; past its size cap it is not built and
still answers the same. The engine contract of `plan` + `submit_layer` on the
cpu backend: exact bytes for every part, one ticket per part, None for an
empty plan, and bad page lists refused at planning.

GPU (marked `gpu`): every CUDA backend's planned path moves exact bytes for
all parts of a layer at once (both directions, bytes outside untouched), the
parts' tickets complete together, the forward waits on a planned load, and a
driver failure turns every part's ticket FAILED.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_harness.bench.io_variants import register_bench_backends
from hicache_cp.io.base import CopyFailed, Direction, TicketState, make_engine
from hicache_cp.io.plans import DescriptorTable, PartGeometry, Runs, TableShape, layer_descriptors
from hicache_cp.layout import KVLayout, Model, Part
from hicache_cp.pools import DevicePool, HostPool

HAS_CUDA = torch.cuda.is_available()
register_bench_backends()  # the benchmark-only engines are tested too
CUDA_BACKENDS = ("direct", "hybrid", "kernel", "staging")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def layout_with_skip(bpt: int = 40) -> KVLayout:
    # State on layers 1 and 3 only: layers 0 and 2 have one part, 1 and 3 two.
    return KVLayout.build(page_size=4, num_layers=4, kv_bytes_per_token=bpt, state_bytes_per_token=12, state_layers=(1, 3))


def layout_with_draft() -> KVLayout:
    """`layout_with_skip` plus a draft model of other page sizes whose layer 0 has one part
    and layer 1 two: the table's groups (rows of equal part counts) mix both models."""
    return KVLayout.build(page_size=4, num_layers=4, kv_bytes_per_token=40, state_bytes_per_token=12, state_layers=(1, 3),
                          draft_layers=2, draft_kv_bytes_per_token=24, draft_state_bytes_per_token=8,
                          draft_state_layers=(1,))  # fmt: skip


def table_layers(layout: KVLayout) -> list[tuple[int, tuple[Part, ...]]]:
    return [
        (layer, tuple(p.part for p in layout.parts_of(m) if p.has_layer(layer)))
        for m in (Model.TARGET, Model.DRAFT)
        for layer in range(layout.num_layers(m))
    ]


def geometries(layout: KVLayout, host_pages: int, chunk: int | list[int]) -> list[PartGeometry]:
    """Every part's geometry; `chunk`: the registration chunk of all arenas, or of each."""
    chunks = chunk if isinstance(chunk, list) else [chunk] * len(layout.parts)
    out, host_base = [], 1 << 44
    for i, p in enumerate(layout.parts):
        dev_layers = tuple((1 << 40) + (i << 32) + s * (1 << 24) for s in range(p.num_slots))
        out.append(PartGeometry(p.part, p.page_bytes, {layer: p.slot(layer) for layer in p.layer_ids}, dev_layers,
                                host_base + (i << 36), host_pages * p.page_bytes, chunks[i]))
    return out


def expand(desc) -> set[tuple[int, int]]:
    """Every (dst byte, src byte) pair a layer's descriptors move, at 4-byte steps."""
    return {(int(d) + k, int(s) + k) for d, s, n in zip(desc.dst, desc.src, desc.sizes) for k in range(0, int(n), 4)}


@settings(max_examples=60, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=30,
                   unique_by=(lambda x: x[0], lambda x: x[1])),
    chunk=st.one_of(st.sampled_from([160, 1000, 4096, 1 << 30]),
                    st.lists(st.sampled_from([160, 1000, 4096, 1 << 30]), min_size=4, max_size=4)),  # 4 parts
    d2h=st.booleans(),
    cap=st.sampled_from([0, 10**6]),
)
def test_table_rows_equal_the_per_layer_descriptors(pairs, chunk: int | list[int], d2h: bool, cap: int) -> None:
    """Also with arenas of different registration chunks (a list: one per part), and
    with rows of both models in one group."""
    layout = layout_with_draft()
    dev = np.array([d for d, _ in pairs], np.int64)
    host = np.array([h for _, h in pairs], np.int64)
    geoms = geometries(layout, 48, chunk)
    runs = Runs.of(dev, host)
    table = DescriptorTable(d2h, TableShape(geoms, table_layers(layout)), runs, max_descriptors=cap)
    assert table.tabulated is (cap > 0)
    by_part = {g.part: g for g in geoms}
    for layer, parts in table_layers(layout):
        got = table.get(parts, layer)
        want = layer_descriptors(d2h, [by_part[p] for p in parts], runs, layer)
        assert expand(got) == expand(want), (layer, parts)
        assert got.dst.dtype == got.src.dtype == got.sizes.dtype == np.uint64
        assert got.dst.flags.c_contiguous and got.src.flags.c_contiguous and got.sizes.flags.c_contiguous
        assert got.dst.ctypes.data == got.dst_ptr and got.src.ctypes.data == got.src_ptr
        assert got.sizes.ctypes.data == got.sizes_ptr and got.count == len(got.sizes)
        # Every page of every part exactly once; no host range across a chunk.
        assert int(got.sizes.sum()) == sum(len(pairs) * by_part[p].page_bytes for p in parts)
        host_addr = got.dst if d2h else got.src
        for p in parts:
            g = by_part[p]
            lo = g.host_base
            mine = (host_addr >= lo) & (host_addr < lo + (1 << 36))
            off = host_addr[mine].astype(np.int64) - lo
            n = got.sizes[mine].astype(np.int64)
            assert ((off // g.chunk) == ((off + n - 1) // g.chunk)).all()
            slot = g.slots[layer]
            want_pairs = {
                (g.device_layers[slot] + d * g.page_bytes + k, lo + g.host_offset(slot) + h * g.page_bytes + k)
                for d, h in pairs for k in range(0, g.page_bytes, 4)
            }
            dev_addr = got.src if d2h else got.dst
            moved = {
                (int(a) + k, int(b) + k)
                for a, b, s in zip(dev_addr[mine], host_addr[mine], got.sizes[mine]) for k in range(0, int(s), 4)
            }
            assert moved == want_pairs, (layer, p)


def test_table_asked_for_other_parts_computes_that_layer() -> None:
    layout = layout_with_skip()
    geoms = geometries(layout, 48, 1 << 30)
    runs = Runs.of(np.array([3, 4, 9]), np.array([7, 8, 2]))
    table = DescriptorTable(True, TableShape(geoms, table_layers(layout)), runs)
    only_kv = table.get((Part.TARGET_KV,), 1)  # the table holds layer 1 with both target parts
    both = table.get((Part.TARGET_KV, Part.TARGET_STATE), 1)
    assert only_kv.count == 2 and both.count == 4
    assert expand(only_kv) < expand(both)


def test_a_run_of_consecutive_layers_is_one_block_of_table_rows() -> None:
    """`span`: the layers of a run, each the next row of one group, as one block (what the
    layer hook issues in one driver call); None where the rows are not one block."""
    layout = KVLayout.build(page_size=4, num_layers=5, kv_bytes_per_token=40, state_bytes_per_token=12)
    runs = Runs.of(np.array([3, 4, 9, 20]), np.array([7, 8, 2, 30]))
    both = (Part.TARGET_KV, Part.TARGET_STATE)
    table = DescriptorTable(True, TableShape(geometries(layout, 48, 1 << 30), table_layers(layout)), runs)
    jobs = [(both, layer) for layer in (1, 2, 3)]
    span = table.span(jobs)
    rows = [table.get(parts, layer) for parts, layer in jobs]
    assert span is not None and span.count == sum(r.count for r in rows) == 3 * 2 * len(runs)
    for got, want in ((span.dst, [r.dst for r in rows]), (span.src, [r.src for r in rows]), (span.sizes, [r.sizes for r in rows])):
        assert np.array_equal(got, np.concatenate(want)) and got.flags.c_contiguous
    assert (span.dst_ptr, span.src_ptr, span.sizes_ptr) == (rows[0].dst_ptr, rows[0].src_ptr, rows[0].sizes_ptr)
    assert (span.dst.ctypes.data, span.sizes.ctypes.data) == (span.dst_ptr, span.sizes_ptr)
    assert table.span([(both, 1), (both, 3)]) is None  # a gap
    assert table.span([(both, 2), (both, 1)]) is None  # out of order
    assert table.span([((Part.TARGET_KV,), 1), ((Part.TARGET_KV,), 2)]) is None  # parts the table does not hold
    skip = layout_with_skip()  # layers 0 and 2 have one part, 1 and 3 two: other groups
    table = DescriptorTable(True, TableShape(geometries(skip, 48, 1 << 30), table_layers(skip)), runs)
    assert table.span([((Part.TARGET_KV,), 0), (both, 1)]) is None
    crossing = DescriptorTable(True, TableShape(geometries(layout, 48, 1000), table_layers(layout)), runs)
    cut = [layer for layer in range(5) if crossing.get(both, layer).count > 2 * len(runs)]
    assert cut, "a 1,000-byte chunk cuts some layer's runs"
    assert crossing.span([(both, layer) for layer in range(5)]) is None  # those layers keep their own arrays
    assert DescriptorTable(True, TableShape(geometries(layout, 48, 1 << 30), table_layers(layout)), runs, 0).span(jobs) is None


@pytest.fixture
def cpu_pools():
    layout = layout_with_skip()
    dev = DevicePool(layout, 30)
    with HostPool(layout, 40 * layout.bytes_per_page, pin=False) as host:
        yield layout, dev, host


def test_cpu_planned_layer_copies_every_part(cpu_pools) -> None:
    layout, dev, host = cpu_pools
    rng = np.random.default_rng(5)
    engine = make_engine("cpu", dev, host)
    try:
        d_pages = rng.choice(np.arange(1, 30), 9, replace=False)
        h_pages = rng.choice(np.arange(1, 40), 9, replace=False)
        parts = (Part.TARGET_KV, Part.TARGET_STATE)
        for p in parts:
            dev.layer_view(p, layout.part(p).slot(1))[:] = rng.integers(0, 256, dev.layer_view(p, 0).shape, dtype=np.uint8)
        plan = engine.plan(Direction.D2H, d_pages, h_pages)
        tickets = engine.submit_layer(plan, parts, 1)
        assert len(tickets) == 2 and [t.part for t in tickets] == list(parts)
        for t, p in zip(tickets, parts):
            t.wait()
            assert t.nbytes == 9 * layout.part(p).page_bytes
            slot = layout.part(p).slot(1)
            np.testing.assert_array_equal(host.layer_view(p, slot)[h_pages], dev.layer_view(p, slot)[d_pages])
        empty = engine.plan(Direction.H2D, np.empty(0, np.int64), np.empty(0, np.int64))
        assert engine.submit_layer(empty, parts, 1) == [None, None]
        with pytest.raises(ValueError, match="never truncated"):
            engine.plan(Direction.D2H, d_pages, h_pages[:-1])
        with pytest.raises(TypeError):
            engine.plan(Direction.D2H, list(d_pages), h_pages)  # type: ignore[arg-type]
    finally:
        engine.close()


# -- CUDA ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_pools():
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    layout = layout_with_skip(260)  # 1040 B kv pages, 48 B state pages
    dev = DevicePool(layout, 1200, device="cuda")
    host = HostPool(layout, 1500 * layout.bytes_per_page, pin=True)
    host.wait_ready()
    yield layout, dev, host
    host.close()


def _injected_failure(*args, **kwargs):
    raise RuntimeError("injected DMA failure")


def _pattern(rng: np.random.Generator, n: int, runs: bool, dev_pages: int, host_pages: int) -> tuple[np.ndarray, np.ndarray]:
    if runs:  # a few runs consecutive on both sides, as the allocators hand out
        d0, h0 = int(rng.integers(1, dev_pages - n)), int(rng.integers(1, host_pages - n))
        half = n // 2
        dev = np.concatenate([np.arange(d0, d0 + half), np.arange(d0 + half + 3, d0 + n + 3)])[:n]
        host = np.concatenate([np.arange(h0, h0 + half), np.arange(h0 + half + 5, h0 + n + 5)])[:n]
        keep = (dev < dev_pages) & (host < host_pages)
        return dev[keep].astype(np.int64), host[keep].astype(np.int64)
    dev = rng.choice(np.arange(1, dev_pages), n, replace=False).astype(np.int64)
    host = rng.choice(np.arange(1, host_pages), n, replace=False).astype(np.int64)
    return dev, host


@gpu
@needs_cuda
@pytest.mark.parametrize("name", CUDA_BACKENDS)
@pytest.mark.parametrize("runs", [False, True], ids=["scattered", "runs"])
@pytest.mark.parametrize("n", [1, 64, 1000])
def test_cuda_planned_layer_exact_bytes(cuda_pools, name: str, runs: bool, n: int) -> None:
    layout, dev, host = cuda_pools
    rng = np.random.default_rng(n + runs)
    engine = make_engine(name, dev, host)
    parts = (Part.TARGET_KV, Part.TARGET_STATE)
    try:
        d_pages, h_pages = _pattern(rng, n, runs, dev.physical_pages, host.physical_pages)
        for layer in (1, 3):  # both own two parts; the table's rows for two slots each
            slots = {p: layout.part(p).slot(layer) for p in parts}
            for p in parts:
                buf = dev.buffer(p)[slots[p]]
                buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, device="cuda"))
                host.torch_view(p)[slots[p]].fill_(0xAB)
            src = {p: dev.buffer(p)[slots[p]].cpu() for p in parts}
            tickets = engine.submit_layer(engine.plan(Direction.D2H, d_pages, h_pages), parts, layer)
            tickets[-1].wait()
            assert all(t.query() is TicketState.DONE for t in tickets)
            for p in parts:
                hv = host.torch_view(p)[slots[p]]
                assert torch.equal(hv[h_pages], src[p][d_pages]), (name, p, layer)
                untouched = np.setdiff1d(np.arange(host.physical_pages), h_pages)
                assert bool((hv[untouched] == 0xAB).all())
            # Load back into other bytes: the forward waits on the planned load's tickets.
            for p in parts:
                dev.buffer(p)[slots[p]].fill_(0xCD)
                hv = host.torch_view(p)[slots[p]]
                hv.copy_(torch.randint(0, 256, hv.shape, dtype=torch.uint8))
            want = {p: host.torch_view(p)[slots[p]].clone() for p in parts}
            loads = engine.submit_layer(engine.plan(Direction.H2D, d_pages, h_pages), parts, layer)
            for t in loads:
                t.make_compute_wait()
            for p in parts:
                after = dev.buffer(p)[slots[p]].cpu()
                assert torch.equal(after[d_pages], want[p][h_pages]), (name, p, layer)
                untouched = np.setdiff1d(np.arange(dev.physical_pages), d_pages)
                assert bool((after[untouched] == 0xCD).all())
    finally:
        engine.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("hook_worker_above", [16, 0], ids=["inline", "worker"])
def test_cuda_planned_failure_fails_every_part(cuda_pools, monkeypatch, hook_worker_above: int) -> None:
    """A layer hook's failed driver call fails the tickets of every part of the layer,
    issued in the hook (at once) or by the issue worker (once it has tried)."""
    layout, dev, host = cuda_pools
    engine = make_engine("direct", dev, host, hook_worker_above=hook_worker_above)

    try:
        plan = engine.plan(Direction.D2H, np.array([1, 2, 5]), np.array([3, 4, 9]))  # 2 runs x 2 parts
        if hook_worker_above:
            monkeypatch.setattr(engine._issuer, "issue_table_row", _injected_failure)
        else:
            monkeypatch.setattr(engine._drv, "memcpy_batch_ptrs", _injected_failure)
        tickets = engine.submit_layer(plan, (Part.TARGET_KV, Part.TARGET_STATE), 1)
        with pytest.raises(CopyFailed, match="injected"):
            tickets[1].wait()
        assert [t.query() for t in tickets] == [TicketState.FAILED, TicketState.FAILED]
        with pytest.raises(ValueError, match="outside the pool"):
            engine.plan(Direction.H2D, np.array([dev.physical_pages]), np.array([1]))
    finally:
        engine.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("runs", [True, False], ids=["runs", "scattered"])
def test_direct_op_of_every_layer_lands_whole(cuda_pools, runs: bool) -> None:
    """A load submits every layer at once (`submit_layers`): an op small per layer
    but large in all issues its first layer inline and gives the rest to the
    worker; an op large per layer gives every layer to it. Either way every
    layer of every part lands exact."""
    from hicache_cp.io.dma import DeferredTicket

    layout, dev, host = cuda_pools
    engine = make_engine("direct", dev, host, worker_above=4)
    rng = np.random.default_rng(7)
    jobs = [(parts, layer) for layer, parts in table_layers(layout)[: layout.num_layers(Model.TARGET)]]
    try:
        d_pages, h_pages = _pattern(rng, 16 if runs else 64, runs, dev.physical_pages, host.physical_pages)
        want = {}
        for parts, layer in jobs:
            for p in parts:
                slot = layout.part(p).slot(layer)
                dev.buffer(p)[slot].fill_(0xCD)
                hv = host.torch_view(p)[slot]
                hv.copy_(torch.randint(0, 256, hv.shape, dtype=torch.uint8))
                want[p, layer] = hv.clone()
        before = engine.counts["deferred"]
        tickets = engine.submit_layers(engine.plan(Direction.H2D, d_pages, h_pages), jobs)
        deferred = [isinstance(ts[0], DeferredTicket) for ts in tickets]
        assert deferred == ([False] + [True] * (len(jobs) - 1) if runs else [True] * len(jobs))
        assert engine.counts["deferred"] - before == sum(deferred)
        for ts in tickets:
            for t in ts:
                t.make_compute_wait()
        for parts, layer in jobs:
            for p in parts:
                after = dev.buffer(p)[layout.part(p).slot(layer)].cpu()
                assert torch.equal(after[d_pages], want[p, layer][h_pages]), (p, layer)
    finally:
        engine.close()


@gpu
@needs_cuda
def test_direct_op_whose_first_layer_fails_issues_nothing_after_it(cuda_pools, monkeypatch) -> None:
    layout, dev, host = cuda_pools
    engine = make_engine("direct", dev, host, worker_above=4)
    jobs = [(parts, layer) for layer, parts in table_layers(layout)[: layout.num_layers(Model.TARGET)]]

    try:
        plan = engine.plan(Direction.H2D, np.array([1, 2, 3]), np.array([3, 4, 5]))
        monkeypatch.setattr(engine._issuer, "issue_table_row", _injected_failure)
        tickets = engine.submit_layers(plan, jobs)
        assert all(t.query() is TicketState.FAILED for ts in tickets for t in ts)
        assert engine.counts["deferred"] == 0
        with pytest.raises(CopyFailed, match="injected"):
            tickets[-1][0].make_compute_wait()
    finally:
        engine.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("worker_above", [None, 0], ids=["inline", "worker"])
def test_the_parts_of_a_layer_make_a_stream_wait_once(cuda_pools, monkeypatch, worker_above: int | None) -> None:
    """The parts of a layer copied together share one completion: the forward asks each
    part's ticket to wait, the stream waits once (every wait is a driver call and GPU time),
    and another stream still gets its own wait."""
    layout, dev, host = cuda_pools
    engine = make_engine("direct", dev, host, worker_above=worker_above)
    layer, parts = next((layer, parts) for layer, parts in table_layers(layout) if len(parts) > 1)
    calls: list[int] = []
    drv = engine._drv
    real = drv.stream_wait_event
    copy_streams = set(engine._handle)  # their waits on compute are the submissions' own

    def counted(stream: int, event: int) -> None:
        if stream not in copy_streams:
            calls.append(stream)
        real(stream, event)

    monkeypatch.setattr(drv, "stream_wait_event", counted)
    try:
        tickets = engine.submit_layers(engine.plan(Direction.H2D, np.array([3, 4]), np.array([5, 9])), [(parts, layer)])[0]
        assert len(tickets) == len(parts) > 1
        for t in tickets:
            t.make_compute_wait()
        assert len(calls) == 1
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            for t in tickets:
                t.make_compute_wait()
        assert len(calls) == 2 and calls[1] == side.cuda_stream
        torch.cuda.synchronize()
        assert all(t.query() is TicketState.DONE for t in tickets)
    finally:
        engine.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("options", [{}, {"hook_worker_above": 16}], ids=["default", "hook16"])
def test_the_layer_hook_backs_up_what_compute_wrote_right_before(cuda_pools, monkeypatch, options: dict) -> None:
    """The layer hook's path (`submit_layer`, D2H) behind a long forward: each layer's
    backup holds the bytes compute wrote right before the hook, however the hook
    issues it (by default on the worker, its compute order recorded by the hook; with
    `hook_worker_above` 16 inline while the worker is idle)."""
    from hicache_cp.io.dma import DeferredTicket

    layout, dev, host = cuda_pools
    engine = make_engine("direct", dev, host, **options)
    rng = np.random.default_rng(11)
    caller, records = threading.get_ident(), []
    real_record = engine._drv.event_record

    def record(event: int, stream: int) -> None:
        if threading.get_ident() == caller:
            records.append(stream)
        real_record(event, stream)

    monkeypatch.setattr(engine._drv, "event_record", record)
    try:
        d_pages, h_pages = _pattern(rng, 12, True, dev.physical_pages, host.physical_pages)  # 2 runs
        plan = engine.plan(Direction.D2H, d_pages, h_pages)
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        tickets, hook_records = [], []
        for i, (layer, parts) in enumerate(table_layers(layout)):
            for p in parts:
                host.torch_view(p)[layout.part(p).slot(layer)].fill_(0)
            for _ in range(4):  # milliseconds of compute queued before the layer's write
                a = a @ a
                a = a / a.abs().amax().clamp(min=1)
            for p in parts:
                dev.buffer(p)[layout.part(p).slot(layer)].fill_(0x20 + i)
            before = len(records)
            tickets.append(engine.submit_layer(plan, parts, layer))
            hook_records.append(len(records) - before)
        inline = options.get("hook_worker_above", 0) > 0  # 2 runs x at most 2 parts: never deferred
        assert all(isinstance(ts[0], DeferredTicket) is not inline for ts in tickets)
        # The hook's driver calls that record: the order and done events inline, the order
        # event alone when the worker issues.
        assert hook_records == [2 if inline else 1] * len(tickets)
        for ts in tickets:
            for t in ts:
                t.wait()
        for i, (layer, parts) in enumerate(table_layers(layout)):
            for p in parts:
                got = host.torch_view(p)[layout.part(p).slot(layer)][h_pages]
                assert bool((got == 0x20 + i).all()), (options, p, layer)
    finally:
        engine.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("span_inline", [64, 0], ids=["one-call", "worker"])
def test_a_hook_run_of_layers_is_one_driver_call_behind_compute_and_lands_whole(monkeypatch, span_inline: int) -> None:
    """A backup's run of layers from the layer hook (`submit_layers`, D2H): small in all, it
    is issued by the caller as one driver call for every layer and part (none deferred),
    behind the compute queued before it; with `hook_span_inline` 0 it goes to the worker.
    Either way every byte the forward wrote right before lands."""
    from hicache_cp.io.cuda import SharedTicket

    layout = KVLayout.build(page_size=4, num_layers=6, kv_bytes_per_token=260, state_bytes_per_token=12)
    both = (Part.TARGET_KV, Part.TARGET_STATE)
    dev = DevicePool(layout, 300, device="cuda")
    host = HostPool(layout, 300 * layout.bytes_per_page, pin=True)
    host.wait_ready()
    engine = make_engine("direct", dev, host, hook_span_inline=span_inline)
    batches: list[int] = []
    real = engine._drv.memcpy_batch_ptrs

    def counted(*args: int) -> None:
        batches.append(args[3])
        real(*args)

    monkeypatch.setattr(engine._drv, "memcpy_batch_ptrs", counted)
    try:
        d_pages, h_pages = np.arange(10, 22, dtype=np.int64), np.arange(40, 52, dtype=np.int64)  # one run
        plan = engine.plan(Direction.D2H, d_pages, h_pages)
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        for layer in range(6):
            for _ in range(3):  # compute queued before the layer's write
                a = a @ a
                a = a / a.abs().amax().clamp(min=1)
            for p in both:
                host.torch_view(p)[layout.part(p).slot(layer)].fill_(0)
                dev.buffer(p)[layout.part(p).slot(layer)].fill_(0x30 + layer)
        tickets = engine.submit_layers(plan, [(both, layer) for layer in range(6)])
        if span_inline:
            assert batches == [6 * len(both)] and engine.counts["deferred"] == 0
            assert all(isinstance(t, SharedTicket) for ts in tickets for t in ts)
            assert [t.layer for ts in tickets for t in ts] == [layer for layer in range(6) for _ in both]
        else:
            assert engine.counts["deferred"] == 6
        for ts in tickets:
            for t in ts:
                t.wait()
                assert t.query() is TicketState.DONE
        for layer in range(6):
            for p in both:
                got = host.torch_view(p)[layout.part(p).slot(layer)][h_pages]
                assert bool((got == 0x30 + layer).all()), (span_inline, p, layer)
    finally:
        engine.close()
        host.close()
