"""The cpu backend's restore checks at the engine (`hicache_cp.io.cpu`, `verify.HostChecks`).

A backup stores the checksum of every copied page and layer, as the definition
(`checksum.checksums`) gives it for the bytes copied; a load compares what landed
and fails exactly the layer whose bytes differ. Each on both paths (hashed on the
copy's worker, hashed in batches on the asking thread) and for page lists that are
one run (hashed from a view) or scattered (gathered). With the checks off, no
checksum work runs at all.
"""

from __future__ import annotations

import threading
import time
from contextlib import closing
from typing import Any

import numpy as np
import pytest

from hicache_cp import checksum
from hicache_cp.checksum import Verify
from hicache_cp.config import Config
from hicache_cp.errors import IntegrityError
from hicache_cp.io.base import CopyFailed, Direction
from hicache_cp.io.cpu import CpuCopyEngine
from hicache_cp.layout import Model
from hicache_cp.pools import DevicePool, HostPool

PAGES = 40


@pytest.fixture(params=["batched", "on-worker"])
def path(request, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr("hicache_cp.io.cpu.WORKER_CHECK_BYTES", 0 if request.param == "on-worker" else 1 << 40)
    return request.param


def make(verify: Verify = Verify.ALL, landed: Any = None) -> CpuCopyEngine:
    layout = Config(model="tiny").layout()
    dev = DevicePool(layout, 2 * PAGES + 8, device="cpu")
    host = HostPool(layout, layout.bytes_per_page * (2 * PAGES + 8), pin=False, checksums=verify is not Verify.OFF)
    rng = np.random.default_rng(0)
    for p in layout.parts:
        for slot in range(p.num_slots):
            view = dev.layer_view(p.part, slot)
            view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)
    engine = CpuCopyEngine(dev, host, landed=landed)
    engine.verify = verify
    return engine


def copy_op(engine: CpuCopyEngine, direction: Direction, device_pages: np.ndarray, host_pages: np.ndarray) -> list[Any]:
    """Every layer of every part of one op, as the cache submits them; its tickets, done."""
    plan = engine.plan(direction, device_pages, host_pages)
    layout, tickets = engine.layout, []
    for model in Model:
        for layer in range(layout.num_layers(model)):
            parts = tuple(p.part for p in layout.parts_of(model) if layer in p.layer_ids)
            tickets += [t for t in engine.submit_layer(plan, parts, layer) if t is not None]
    return tickets


def backed_up(device_pages: np.ndarray, host_pages: np.ndarray) -> CpuCopyEngine:
    """An engine (checks on) whose `device_pages` were backed up to `host_pages`, waited for."""
    engine = make()
    for t in copy_op(engine, Direction.D2H, device_pages, host_pages):
        t.wait()
    return engine


PAGE_LISTS = {
    "one run": (np.arange(3, 3 + PAGES), np.arange(5, 5 + PAGES)),
    "scattered": (np.arange(2, 2 + 2 * PAGES, 2)[::-1].copy(), np.arange(1, 1 + 2 * PAGES, 2)),
}


@pytest.mark.parametrize("pages", PAGE_LISTS)
def test_backup_stores_the_checksum_of_every_copied_page(path: str, pages: str) -> None:
    device_pages, host_pages = PAGE_LISTS[pages]
    with closing(backed_up(device_pages, host_pages)) as engine:
        for p in engine.layout.parts:
            for layer in p.layer_ids:
                slot = p.slot(layer)
                copied = engine.host_pool.layer_view(p.part, slot)[host_pages]
                assert np.array_equal(copied, engine.device_pool.layer_view(p.part, slot)[device_pages])
                want = checksum.checksums(copied, p.part, layer)
                assert np.array_equal(engine.host_pool.sums(p.part)[slot, host_pages], want), (p.part, layer)


