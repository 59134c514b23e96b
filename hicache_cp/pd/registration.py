"""What each side of a PD transfer registers, and the check that both agree.

A :class:`RegistrationDescriptor` describes one set of buffers: an L1 device
pool, an L2 host pool, or the decode peer's destination buffers. It lists
the parts in registration order (docs/invariants.md rule 8)::

    kv buffers     target KV layers 0..L-1, then draft KV layers (draft_kv_start)
    state buffers  target NSA state (logical layer ids, compacted), then draft
                   state at draft_state_start, draft_state_count buffers

and for each part its logical layer ids, bytes per page per layer, slots,
page capacity, and each layer's base address and page stride. The address of
page q (physical) of compact slot s is ``bases[s] + q * page_stride``.

It is a plain dataclass that round-trips through JSON (`to_json`/`from_json`)
so the two sides can exchange it over the control channel.

`check_compatible(prefill, decode)` compares what must agree (page size,
parts, layer ids, page bytes, buffer counts and start indices) and raises
:class:`RegistrationMismatch` listing every disagreement with both sides'
values. Addresses and page capacities legitimately differ and are not
compared.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from hicache_cp.errors import HiCacheError
from hicache_cp.layout import PART_ORDER, KVLayout, Part

__all__ = ["PartRegistration", "RegistrationDescriptor", "RegistrationMismatch", "check_compatible"]


@dataclass
class PartRegistration:
    """One part's buffers: one per compact slot, laid out [pages, page_bytes]."""

    part: str
    layer_ids: list[int]
    page_bytes: int
    slots: int
    pages: int
    bases: list[int]
    page_stride: int

    def address(self, slot: int, page: int) -> int:
        return self.bases[slot] + page * self.page_stride


@dataclass
class RegistrationDescriptor:
    """Everything one side registered, in registration order. JSON-serialisable."""

    tier: str  # "L1", "L2" or "decode"
    page_size: int
    parts: list[PartRegistration]
    kv_count: int = 0
    draft_kv_start: int = 0
    draft_kv_count: int = 0
    state_count: int = 0
    draft_state_start: int = 0
    draft_state_count: int = 0
    extra: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        order = [p.part for p in self.parts]
        expected = [p.value for p in PART_ORDER if p.value in order]
        if order != expected:
            raise ValueError(f"{self.tier}: parts {order} are not in registration order {expected}")
        by = {p.part: p for p in self.parts}
        tkv, dkv = by.get(Part.TARGET_KV.value), by.get(Part.DRAFT_KV.value)
        tst, dst = by.get(Part.TARGET_STATE.value), by.get(Part.DRAFT_STATE.value)
        self.draft_kv_start = tkv.slots if tkv else 0
        self.draft_kv_count = dkv.slots if dkv else 0
        self.kv_count = self.draft_kv_start + self.draft_kv_count
        self.draft_state_start = tst.slots if tst else 0
        self.draft_state_count = dst.slots if dst else 0
        self.state_count = self.draft_state_start + self.draft_state_count

    # -- construction ------------------------------------------------------
    @classmethod
    def from_buffers(cls, tier: str, layout: KVLayout, bases: dict[Part, int], pages: int) -> RegistrationDescriptor:
        """Describe per-part contiguous buffers [slots, pages, page_bytes] at `bases`."""
        parts = []
        for p in layout.parts:
            layer_bytes = pages * p.page_bytes
            parts.append(PartRegistration(
                part=p.part.value, layer_ids=list(p.layer_ids), page_bytes=p.page_bytes, slots=p.num_slots,
                pages=pages, bases=[bases[p.part] + s * layer_bytes for s in range(p.num_slots)],
                page_stride=p.page_bytes))
        return cls(tier, layout.page_size, parts)

    @classmethod
    def from_device_pool(cls, pool: object) -> RegistrationDescriptor:
        """L1: a `DevicePool`, one buffer per layer (host tensors on CPU)."""
        layout: KVLayout = pool.layout  # type: ignore[attr-defined]
        parts = [
            PartRegistration(
                part=p.part.value, layer_ids=list(p.layer_ids), page_bytes=p.page_bytes, slots=p.num_slots,
                pages=pool.physical_pages,  # type: ignore[attr-defined]
                bases=[pool.layer_ptr(p.part, s) for s in range(p.num_slots)],  # type: ignore[attr-defined]
                page_stride=p.page_bytes)
            for p in layout.parts
        ]
        return cls("L1", layout.page_size, parts)

    @classmethod
    def from_host_pool(cls, pool: object) -> RegistrationDescriptor:
        """L2: a `HostPool` (one arena per part)."""
        bases = {part: int(arena.ptr) for part, arena in pool.arenas.items()}  # type: ignore[attr-defined]
        return cls.from_buffers("L2", pool.layout, bases, pool.physical_pages)  # type: ignore[attr-defined]

    # -- access ------------------------------------------------------------
    def part(self, part: Part) -> PartRegistration:
        for p in self.parts:
            if p.part == part.value:
                return p
        raise ValueError(f"{self.tier} registration has no part {part.value} (parts {[p.part for p in self.parts]})")

    def has_part(self, part: Part) -> bool:
        return any(p.part == part.value for p in self.parts)

    def regions(self) -> list[tuple[int, int]]:
        """(base, nbytes) of the memory to register with the engine: each
        part's layer buffers, adjacent ones merged (one region per part when
        the part is one contiguous buffer)."""
        out: list[tuple[int, int]] = []
        for p in self.parts:
            layer_bytes = p.pages * p.page_stride
            for base in p.bases:
                if out and out[-1][0] + out[-1][1] == base:
                    out[-1] = (out[-1][0], out[-1][1] + layer_bytes)
                else:
                    out.append((base, layer_bytes))
        return out

    # -- serialisation -----------------------------------------------------
    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> RegistrationDescriptor:
        d = dict(d)
        parts = [PartRegistration(**p) for p in d.pop("parts")]  # type: ignore[union-attr]
        for derived in ("kv_count", "draft_kv_start", "draft_kv_count", "state_count",
                        "draft_state_start", "draft_state_count"):
            d.pop(derived, None)
        return cls(parts=parts, **d)  # type: ignore[arg-type]

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, s: str) -> RegistrationDescriptor:
        return cls.from_dict(json.loads(s))


