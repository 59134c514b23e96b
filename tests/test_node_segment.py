"""hostmem.segment and hostmem.numa: named shared memory, its locks, its lifetime, arenas over it.

Every test names its segments after its own pid and removes them (the
`seg_name` fixture checks /dev/shm is clean afterwards).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from hostmem import numa
from hostmem.arena import HostArena, TouchMode
from hostmem.mapping import pss_bytes, resident_bytes
from hostmem.segment import SHM_DIR, Segment, SegmentBusy, check_name, drop_segment, find_segment, list_segments

MIB = 1 << 20


def _open(name: str, nbytes: int = 4 * MIB) -> Segment:
    return Segment.open_mapped(name, nbytes)


def test_bytes_outlive_the_opener_and_close_unlinks_only_when_asked(seg_name: str) -> None:
    seg = _open(seg_name)
    assert seg.created and seg.path == SHM_DIR / seg_name and seg.size == 4 * MIB
    np.frombuffer(seg.mm, np.uint8, 8, 1000)[:] = 7  # type: ignore[arg-type]
    assert not seg.close()  # kept
    again = _open(seg_name)
    assert not again.created
    assert np.frombuffer(again.mm, np.uint8, 8, 1000).tolist() == [7] * 8  # type: ignore[arg-type]
    assert again.close(unlink_if_last=True)
    assert find_segment(seg_name) is None


def test_only_the_last_user_removes_it_and_a_used_segment_is_neither_resized_nor_dropped(seg_name: str) -> None:
    a, b = _open(seg_name), _open(seg_name)
    assert [s.name for s in list_segments(seg_name)] == [seg_name]
    with b.opening():
        assert not b.sole_user()  # a maps it too
    b.close()
    with pytest.raises(SegmentBusy, match="in use"):
        drop_segment(seg_name)
    c = Segment(seg_name)
    with c.opening(), pytest.raises(SegmentBusy, match="resize"):
        c.resize(MIB)
    c.close()
    assert not a.close(unlink_if_last=False)
    assert drop_segment(seg_name) and not drop_segment(seg_name)


def test_two_closing_users_leave_nothing_whatever_their_order(seg_name: str) -> None:
    a, b = _open(seg_name), _open(seg_name)
    assert not a.close(unlink_if_last=True)  # b still maps it
    assert (SHM_DIR / seg_name).exists()
    assert b.close(unlink_if_last=True)
    assert not (SHM_DIR / seg_name).exists()


def test_the_opening_mutex_times_out_instead_of_hanging(seg_name: str) -> None:
    a, b = Segment(seg_name), Segment(seg_name)
    try:
        with a.opening(), pytest.raises(TimeoutError, match="opening lock"):
            with b.opening(timeout_s=0.05):
                pass
    finally:
        a.close(unlink_if_last=True)
        b.close(unlink_if_last=True)


def _open_share_and_die(name: str) -> None:
    _open(name)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_user_leaves_its_bytes_and_no_lock(seg_name: str) -> None:
    child = mp.get_context("spawn").Process(target=_open_share_and_die, args=(seg_name,))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    seg = Segment(seg_name)
    try:
        with seg.opening():
            assert seg.size == 4 * MIB
            assert seg.sole_user()  # the dead process's users lock died with it
    finally:
        seg.close(unlink_if_last=True)


def test_an_arena_over_a_region_keeps_its_contents_and_refuses_to_zero_them(seg_name: str) -> None:
    seg = _open(seg_name, 8 * MIB)
    try:
        np.frombuffer(seg.mm, np.uint8, MIB, 4 * MIB)[:] = 3  # type: ignore[arg-type]
        region = seg.region(4 * MIB, 4 * MIB)
        with HostArena(4 * MIB, pin=False, memory=region, register_chunk_bytes=MIB, background=False, name="r") as a:
            assert a.touch_mode is not TouchMode.WRITE and a.ptr == seg.addr + 4 * MIB
            view = a.numpy()
            assert (view[:MIB] == 3).all() and (view[MIB:] == 0).all()  # prefaulted, not zeroed
            view[MIB : MIB + 4] = 9
            del view
        assert np.frombuffer(seg.mm, np.uint8, 4, 5 * MIB).tolist() == [9] * 4  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="zero"):
            HostArena(4 * MIB, pin=False, memory=region, touch="write", name="w")
        with pytest.raises(ValueError, match="region has"):
            HostArena(MIB, pin=False, memory=region, name="small")
        with pytest.raises(ValueError, match="page-aligned"):
            seg.region(100, MIB)
    finally:
        seg.close(unlink_if_last=True)


def test_proportional_size_splits_a_shared_segment_between_its_users(seg_name: str) -> None:
    a = _open(seg_name, 8 * MIB)
    b = _open(seg_name, 8 * MIB)
    try:
        np.frombuffer(a.mm, np.uint8)[:] = 1  # type: ignore[arg-type] - every page resident, mapped by a
        np.frombuffer(b.mm, np.uint8).sum()  # type: ignore[arg-type] - and by b
        one = pss_bytes([(a.addr, 8 * MIB)])
        assert 3 * MIB <= one <= 5 * MIB  # two mappers: about half each
        assert resident_bytes(a.addr, 8 * MIB) == 8 * MIB
    finally:
        a.close(unlink_if_last=True)
        b.close(unlink_if_last=True)


def test_bad_names_are_refused() -> None:
    for bad in ("", "a/b", "../x", "-lead", "x" * 201):
        with pytest.raises(ValueError, match="segment name"):
            check_name(bad)
    assert check_name("hicache-cp.node_0") == "hicache-cp.node_0"


def test_numa_nodes_policies_and_placement_reading(tmp_path: Path) -> None:
    (tmp_path / "devices/system/node").mkdir(parents=True)
    (tmp_path / "devices/system/node/has_memory").write_text("0-1,3\n")
    assert numa.memory_nodes(tmp_path) == [0, 1, 3]
    assert numa.resolve("auto", [0, 1]) is numa.NumaPolicy.INTERLEAVE
    assert numa.resolve("auto", [0]) is numa.NumaPolicy.LOCAL
    maps = tmp_path / "numa_maps"
    maps.write_text("7f0000000000 interleave:0-1 file=/dev/shm/x dirty=4 N0=3 N1=2 kernelpagesize_kB=4\n"
                    "7f0000100000 default anon=1 N0=1\n")  # fmt: skip
    assert numa.placement(0x7F0000000000, 1 << 20, maps) == {0: 3, 1: 2}
    assert numa.place(0, 4096, "local")  # the default policy: nothing to set