@pytest.mark.parametrize("pages", PAGE_LISTS)
def test_a_backup_checked_layer_by_layer_stores_what_a_whole_op_stores(path: str, pages: str) -> None:
    """Each layer waited for before the next is submitted: every check covers some rows of
    the op's table (not all of them, as a whole op's does), and stores the same checksums."""
    device_pages, host_pages = PAGE_LISTS[pages]
    whole = backed_up(device_pages, host_pages)
    engine = make()
    with closing(whole), closing(engine):
        plan = engine.plan(Direction.D2H, device_pages, host_pages)
        for model in Model:
            for layer in range(engine.layout.num_layers(model)):
                parts = tuple(p.part for p in engine.layout.parts_of(model) if layer in p.layer_ids)
                for t in engine.submit_layer(plan, parts, layer):
                    t.wait()
        for p in engine.layout.parts:
            for layer in p.layer_ids:
                slot = p.slot(layer)
                want = checksum.checksums(engine.device_pool.layer_view(p.part, slot)[device_pages], p.part, layer)
                assert np.array_equal(engine.host_pool.sums(p.part)[slot, host_pages], want), (p.part, layer)
                assert np.array_equal(whole.host_pool.sums(p.part)[slot, host_pages], want), (p.part, layer)


def test_the_checksum_table_rows_are_the_parts_slots() -> None:
    """`HostPool.sums_table` row `offsets[part] + slot` is `sums(part)[slot]` (the same
    memory), and `layout_salts` names each row's part, layer and salt alike."""
    with closing(make()) as engine:
        table, rows = engine.host_pool.sums_table(), checksum.layout_salts(engine.layout)
        assert len(table) == rows.rows == len(rows.part_at)
        for p in engine.layout.parts:
            for layer in p.layer_ids:
                row = rows.row_of[p.part, layer]
                assert row == rows.offsets[p.part] + p.slot(layer) and rows.part_at[row] is p.part
                assert rows.salts[row] == checksum.salt(p.part, layer, p.page_bytes)
                table[row, 1] = row + 1
                assert engine.host_pool.sums(p.part)[p.slot(layer), 1] == row + 1


@pytest.mark.parametrize("pages", PAGE_LISTS)
def test_a_load_fails_exactly_the_layer_whose_bytes_differ(path: str, pages: str) -> None:
    device_pages, host_pages = PAGE_LISTS[pages]
    with closing(backed_up(device_pages, host_pages)) as engine:
        bad = engine.layout.parts[-1]
        engine.host_pool.layer_view(bad.part, bad.slot(bad.layer_ids[-1]))[host_pages[7], 3] ^= 0x10
        targets = np.setdiff1d(np.arange(1, 2 * PAGES + 8), device_pages)[:PAGES]
        failed = []
        for t in copy_op(engine, Direction.H2D, targets, host_pages):
            try:
                t.wait()
            except CopyFailed as exc:
                assert isinstance(exc.__cause__, IntegrityError)
                failed.append((t.part, t.layer))
        assert failed == [(bad.part, bad.layer_ids[-1])]
        checked, mismatched = engine.integrity.snapshot()
        units = sum(p.num_slots for p in engine.layout.parts) * PAGES
        assert checked == {"l2": units} and mismatched == {("l2", bad.part.value): 1}


@pytest.mark.parametrize("by_layer", [False, True])
def test_a_load_fails_each_corrupt_layer_of_any_part(path: str, by_layer: bool) -> None:
    """Two corrupt layers of two parts (their table rows in another order than their
    tickets): exactly their tickets fail, whether one check covers the whole op or each
    layer is checked alone."""
    device_pages, host_pages = PAGE_LISTS["scattered"]
    with closing(backed_up(device_pages, host_pages)) as engine:
        corrupt = [(engine.layout.parts[0], 1), (engine.layout.parts[-1], engine.layout.parts[-1].layer_ids[0])]
        for p, layer in corrupt:
            engine.host_pool.layer_view(p.part, p.slot(layer))[host_pages[3], 5] ^= 0x01
        targets = np.setdiff1d(np.arange(1, 2 * PAGES + 8), device_pages)[:PAGES]
        plan, failed = engine.plan(Direction.H2D, targets, host_pages), []
        tickets: list[Any] = []
        for model in Model:
            for layer in range(engine.layout.num_layers(model)):
                parts = tuple(p.part for p in engine.layout.parts_of(model) if layer in p.layer_ids)
                mine = [t for t in engine.submit_layer(plan, parts, layer) if t is not None]
                tickets += mine
                for t in mine if by_layer else []:
                    t._future.exception()  # landed before the next layer is submitted
                    t.query()
        for t in tickets:
            try:
                t.wait()
            except CopyFailed:
                failed.append((t.part, t.layer))
        assert sorted(failed, key=str) == sorted([(p.part, layer) for p, layer in corrupt], key=str)
        _, mismatched = engine.integrity.snapshot()
        assert mismatched == {("l2", p.part.value): 1 for p, _ in corrupt}


