"""The restore checks of PD (`hicache_cp.checksum`): every page the decode side
receives is checked against the checksum the prefill side sent with "done".

Prefill (`PdSender`, when its host pool keeps checksums):

    check_identity(host_pool, plan)     before a send: an L2 page must hold the copy
                                        of its position (`HostPool.tags` equal the
                                        prefix hashes sent), else IntegrityError
    room_checksums(...)                 at "done": per (part, layer) and position
                                        sent, the stored checksum of an L2 page
                                        (taken when its backup copied it) or the
                                        checksum of an L1 page computed now

Decode (what a decode server calls before it reports success; the harness's
decode peer does):

    check_received(layout, views, dst_pages, positions, units, sums) -> failures

On the wire the checksums are one base64 string of little-endian uint64
[units, positions] (`encode` / `decode`) and the (part, layer) list of the units.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache_cp import checksum
from hicache_cp.cp import mapping as cp_mapping
from hicache_cp.errors import IntegrityError
from hicache_cp.io.checksum_gpu import device_checksums
from hicache_cp.layout import KVLayout, Part
from hicache_cp.pd.plan import L1, L2, TransferPlan
from hicache_cp.pools import HostPool


def units_of(layout: KVLayout) -> list[tuple[Part, int]]:
    """Every (part, logical layer) of the layout, in layout order: the rows of the checksums."""
    return [(p.part, layer) for p in layout.parts for layer in p.layer_ids]


def encode(sums: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(sums, dtype="<u8").tobytes()).decode("ascii")


def decode(text: str, units: int, n: int) -> np.ndarray:
    """uint64 [units, n]; ValueError when the size does not match."""
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    if len(raw) != 8 * units * n:
        raise ValueError(f"checksums: {len(raw)} bytes for {units} units x {n} positions")
    return np.frombuffer(raw, dtype="<u8").astype(np.uint64).reshape(units, n)


def check_identity(host_pool: HostPool, plan: TransferPlan, rank: int) -> None:
    """Raise IntegrityError when an L2 page of `plan` holds another copy than its
    position's (freed and reused, or dropped after a failed check)."""
    l2 = plan.tiers == L2
    if not l2.any():
        return
    stale = host_pool.stale_tags(plan.pages[l2], plan.hashes[l2])
    if len(stale):
        raise IntegrityError("PD send: L2 pages hold another copy than the positions sent (freed and reused, "
                             "or dropped); pages are request positions", tier="l2", rank=rank,
                             pages=plan.positions[l2][stale], units=len(stale))  # fmt: skip


def room_checksums(
    layout: KVLayout, device_pool: Any, host_pool: HostPool | None, positions: np.ndarray, tiers: np.ndarray,
    pages: np.ndarray, cp_size: int,
) -> np.ndarray:
    """uint64 [units, len(positions)]: each unit's checksum of each position sent, from
    where it was sent (`tiers`, logical `pages`). L1 pages are checksummed now
    (on CUDA the kernel, with one sync: "done" is a control path)."""
    units = units_of(layout)
    out = np.zeros((len(units), len(positions)), dtype=np.uint64)
    if not len(positions):
        return out
    physical = cp_mapping.to_physical(np.asarray(pages, dtype=np.int64), cp_size)
    on_l1, on_l2 = tiers == L1, tiers == L2
    for u, (part, layer) in enumerate(units):
        if on_l2.any():
            assert host_pool is not None
            out[u, on_l2] = host_pool.sums(part)[layout.part(part).slot(layer), physical[on_l2]]
        if on_l1.any():
            out[u, on_l1] = device_checksums(device_pool, part, layer, physical[on_l1])
    return out


@dataclass(frozen=True)
class Failure:
    """One received (position, part, layer) whose bytes differ from the checksum sent."""

    position: int
    part: str
    layer: int


def check_received(
    layout: KVLayout, views: dict[Part, np.ndarray], dst_pages: np.ndarray, positions: np.ndarray,
    units: list[tuple[str, int]], sums: np.ndarray,
) -> list[Failure]:
    """Check every received page of every unit: `views[part]` is the destination
    [slots, pages, page_bytes], `dst_pages[position]` the page a position landed
    in, `sums` [units, positions] what prefill sent. ValueError when `units` is not
    the layout's (both sides must agree on what a checksum covers). O(bytes)."""
    mine = [(p.value, layer) for p, layer in units_of(layout)]
    got_units = [(str(part), int(layer)) for part, layer in units]
    if got_units != mine:
        raise ValueError(f"checksum units differ: prefill sent {got_units[:8]}..., this side has {mine[:8]}...")
    failures: list[Failure] = []
    pages = dst_pages[positions]
    for u, (part, layer) in enumerate(units_of(layout)):
        slot = layout.part(part).slot(layer)
        got = checksum.checksums(views[part][slot][pages], part, layer)
        for i in np.flatnonzero(got != sums[u]):
            failures.append(Failure(int(positions[i]), part.value, layer))
    return failures
