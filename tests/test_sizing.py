"""Tests for hostmem.sizing: fake /proc and /sys trees for every source, and the real reading here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostmem.sizing import DEFAULT_RESERVE_BYTES, HostMemory, MemorySource, host_memory, pool_budget_bytes

GIB = 1 << 30
KIB = 1024
V1_UNLIMITED = 9223372036854771712


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_host(
    root: Path,
    *,
    mem_total: int = 128 * GIB,
    mem_available: int = 120 * GIB,
    proc_cgroup: str = "0::/\n",
) -> tuple[Path, Path]:
    """A fake /proc (meminfo, self/cgroup) and an empty /sys under ``root``; returns (proc, sys)."""
    proc, sys_ = root / "proc", root / "sys"
    _write(
        proc / "meminfo",
        f"MemTotal:       {mem_total // KIB} kB\nMemFree:        {mem_available // 2 // KIB} kB\n"
        f"MemAvailable:   {mem_available // KIB} kB\nHugePages_Total:       0\nHugepagesize:       2048 kB\n",
    )
    _write(proc / "self/cgroup", proc_cgroup)
    sys_.mkdir(parents=True, exist_ok=True)
    return proc, sys_


def cgroup_v2(sys_: Path, rel: str, files: dict[str, str]) -> Path:
    d = sys_ / "fs/cgroup" / rel.lstrip("/")
    for name, text in files.items():
        _write(d / name, text)
    return d


def cgroup_v1(sys_: Path, rel: str, files: dict[str, str]) -> Path:
    d = sys_ / "fs/cgroup/memory" / rel.lstrip("/")
    for name, text in files.items():
        _write(d / name, text)
    return d


def test_no_cgroup_uses_meminfo(tmp_path: Path) -> None:
    proc, sys_ = fake_host(tmp_path, mem_total=64 * GIB, mem_available=50 * GIB)
    m = host_memory(4 * GIB, proc_root=proc, sys_root=sys_)
    assert m.source is MemorySource.MEMINFO
    assert (m.total_bytes, m.available_bytes, m.reserve_bytes) == (64 * GIB, 50 * GIB, 4 * GIB)
    assert m.pool_bytes == 46 * GIB
    assert m.cgroup_limit_bytes is None and m.cgroup_path is None
    assert "pool 46.0 GiB" in m.describe()


def test_cgroup_v2_limit_minus_working_set(tmp_path: Path) -> None:
    """Inside a cgroup namespace: /proc/self/cgroup says "/", the mount root is the container's cgroup."""
    proc, sys_ = fake_host(tmp_path)
    cgroup_v2(sys_, "/", {
        "memory.max": f"{40 * GIB}\n",
        "memory.current": f"{10 * GIB}\n",
        "memory.stat": f"anon {6 * GIB}\nfile {4 * GIB}\ninactive_file {3 * GIB}\nactive_file {GIB}\n",
    })
    m = host_memory(2 * GIB, proc_root=proc, sys_root=sys_)
    assert m.source is MemorySource.CGROUP_V2
    assert m.total_bytes == 40 * GIB
    assert m.available_bytes == 40 * GIB - (10 * GIB - 3 * GIB)  # inactive page cache is reclaimable
    assert m.pool_bytes == 31 * GIB
    assert (m.cgroup_usage_bytes, m.cgroup_inactive_file_bytes) == (10 * GIB, 3 * GIB)


def test_cgroup_v2_smallest_limit_over_ancestors_wins(tmp_path: Path) -> None:
    proc, sys_ = fake_host(tmp_path, proc_cgroup="0::/kubepods/pod1/ctr\n")
    cgroup_v2(sys_, "/kubepods", {"memory.max": f"{24 * GIB}\n"})
    cgroup_v2(sys_, "/kubepods/pod1", {"memory.max": "max\n"})
    leaf = cgroup_v2(sys_, "/kubepods/pod1/ctr", {
        "memory.max": f"{100 * GIB}\n", "memory.current": f"{4 * GIB}\n", "memory.stat": "inactive_file 0\n",
    })
    m = host_memory(0, proc_root=proc, sys_root=sys_)
    assert m.source is MemorySource.CGROUP_V2 and m.cgroup_path == str(leaf)
    assert m.cgroup_limit_bytes == 24 * GIB and m.available_bytes == 20 * GIB


def test_cgroup_v2_without_a_limit_falls_back_to_meminfo(tmp_path: Path) -> None:
    proc, sys_ = fake_host(tmp_path, mem_available=90 * GIB, proc_cgroup="0::/user.slice\n")
    cgroup_v2(sys_, "/user.slice", {"memory.max": "max\n", "memory.current": f"{GIB}\n"})
    m = host_memory(0, proc_root=proc, sys_root=sys_)
    assert m.source is MemorySource.MEMINFO and m.available_bytes == 90 * GIB


def test_cgroup_path_missing_under_the_mount_reads_the_mount_root(tmp_path: Path) -> None:
    """A namespace whose /proc/self/cgroup names the host's path while the mount shows the container's root."""
    proc, sys_ = fake_host(tmp_path, proc_cgroup="0::/system.slice/docker-abc.scope\n")
    cgroup_v2(sys_, "/", {"memory.max": f"{16 * GIB}\n", "memory.current": f"{GIB}\n"})
    m = host_memory(0, proc_root=proc, sys_root=sys_)
    assert m.source is MemorySource.CGROUP_V2 and m.cgroup_limit_bytes == 16 * GIB