def test_a_forward_waiting_for_its_first_layer_leaves_the_later_copies_checked(path: str) -> None:
    """The forward waits for layer 0 of a load while the later layers are still copying:
    that wait checks only what landed, and every later layer is still checked when it
    lands (the corrupt one fails; every unit is counted)."""
    device_pages, host_pages = PAGE_LISTS["one run"]
    with closing(backed_up(device_pages, host_pages)) as engine:
        bad = engine.layout.parts[-1]
        engine.host_pool.layer_view(bad.part, bad.slot(bad.layer_ids[-1]))[host_pages[7], 3] ^= 0x10
        first = threading.Event()

        def slow_after_the_first(direction: Direction, part: Any, layer: int) -> None:
            if first.is_set():
                time.sleep(0.02)
            first.set()

        engine.fault = slow_after_the_first
        targets = np.setdiff1d(np.arange(1, 2 * PAGES + 8), device_pages)[:PAGES]
        tickets = copy_op(engine, Direction.H2D, targets, host_pages)
        tickets[0].make_compute_wait()  # the later copies are still in flight
        failed = []
        for t in tickets[1:]:
            try:
                t.wait()
            except CopyFailed:
                failed.append((t.part, t.layer))
        assert failed == [(bad.part, bad.layer_ids[-1])]
        checked, _ = engine.integrity.snapshot()
        assert checked == {"l2": sum(p.num_slots for p in engine.layout.parts) * PAGES}


def test_a_backup_hashed_on_its_worker_checksums_the_bytes_it_copied(monkeypatch) -> None:
    # The worker hashes the rows it gathered: a write into the device pages after the copy
    # (the landed hook) is not what was copied, and does not change the stored checksum.
    monkeypatch.setattr("hicache_cp.io.cpu.WORKER_CHECK_BYTES", 0)
    device_pages, host_pages = PAGE_LISTS["scattered"]

    def scribble(direction: Direction, part: Any, layer: int, dev: np.ndarray, host: np.ndarray) -> None:
        engine.device_pool.layer_view(part, engine.layout.part(part).slot(layer))[dev] = 0

    engine = make(landed=scribble)
    with closing(engine):
        for t in copy_op(engine, Direction.D2H, device_pages, host_pages):
            t.wait()
        p = engine.layout.parts[0]
        copied = engine.host_pool.layer_view(p.part, 0)[host_pages]
        assert copied.any()
        assert np.array_equal(engine.host_pool.sums(p.part)[0, host_pages], checksum.checksums(copied, p.part, 0))


def test_with_the_checks_off_no_checksum_work_runs(path: str, monkeypatch) -> None:
    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("checksum work with verify_restores = off")

    for name in ("raw_sums", "checksums", "checksums_by_layer", "salted", "fmix64"):
        monkeypatch.setattr(checksum, name, never)
    device_pages, host_pages = PAGE_LISTS["one run"]
    engine = make(Verify.OFF)
    with closing(engine):
        for t in copy_op(engine, Direction.D2H, device_pages, host_pages):
            t.wait()
        for t in copy_op(engine, Direction.H2D, device_pages + 1, host_pages):
            t.wait()
        assert not engine.host_pool.has_checksums


@pytest.mark.parametrize("n", [1, 2, 3, 64, 65, 300])
def test_pages_are_one_run_exactly_when_each_follows_the_last(n: int) -> None:
    from hicache_cp.io.verify import _run_start

    run = np.arange(7, 7 + n, dtype=np.int64)
    swapped, gap = run.copy(), run.copy()
    swapped[[0, -1]] = swapped[[-1, 0]]
    gap[n // 2 :] += 1
    for pages in (run, swapped, gap, run[::-1].copy(), np.full(n, 7, dtype=np.int64)):
        want = int(pages[0]) if bool((np.diff(pages) == 1).all()) else None
        assert _run_start(pages) == want, pages
    assert _run_start(np.empty(0, dtype=np.int64)) is None
