"""The logical KV object: which parts a cached page has, and their sizes.

A cached page is one logical object made of up to four parts (docs/invariants.md,
the KV object). Each part stores, for each of its layers, `page_bytes` opaque
bytes per page:

    part           model   layers                          bytes/token/layer
    target_kv      target  0 .. L-1                        e.g. 656 (MLA fp8)
    target_state   target  the layers that own NSA state   e.g. 132 (index K)
    draft_kv       draft   0 .. D-1 (draft numbering)      e.g. 656
    draft_state    draft   draft layers with NSA state     e.g. 132

Parts whose layers are a subset (index skip) are *compacted*: the part's
buffers hold only `len(layer_ids)` slots, and `slot(layer)` maps a logical
layer id to its compact slot. Every component that stores or moves bytes
goes through that mapping; nobody assumes slot == layer.

Target and draft share logical page ids, so one host reservation takes the
same number of pages from every part. The host byte budget is split so that
every part gets the same page capacity: draft token capacity then equals
target token capacity (docs/invariants.md rule 2), and the sum never exceeds the
budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import NewType

logger = logging.getLogger(__name__)

Layer = NewType("Layer", int)
"""A logical layer id of one model (target or draft numbering)."""


class Model(Enum):
    """Which model's forward pass writes a part (and whose hooks report it)."""

    TARGET = "target"
    DRAFT = "draft"

    # Members are singletons compared by identity; Enum's own __hash__ is a Python call,
    # and the layer hooks look parts and models up in dicts several times a layer.
    __hash__ = object.__hash__


class Part(Enum):
    """The parts of one logical KV page, in registration order."""

    TARGET_KV = "target_kv"
    TARGET_STATE = "target_state"
    DRAFT_KV = "draft_kv"
    DRAFT_STATE = "draft_state"

    __hash__ = object.__hash__  # as Model's

    @property
    def model(self) -> Model:
        return Model.TARGET if self in (Part.TARGET_KV, Part.TARGET_STATE) else Model.DRAFT


PART_ORDER: tuple[Part, ...] = tuple(Part)


@dataclass(frozen=True)
class PartLayout:
    """One part: its logical layer ids (ascending) and bytes per page per layer."""

    part: Part
    layer_ids: tuple[int, ...]
    bytes_per_token: int
    page_size: int
    _slots: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.bytes_per_token <= 0:
            raise ValueError(f"{self.part.value}: bytes_per_token must be > 0, got {self.bytes_per_token}")
        if not self.layer_ids:
            raise ValueError(f"{self.part.value}: a part needs at least one layer")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            dup = sorted({x for x in self.layer_ids if self.layer_ids.count(x) > 1})
            raise ValueError(f"{self.part.value}: duplicate layer ids {dup}")
        if list(self.layer_ids) != sorted(self.layer_ids):
            raise ValueError(f"{self.part.value}: layer ids must be ascending, got {list(self.layer_ids)}")
        object.__setattr__(self, "_slots", {layer: i for i, layer in enumerate(self.layer_ids)})

    @property
    def num_slots(self) -> int:
        return len(self.layer_ids)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer."""
        return self.bytes_per_token * self.page_size

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page over all of this part's layers."""
        return self.page_bytes * self.num_slots

    def slot(self, layer: int) -> int:
        """Compact slot of a logical layer id; ValueError if the part lacks it."""
        try:
            return self._slots[layer]
        except KeyError:
            raise ValueError(
                f"{self.part.value} has no layer {layer} (layers {list(self.layer_ids)})"
            ) from None

    def has_layer(self, layer: int) -> bool:
        return layer in self._slots


@dataclass(frozen=True)
class BudgetSplit:
    """How one host byte budget divides over the parts."""

    budget_bytes: int
    pages: int
    bytes_per_part: dict[Part, int]

    @property
    def used_bytes(self) -> int:
        return sum(self.bytes_per_part.values())


#: Bytes a page of every part is a multiple of (`KVLayout.check_aligned`).
PAGE_ALIGN = 8


