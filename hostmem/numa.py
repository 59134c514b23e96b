"""NUMA placement of a shared mapping: where its pages land at first touch, and where they are.

A node-level host segment is read by every GPU of the node, each over the
PCIe link of its own socket, so no single NUMA node is local to all of its
readers. :func:`place` sets the memory policy of a range before its first
touch (``mbind(2)`` through ctypes, no libnuma):

* :attr:`NumaPolicy.INTERLEAVE`: pages round-robin over the given nodes (by
  default every node with memory). Every reader then finds half (on two
  sockets) of what it reads local and the inter-socket link carries the
  rest, evenly for all ranks, and the sockets' memory bandwidth adds up.
* :attr:`NumaPolicy.LOCAL`: the kernel's default, first touch: the node of
  the thread that faults the page in (the prefault threads of the process
  that creates the segment), so the whole segment may land on one socket.

On a shared (tmpfs or hugetlbfs) mapping the policy is the *shared policy*
of the file: it governs pages allocated later through any process's
mapping, not only this one. Pages already present keep their node.

:func:`placement` reads back where the pages of a range are
(``/proc/self/numa_maps``: pages per node), for reports. Linux only; on
other systems, or where ``mbind`` is refused (containers without
``CAP_SYS_NICE`` may refuse node masks), :func:`place` logs and returns
False: placement is an optimisation, never a reason to fail.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import platform
import re
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["NumaPolicy", "memory_nodes", "place", "placement"]

#: mbind(2)'s syscall number per machine (the libc wrapper is libnuma's, not glibc's).
_MBIND = {"x86_64": 237, "aarch64": 235}
_MPOL_INTERLEAVE = 3
_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8


class NumaPolicy(str, enum.Enum):
    """Where a segment's pages go (see the module docstring)."""

    #: ``INTERLEAVE`` on a machine with several memory nodes, else ``LOCAL``.
    AUTO = "auto"
    INTERLEAVE = "interleave"
    LOCAL = "local"


def memory_nodes(sys_root: Path = Path("/sys")) -> list[int]:
    """The NUMA nodes that have memory (``node/has_memory``), ascending; ``[0]`` if unreadable."""
    try:
        text = (sys_root / "devices/system/node/has_memory").read_text().strip()
    except OSError:
        return [0]
    nodes: list[int] = []
    for item in filter(None, text.split(",")):
        lo, _, hi = item.partition("-")
        nodes.extend(range(int(lo), int(hi or lo) + 1))
    return nodes or [0]


def resolve(policy: NumaPolicy | str, nodes: list[int] | None = None) -> NumaPolicy:
    """``AUTO`` made concrete for this machine (or for ``nodes``)."""
    policy = NumaPolicy(policy)
    if policy is NumaPolicy.AUTO:
        return NumaPolicy.INTERLEAVE if len(nodes or memory_nodes()) > 1 else NumaPolicy.LOCAL
    return policy


def place(addr: int, length: int, policy: NumaPolicy | str, nodes: list[int] | None = None) -> bool:
    """Set the memory policy of ``[addr, addr + length)`` (page-aligned) before its first touch.

    ``LOCAL`` changes nothing (it is the default). Returns whether the policy
    in force is the one asked for; a refusal is logged at WARNING.
    """
    policy = resolve(policy, nodes)
    if policy is NumaPolicy.LOCAL:
        return True
    nodes = nodes or memory_nodes()
    number = _MBIND.get(platform.machine())
    if number is None:
        logger.warning("numa: mbind is not wired for %s; pages stay where first touched", platform.machine())
        return False
    words = max(nodes) // _ULONG_BITS + 1
    mask = (ctypes.c_ulong * words)()
    for n in nodes:
        mask[n // _ULONG_BITS] |= 1 << (n % _ULONG_BITS)
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(
        ctypes.c_long(number), ctypes.c_void_p(addr), ctypes.c_ulong(length), ctypes.c_int(_MPOL_INTERLEAVE),
        mask, ctypes.c_ulong(words * _ULONG_BITS + 1), ctypes.c_uint(0),
    )  # fmt: skip
    if rc != 0:
        code = ctypes.get_errno()
        logger.warning("numa: mbind(interleave over %s) refused: %s; pages stay where first touched",
                       nodes, os.strerror(code))  # fmt: skip
        return False
    return True


_NODE_FIELD = re.compile(r"\bN(\d+)=(\d+)")


def placement(addr: int, length: int, numa_maps: Path = Path("/proc/self/numa_maps")) -> dict[int, int]:
    """Pages per NUMA node of the mappings that start inside ``[addr, addr + length)``.

    Reads ``numa_maps`` (the kernel walks the page tables: for reports, never
    on a hot path); an empty dict where it cannot be read.
    """
    out: dict[int, int] = {}
    try:
        lines = numa_maps.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        start, _, rest = line.partition(" ")
        try:
            base = int(start, 16)
        except ValueError:
            continue
        if not addr <= base < addr + length:
            continue
        for node, pages in _NODE_FIELD.findall(rest):
            out[int(node)] = out.get(int(node), 0) + int(pages)
    return out
