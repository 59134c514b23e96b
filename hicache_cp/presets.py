"""The models hicache-cp knows by name: a model's KV geometry (`ModelLayout`,
bytes per token per layer of each part) and the presets `Config.model` names.

`Config.model_layout` overrides a preset field by field (a TOML table or a
dict), checked here with the field that is wrong."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hicache_cp.errors import ConfigError
from hicache_cp.layout import KVLayout


@dataclass(frozen=True)
class ModelLayout:
    """A model's KV geometry (bytes per token per layer of each part)."""

    name: str
    num_layers: int
    kv_bytes_per_token: int
    state_bytes_per_token: int = 0
    state_layers: tuple[int, ...] | None = None  # None: every layer owns NSA state
    draft_layers: int = 0
    draft_kv_bytes_per_token: int = 0
    draft_state_bytes_per_token: int = 0
    draft_state_layers: tuple[int, ...] | None = None  # None: every draft layer owns NSA state

    def layout(self, page_size: int) -> KVLayout:
        return KVLayout.build(
            page_size=page_size,
            num_layers=self.num_layers,
            kv_bytes_per_token=self.kv_bytes_per_token,
            state_bytes_per_token=self.state_bytes_per_token,
            state_layers=self.state_layers,
            draft_layers=self.draft_layers,
            draft_kv_bytes_per_token=self.draft_kv_bytes_per_token,
            draft_state_bytes_per_token=self.draft_state_bytes_per_token,
            draft_state_layers=self.draft_state_layers,
        )


PRESETS: dict[str, ModelLayout] = {
    # Small enough to replay a whole trace on a CPU; every part present, and
    # index skip (state on alternate layers) so compaction is exercised.
    "tiny": ModelLayout(
        name="tiny",
        num_layers=4,
        kv_bytes_per_token=16,
        state_bytes_per_token=8,
        state_layers=(0, 2),
        draft_layers=1,
        draft_kv_bytes_per_token=16,
        draft_state_bytes_per_token=8,
    ),
    # DeepSeek-V3.2 class: MLA fp8 (512 fp8 + 16 scale + 128 rope) and the
    # NSA indexer's index K (128 fp8 + 4 scale) on every layer, one MTP layer.
    "deepseek-v3.2": ModelLayout(
        name="deepseek-v3.2",
        num_layers=61,
        kv_bytes_per_token=656,
        state_bytes_per_token=132,
        draft_layers=1,
        draft_kv_bytes_per_token=656,
        draft_state_bytes_per_token=132,
    ),
}


def override_layout(base: ModelLayout, over: dict[str, Any]) -> ModelLayout:
    names = {f.name for f in dataclasses.fields(ModelLayout)}
    unknown = sorted(set(over) - names)
    if unknown:
        raise ConfigError(f"model_layout: unknown field(s) {unknown}; known: {', '.join(sorted(names))}")
    over = dict(over)
    lists = {"state_layers", "draft_state_layers"}
    for name in lists:
        if over.get(name) is not None:
            layers = over[name]
            if not isinstance(layers, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
                raise ConfigError(f"model_layout.{name}: expected a list of layer ids, got {layers!r}")
            over[name] = tuple(layers)
    for name in names - {"name"} - lists:
        if name in over and (not isinstance(over[name], int) or isinstance(over[name], bool)):
            raise ConfigError(f"model_layout.{name}: expected an integer, got {over[name]!r}")
    if "name" in over and not isinstance(over["name"], str):
        raise ConfigError(f"model_layout.name: expected a string, got {over['name']!r}")
    return dataclasses.replace(base, **over)