@dataclass(frozen=True)
class KVLayout:
    """All parts of the logical object. Build with `KVLayout.build`."""

    page_size: int
    num_target_layers: int
    num_draft_layers: int
    parts: tuple[PartLayout, ...]

    @classmethod
    def build(
        cls,
        *,
        page_size: int,
        num_layers: int,
        kv_bytes_per_token: int,
        state_bytes_per_token: int = 0,
        state_layers: tuple[int, ...] | None = None,
        draft_layers: int = 0,
        draft_kv_bytes_per_token: int = 0,
        draft_state_bytes_per_token: int = 0,
        draft_state_layers: tuple[int, ...] | None = None,
    ) -> KVLayout:
        """Validate a model description and build its layout.

        `state_layers=None` means every target layer owns NSA state; a tuple
        lists the logical ids of the layers that do (index skip). A zero
        `*_state_bytes_per_token` means the model has no such part.
        """
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        if num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {num_layers}")
        if draft_layers < 0:
            raise ValueError(f"draft_layers must be >= 0, got {draft_layers}")
        parts = [PartLayout(Part.TARGET_KV, tuple(range(num_layers)), kv_bytes_per_token, page_size)]
        if state_bytes_per_token:
            ids = _layer_ids("state_layers", state_layers, num_layers)
            parts.append(PartLayout(Part.TARGET_STATE, ids, state_bytes_per_token, page_size))
        if draft_layers:
            if draft_kv_bytes_per_token <= 0:
                raise ValueError("a draft model needs draft_kv_bytes_per_token > 0")
            parts.append(PartLayout(Part.DRAFT_KV, tuple(range(draft_layers)), draft_kv_bytes_per_token, page_size))
            if draft_state_bytes_per_token:
                ids = _layer_ids("draft_state_layers", draft_state_layers, draft_layers)
                parts.append(PartLayout(Part.DRAFT_STATE, ids, draft_state_bytes_per_token, page_size))
        elif draft_state_bytes_per_token:
            raise ValueError("draft_state_bytes_per_token set but the model has no draft layers")
        return cls(page_size, num_layers, draft_layers, tuple(parts))

    def check_aligned(self) -> None:
        """ValueError naming the first part whose page is not a multiple of
        `PAGE_ALIGN` bytes (what every tier, the copy engines and PD require)."""
        for p in self.parts:
            if p.page_bytes % PAGE_ALIGN:
                raise ValueError(f"{p.part.value} page of {p.page_bytes} bytes is not a multiple of {PAGE_ALIGN} "
                                 f"(bytes_per_token {p.bytes_per_token} x page_size {self.page_size})")

    def part(self, part: Part) -> PartLayout:
        for p in self.parts:
            if p.part is part:
                return p
        raise ValueError(f"layout has no part {part.value} (parts: {[p.part.value for p in self.parts]})")

    def has_part(self, part: Part) -> bool:
        return any(p.part is part for p in self.parts)

    def has_part_layer(self, part: Part, layer: int) -> bool:
        """The layout has `part` and it has logical `layer`."""
        return self.has_part(part) and self.part(part).has_layer(layer)

    def parts_of(self, model: Model) -> tuple[PartLayout, ...]:
        return tuple(p for p in self.parts if p.part.model is model)

    def num_layers(self, model: Model) -> int:
        return self.num_target_layers if model is Model.TARGET else self.num_draft_layers

    @property
    def bytes_per_page(self) -> int:
        """Host bytes of one logical page: every layer of every part."""
        return sum(p.bytes_per_page for p in self.parts)

    def split_budget(self, budget_bytes: int) -> BudgetSplit:
        """Split a host byte budget into equal page capacities for every part.

        Raises ValueError if the budget holds less than one page of every part.
        """
        pages = budget_bytes // self.bytes_per_page
        if pages < 1:
            raise ValueError(
                f"host budget of {budget_bytes} bytes is below one logical page "
                f"({self.bytes_per_page} bytes over all parts and layers)"
            )
        split = BudgetSplit(budget_bytes, pages, {p.part: pages * p.bytes_per_page for p in self.parts})
        assert split.used_bytes <= budget_bytes, (split.used_bytes, budget_bytes)
        return split

    def description(self) -> dict[str, object]:
        """The geometry that decides what stored bytes mean (JSON-ready): page size,
        layer counts, and each part's name, logical layer ids and bytes per token.
        Fingerprints of stored data (L3 keys, the node segment) are built on it."""
        return {
            "page_size": self.page_size,
            "target_layers": self.num_target_layers,
            "draft_layers": self.num_draft_layers,
            "parts": [[p.part.value, list(p.layer_ids), p.bytes_per_token] for p in self.parts],
        }

    def describe(self) -> str:
        rows = [
            f"{p.part.value}: {p.num_slots} layers x {p.page_bytes} B/page" for p in self.parts
        ]
        return f"page_size={self.page_size}; " + "; ".join(rows)


def _layer_ids(name: str, ids: tuple[int, ...] | None, num_layers: int) -> tuple[int, ...]:
    if ids is None:
        return tuple(range(num_layers))
    ids = tuple(int(x) for x in ids)
    bad = [x for x in ids if not 0 <= x < num_layers]
    if bad:
        raise ValueError(f"{name}: layer ids {bad} out of range [0, {num_layers})")
    return ids


def log_budget(layout: KVLayout, split: BudgetSplit, rank: int = 0) -> None:
    """Log the budget split once at start-up."""
    per_part = ", ".join(f"{p.value}={b / 2**20:.1f} MiB" for p, b in split.bytes_per_part.items())
    logger.info(
        "rank %d host budget %.1f MiB -> %d pages (%d tokens) per part; %s; unused %d B",
        rank,
        split.budget_bytes / 2**20,
        split.pages,
        split.pages * layout.page_size,
        per_part,
        split.budget_bytes - split.used_bytes,
    )