@dataclass
class RegistrationMismatch(HiCacheError):
    """The two sides registered different buffers; every disagreement is listed."""

    prefill_tier: str
    decode_tier: str
    differences: list[tuple[str, object, object]]  # (what, prefill value, decode value)

    def __str__(self) -> str:
        rows = "; ".join(f"{what}: prefill={a!r} decode={b!r}" for what, a, b in self.differences)
        return f"PD registration mismatch ({self.prefill_tier} vs {self.decode_tier}): {rows}"


def differences(prefill: RegistrationDescriptor, decode: RegistrationDescriptor) -> list[tuple[str, object, object]]:
    """Every disagreement as (what, prefill value, decode value); empty when compatible."""
    out: list[tuple[str, object, object]] = []

    def cmp(what: str, a: object, b: object) -> None:
        if a != b:
            out.append((what, a, b))

    cmp("page_size", prefill.page_size, decode.page_size)
    cmp("parts", [p.part for p in prefill.parts], [p.part for p in decode.parts])
    for attr in ("kv_count", "draft_kv_start", "draft_kv_count", "state_count", "draft_state_start",
                 "draft_state_count"):
        cmp(attr, getattr(prefill, attr), getattr(decode, attr))
    for part in PART_ORDER:
        a = prefill.part(part) if prefill.has_part(part) else None
        b = decode.part(part) if decode.has_part(part) else None
        if a is None and b is None:
            continue
        if a is None or b is None:
            cmp(f"{part.value} registered", a is not None, b is not None)
            continue
        cmp(f"{part.value} layer_ids", a.layer_ids, b.layer_ids)
        cmp(f"{part.value} page_bytes", a.page_bytes, b.page_bytes)
        cmp(f"{part.value} slots", a.slots, b.slots)
    return out


def check_compatible(prefill: RegistrationDescriptor, decode: RegistrationDescriptor) -> None:
    """Raise RegistrationMismatch listing every disagreement with both sides' values."""
    diffs = differences(prefill, decode)
    if diffs:
        raise RegistrationMismatch(prefill.tier, decode.tier, diffs)