def test_meminfo_bounds_a_loose_cgroup_limit(tmp_path: Path) -> None:
    """A container limit larger than what the machine has free: the machine wins."""
    proc, sys_ = fake_host(tmp_path, mem_total=64 * GIB, mem_available=12 * GIB)
    cgroup_v2(sys_, "/", {"memory.max": f"{48 * GIB}\n", "memory.current": f"{GIB}\n"})
    m = host_memory(0, proc_root=proc, sys_root=sys_)
    assert m.source is MemorySource.CGROUP_V2
    assert m.total_bytes == 48 * GIB and m.available_bytes == 12 * GIB


def test_hybrid_host_reads_the_v1_memory_controller(tmp_path: Path) -> None:
    """cgroup v1 with a v2 'unified' mount that has no memory controller (this machine's layout)."""
    proc, sys_ = fake_host(tmp_path, proc_cgroup="4:memory:/process_api/abc\n0::/\n")
    _write(sys_ / "fs/cgroup/unified/cgroup.procs", "")
    cgroup_v1(sys_, "/process_api/abc", {
        "memory.limit_in_bytes": f"{32 * GIB}\n",
        "memory.usage_in_bytes": f"{6 * GIB}\n",
        "memory.stat": f"cache {2 * GIB}\nhierarchical_memory_limit {V1_UNLIMITED}\ntotal_inactive_file {2 * GIB}\n",
    })
    m = host_memory(GIB, proc_root=proc, sys_root=sys_)
    assert m.source is MemorySource.CGROUP_V1
    assert m.cgroup_limit_bytes == 32 * GIB and m.available_bytes == 28 * GIB and m.pool_bytes == 27 * GIB


def test_v1_hierarchical_limit_and_unlimited(tmp_path: Path) -> None:
    proc, sys_ = fake_host(tmp_path, proc_cgroup="9:cpu,memory:/job\n")
    d = cgroup_v1(sys_, "/job", {
        "memory.limit_in_bytes": f"{V1_UNLIMITED}\n",
        "memory.usage_in_bytes": f"{GIB}\n",
        "memory.stat": f"hierarchical_memory_limit {20 * GIB}\ntotal_inactive_file 0\n",
    })
    m = host_memory(0, proc_root=proc, sys_root=sys_)
    assert m.source is MemorySource.CGROUP_V1 and m.cgroup_limit_bytes == 20 * GIB  # a parent's limit
    _write(d / "memory.stat", f"hierarchical_memory_limit {V1_UNLIMITED}\n")
    assert host_memory(0, proc_root=proc, sys_root=sys_).source is MemorySource.MEMINFO


def test_reserve_fraction_and_bad_reserves(tmp_path: Path) -> None:
    proc, sys_ = fake_host(tmp_path, mem_total=100 * GIB, mem_available=100 * GIB)
    m = host_memory(GIB, reserve_fraction=0.25, proc_root=proc, sys_root=sys_)
    assert m.reserve_bytes == 25 * GIB and m.pool_bytes == 75 * GIB
    assert pool_budget_bytes(200 * GIB, proc_root=proc, sys_root=sys_) == 0  # never negative
    with pytest.raises(ValueError, match="reserve_bytes"):
        host_memory(-1, proc_root=proc, sys_root=sys_)
    with pytest.raises(ValueError, match="reserve_fraction"):
        host_memory(0, reserve_fraction=1.0, proc_root=proc, sys_root=sys_)


def test_unreadable_meminfo_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        host_memory(proc_root=tmp_path / "nothing", sys_root=tmp_path)


@settings(max_examples=60, deadline=None)
@given(
    limit=st.integers(GIB, 512 * GIB),
    usage=st.integers(0, 512 * GIB),
    inactive=st.integers(0, 64 * GIB),
    available=st.integers(0, 512 * GIB),
    reserves=st.lists(st.integers(0, 64 * GIB), min_size=2, max_size=2),
)
def test_pool_never_exceeds_what_is_free_and_shrinks_with_the_reserve(
    tmp_path_factory: pytest.TempPathFactory, limit: int, usage: int, inactive: int, available: int, reserves: list[int]
) -> None:
    root = tmp_path_factory.mktemp("h")
    proc, sys_ = fake_host(root, mem_total=1024 * GIB, mem_available=available // KIB * KIB)
    cgroup_v2(sys_, "/", {
        "memory.max": f"{limit}\n", "memory.current": f"{usage}\n", "memory.stat": f"inactive_file {inactive}\n",
    })
    small, big = sorted(reserves)
    a = host_memory(small, proc_root=proc, sys_root=sys_)
    b = host_memory(big, proc_root=proc, sys_root=sys_)
    assert 0 <= b.pool_bytes <= a.pool_bytes
    assert a.pool_bytes <= min(limit, available)
    assert a.pool_bytes == 0 or a.pool_bytes + small <= min(limit, available)  # the reserve is really left


# -- the real reading on this machine ---------------------------------------------------------


def test_real_reading_here_is_consistent_with_the_kernel() -> None:
    m = host_memory()
    assert isinstance(m, HostMemory) and m.source in MemorySource
    assert m.reserve_bytes == DEFAULT_RESERVE_BYTES
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # an independent view of MemTotal
    assert m.meminfo_total_bytes == pytest.approx(phys, rel=0.01)
    assert 0 < m.available_bytes <= m.meminfo_available_bytes <= m.meminfo_total_bytes
    assert m.total_bytes <= m.meminfo_total_bytes
    assert m.pool_bytes == max(0, m.available_bytes - m.reserve_bytes)
    if m.source is not MemorySource.MEMINFO:
        assert m.cgroup_limit_bytes is not None and m.cgroup_path is not None and Path(m.cgroup_path).is_dir()
