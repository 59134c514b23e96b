"""One typed configuration for hicache-cp.

Sources, later ones winning: built-in defaults and the model preset, a TOML
file, environment variables `HICACHE_<FIELD>` (upper case, e.g.
`HICACHE_HOST_BUDGET_BYTES=8589934592`, `HICACHE_WRITE_POLICY=write_back`),
then command-line flags. `Config.resolve` returns the configuration with the
source of every field (for reports); every value is validated in
`__post_init__`; an error names the field, the value and the allowed range.

`host_budget_bytes = "auto"` sizes L2 from the memory this process may
really take (the cgroup limit or the machine, `hostmem.sizing`) minus
`host_reserve_bytes`, divided by the ranks sharing the machine
(`LOCAL_WORLD_SIZE`, else `cp_size`), and agreed across CP ranks (MIN).

TOML example::

    model = "deepseek-v3.2"
    page_size = 64
    host_budget_bytes = 214748364800   # per rank, all parts together (or "auto")
    host_reserve_bytes = 8589934592    # "auto" leaves this to the rest of the process
    l1_pages = 32768
    l1_free_room = 0.05                # fraction of capacity (or an int: pages)
    l2_free_room = 0.02
    write_policy = "write_through_selective"
    write_threshold = 2
    l2_exclusive = false               # write_back only: L1 and L2 hold disjoint pages
    eviction_policy = "lru"
    io_backend = "auto"
    verify_restores = "all"            # checksum every restored page: all, sample or off
    backup_submits_per_forward = 8     # per model and forward: fewer submit less often, trail longer

    [model_layout]                     # overrides of the preset
    state_layers = [0, 2, 4, 6]
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache_cp.checksum import Verify
from hicache_cp.errors import ConfigError
from hicache_cp.l3.config import L3Config
from hicache_cp.layout import KVLayout
from hicache_cp.presets import PRESETS, ModelLayout, override_layout

logger = logging.getLogger(__name__)

#: The default of `Config.backup_submits_per_forward` (`hicache_cp.ops.backup_layer_group`).
BACKUP_SUBMITS_PER_FORWARD = 8


class WritePolicy(enum.Enum):
    WRITE_THROUGH = "write_through"  # back up every new page, per layer, during the forward
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # back up once a node was hit `write_threshold` times
    WRITE_BACK = "write_back"  # back up when L1 evicts a node
    # With `l2_exclusive = true` (write_back only), a load from L2 gives up
    # the node's L2 copy once it is done and no request holds the node, so L1
    # and L2 hold disjoint pages and the cache holds L1 + L2 pages of content,
    # not L2; the node is backed up again when L1 evicts it (one more D2H per
    # L2 hit).


@dataclass
class Config:
    """Everything the cache needs; see the module docstring for sources."""

    model: str = "tiny"
    model_layout: ModelLayout | None = None  # filled from `model` unless given
    page_size: int = 16
    host_budget_bytes: int | str = 64 << 20  # or "auto": see the module docstring
    host_reserve_bytes: int = 8 << 30  # left to the process and container when the budget is "auto"
    l1_pages: int = 2048
    l1_free_room: float | int = 0.02
    l2_free_room: float | int = 0.02
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    write_threshold: int = 2
    l2_exclusive: bool = False  # write_back only: L1 and L2 hold disjoint pages (see WritePolicy)
    eviction_policy: str = "lru"
    io_backend: str = "auto"
    cp_size: int = 1
    debug_checks: bool = False
    pin_host: bool | None = None  # None: pin when CUDA is available
    l3: L3Config = field(default_factory=L3Config)  # the L3 tier ([l3] table); off by default
    pd_timeout_s: float = 300.0  # PD: seconds a transfer room may stay unfinished (docs/invariants.md rule 9)
    pd_per_layer: bool = False  # PD: send each layer from the forward's layer hooks, not after insert
    # Checksums of every stored (page, part, layer), checked before a restore counts:
    # all (every page), sample (L2 loads check one page in 8; L3 and PD every page), off
    # (docs/integrity.md).
    verify_restores: Verify = Verify.ALL
    # Per model and forward, how many times the layer hooks submit the backups of the layers
    # written so far (one engine call per op each time): fewer cost the forward's thread less
    # and let the copies trail the forward by more layers (`hicache_cp.ops.backup_layer_group`).
    backup_submits_per_forward: int = BACKUP_SUBMITS_PER_FORWARD
    # The node tier (docs/node-tier.md): L2 in a named shared segment every rank of the node maps,
    # one copy for replicated KV (TP ranks), kept across engine restarts. "" keeps private pools.
    node_segment: str = ""
    node_segment_dir: str = ""  # where it lives: "" picks /dev/shm or a hugetlbfs mount with room
    node_sharing: str = "auto"  # auto (replicated at cp_size 1, per_rank under CP), replicated, per_rank
    node_adopt: bool = True  # a restarted engine keeps what the segment holds (same layout, checks on)
    node_drop_on_close: bool = False  # an orderly close removes the segment (its last user does)
    node_numa: str = "auto"  # auto (interleave over several memory nodes), interleave, local
    node_model_id: str = ""  # the model's identity in the segment's fingerprint (default: `model`)

    def __post_init__(self) -> None:
        self.l3 = L3Config.from_value(self.l3)
        if isinstance(self.write_policy, str):
            self.write_policy = _enum(WritePolicy, "write_policy", self.write_policy)
        if not isinstance(self.write_policy, WritePolicy):
            raise ConfigError(f"write_policy: expected one of {', '.join(m.value for m in WritePolicy)}, "
                              f"got {self.write_policy!r}")  # fmt: skip
        if isinstance(self.verify_restores, str):
            self.verify_restores = _enum(Verify, "verify_restores", self.verify_restores)
        if not isinstance(self.verify_restores, Verify):
            raise ConfigError(f"verify_restores: expected one of {', '.join(m.value for m in Verify)}, "
                              f"got {self.verify_restores!r}")  # fmt: skip
        if self.model_layout is None:
            if self.model not in PRESETS:
                raise ConfigError(f"model: unknown preset {self.model!r}; presets: {', '.join(PRESETS)}")
            self.model_layout = PRESETS[self.model]
        for name in ("model", "eviction_policy", "io_backend"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name}: expected a string, got {getattr(self, name)!r}")
        if not isinstance(self.debug_checks, bool):
            raise ConfigError(f"debug_checks: expected true or false, got {self.debug_checks!r}")
        if not isinstance(self.l2_exclusive, bool):
            raise ConfigError(f"l2_exclusive: expected true or false, got {self.l2_exclusive!r}")
        if self.l2_exclusive and self.write_policy is not WritePolicy.WRITE_BACK:
            raise ConfigError(f"l2_exclusive needs write_policy = write_back, got {self.write_policy.value}")
        if not isinstance(self.pd_per_layer, bool):
            raise ConfigError(f"pd_per_layer: expected true or false, got {self.pd_per_layer!r}")
        if isinstance(self.pd_timeout_s, int) and not isinstance(self.pd_timeout_s, bool):
            self.pd_timeout_s = float(self.pd_timeout_s)
        if not isinstance(self.pd_timeout_s, float) or not 0.0 < self.pd_timeout_s <= 86400.0:
            raise ConfigError(f"pd_timeout_s: expected seconds in (0, 86400], got {self.pd_timeout_s!r}")
        if self.pin_host is not None and not isinstance(self.pin_host, bool):
            raise ConfigError(f"pin_host: expected true, false or auto, got {self.pin_host!r}")
        _check_node(self)
        _positive("page_size", self.page_size)
        if self.host_budget_bytes != "auto":
            _positive("host_budget_bytes", self.host_budget_bytes)
        _at_least("host_reserve_bytes", self.host_reserve_bytes, 0)
        _at_least("l1_pages", self.l1_pages, 2)
        _positive("write_threshold", self.write_threshold)
        _positive("cp_size", self.cp_size)
        _positive("backup_submits_per_forward", self.backup_submits_per_forward)
        for name in ("l1_free_room", "l2_free_room"):
            _free_room(name, getattr(self, name))
        from hicache_cp.policy import policy_names  # late: policy imports radix

        if self.eviction_policy not in policy_names():
            raise ConfigError(
                f"eviction_policy: unknown policy {self.eviction_policy!r}; supported: {', '.join(policy_names())}"
            )
        from hicache_cp.io.base import backend_names

        if self.io_backend not in ("auto", *backend_names()):
            raise ConfigError(
                f"io_backend: unknown backend {self.io_backend!r}; supported: auto, {', '.join(backend_names())}"
            )
        try:
            layout = self.layout()
            layout.check_aligned()
        except ValueError as exc:
            raise ConfigError(f"model_layout: {exc}") from None
        if self.l3.pages_per_object is None:  # what runs is recorded: the pages of MIN_OBJECT_TOKENS
            self.l3 = dataclasses.replace(self.l3, pages_per_object=self.l3.object_pages(self.page_size))
        if isinstance(self.host_budget_bytes, int) and self.host_budget_bytes < 2 * layout.bytes_per_page:
            raise ConfigError(
                f"host_budget_bytes: {self.host_budget_bytes} bytes is below two logical pages "
                f"({2 * layout.bytes_per_page} bytes: every layer of every part, page 0 is the dummy)"
            )

    def layout(self) -> KVLayout:
        assert self.model_layout is not None
        return self.model_layout.layout(self.page_size)

    def free_room_pages(self, tier: str, capacity: int) -> int:
        """The free-room target of `tier` ("l1" or "l2") in pages."""
        value = self.l1_free_room if tier == "l1" else self.l2_free_room
        return int(value * capacity) if isinstance(value, float) else int(value)

    def check_free_room(self, tier: str, capacity: int) -> None:
        """ConfigError when `tier`'s free-room target (a page count) is not below its
        `capacity` in pages: eviction would empty the tier after every allocation."""
        target = self.free_room_pages(tier, capacity)
        if target >= capacity:
            raise ConfigError(f"{tier}_free_room: {target} pages kept free, but {tier.upper()} holds {capacity} "
                              f"pages; give a fraction in [0, 1) or fewer pages")

    def check_host(self, *, cuda: bool, memory_bytes: int | None = None) -> None:
        """ConfigError for what this process cannot honour: an io backend that
        copies with CUDA, or `pin_host = true`, without CUDA; a fixed
        `host_budget_bytes` above all the memory of this machine or container
        (`memory_bytes`, default `hostmem.sizing`'s total)."""
        from hicache_cp.io.base import CUDA_BACKENDS

        if not cuda and self.io_backend in CUDA_BACKENDS:
            raise ConfigError(f"io_backend: {self.io_backend} copies with CUDA, which this process does not have "
                              "(use cpu or auto)")
        if not cuda and self.pin_host is True:
            raise ConfigError("pin_host: true needs CUDA to pin host memory, which this process does not have "
                              "(use false or auto)")
        if isinstance(self.host_budget_bytes, int):
            if memory_bytes is None:
                from hostmem.sizing import host_memory

                memory_bytes = host_memory(reserve_bytes=0).total_bytes
            if self.host_budget_bytes > memory_bytes:
                raise ConfigError(f"host_budget_bytes: {self.host_budget_bytes / 2**30:.4g} GiB per rank, but this "
                                  f"machine (or container) has {memory_bytes / 2**30:.4g} GiB in all")

    # ---- sources ------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        env: dict[str, str] | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> Config:
        """Build from a TOML file, then `HICACHE_*` variables, then `overrides`."""
        return cls.resolve(path, env, overrides).config

    @classmethod
    def resolve(
        cls,
        path: str | Path | None = None,
        env: dict[str, str] | None = None,
        overrides: dict[str, Any] | None = None,
        overrides_source: str = "cli",
        *,
        defaults: dict[str, Any] | None = None,
        defaults_source: str = "default",
        fixed: dict[str, Any] | None = None,
        fixed_source: str = "fixed",
    ) -> ResolvedConfig:
        """`load`, and where each field's value came from.

        Sources: "default", "preset" (the model's layout), `defaults_source`
        for `defaults` (a command's own defaults, below the TOML),
        "toml:<path>", "env:HICACHE_<FIELD>", `overrides_source` for
        `overrides` (entries whose value is None are unset), and `fixed_source`
        for `fixed`: fields the program that runs fixes (an engine's model); a
        source above `defaults` that gives one of them another value is refused
        (ConfigError), never silently overridden."""
        values: dict[str, Any] = dict(defaults or {})
        sources: dict[str, str] = dict.fromkeys(values, defaults_source)
        if path is not None:
            try:
                with open(path, "rb") as f:
                    loaded = tomllib.load(f)
            except FileNotFoundError:
                raise ConfigError(f"config file {path} does not exist") from None
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"config file {path}: {exc}") from None
            except UnicodeDecodeError as exc:  # TOML is UTF-8 text
                raise ConfigError(f"config file {path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
            except OSError as exc:
                raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
            _check_toml_types(loaded, f"toml:{path}")
            l3_table = loaded.pop("l3", None)
            values.update(loaded)
            sources.update(dict.fromkeys(loaded, f"toml:{path}"))
            if l3_table is not None:
                _merge_l3(values, sources, L3Config.table(l3_table), f"toml:{path}")
        env_values, env_l3 = _from_env(os.environ if env is None else env)
        values.update(env_values)
        sources.update({k: f"env:HICACHE_{k.upper()}" for k in env_values})
        for k, v in env_l3.items():
            _merge_l3(values, sources, {k: v}, f"env:HICACHE_L3_{k.upper()}")
        given = {k: v for k, v in (overrides or {}).items() if v is not None}
        for k, v in given.items():
            if k.startswith("l3."):  # --set l3.FIELD=VALUE
                _merge_l3(values, sources, {k[3:]: L3Config.coerce(k[3:], v) if isinstance(v, str) else v},
                          overrides_source)  # fmt: skip
            elif k == "l3" and isinstance(v, dict):
                _merge_l3(values, sources, L3Config.table(v), overrides_source)
            else:
                values[k] = v
                sources[k] = overrides_source
        for k, v in (fixed or {}).items():
            if sources.get(k, defaults_source) != defaults_source:
                _check_fixed(k, values[k], v, sources[k], fixed_source)
            values[k] = v
            sources[k] = fixed_source
        try:
            config = cls.from_dict(values)
        except ConfigError as exc:
            raise ConfigError(_with_source(str(exc), sources)) from None
        for f in dataclasses.fields(cls):
            sources.setdefault(f.name, "preset" if f.name == "model_layout" else "default")
        return ResolvedConfig(config, sources)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Config:
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; known: {', '.join(sorted(known))}")
        values = dict(values)
        model = values.get("model", "tiny")
        if model not in PRESETS:
            raise ConfigError(f"model: unknown preset {model!r}; presets: {', '.join(PRESETS)}")
        layout_over = values.pop("model_layout", None)
        if isinstance(layout_over, dict):
            values["model_layout"] = override_layout(PRESETS[model], layout_over)
        elif isinstance(layout_over, ModelLayout):
            values["model_layout"] = layout_over
        elif layout_over is not None:
            raise ConfigError(f"model_layout: expected a table of layout fields, got {layout_over!r}")
        for name, value in list(values.items()):
            values[name] = _coerce(name, known[name].type, value)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["write_policy"] = self.write_policy.value
        d["verify_restores"] = self.verify_restores.value
        return d


@dataclass(frozen=True)
class ResolvedConfig:
    """A configuration and the source of each of its fields."""

    config: Config
    sources: dict[str, str]

    def check(self, check: Callable[[Config], None]) -> None:
        """Run `check(config)` (e.g. `Config.check_free_room`); its ConfigError names the field's source."""
        try:
            check(self.config)
        except ConfigError as exc:
            raise ConfigError(_with_source(str(exc), self.sources)) from None

    def report(self) -> dict[str, dict[str, Any]]:
        """{field: {"value": ..., "source": ...}}, JSON-ready, for result files."""
        values = self.config.to_dict()
        out = {name: {"value": _jsonable(values[name]), "source": self.sources[name]} for name in values}
        out["l3"]["sources"] = {name: self.sources.get(f"l3.{name}", "default") for name in values["l3"]}
        return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


#: Set to 1 (true, yes, on) to refuse an unknown `HICACHE_*` variable instead of warning.
STRICT_ENV = "HICACHE_STRICT_ENV"
#: `HICACHE_*` variables that are not config fields (read where they are used).
#: Any other `HICACHE_*` variable is ignored with a WARNING naming the closest
#: setting (once per process), as vLLM does for `VLLM_*`: a machine where
#: another program sets such a variable can still run hicache-cp. With
#: `HICACHE_STRICT_ENV=1` it is refused (ConfigError), as vLLM's
#: `fail_on_environ_validation` does: a misspelt setting then stops the run.
NON_FIELD_ENV = frozenset({
    STRICT_ENV,  # config: refuse unknown HICACHE_* variables
    "HICACHE_CP_RANK_TIMEOUT_S",  # hicache_harness.launch: deadline of a multi-process run
    "HICACHE_CP_PD_AUTHKEY",  # hicache_harness.decode_peer: the control channel's secret
    "HICACHE_COMMIT",  # hicache_harness.provenance: the commit recorded in results
    "HICACHE_CP_CONFIG",  # integrations.sglang: the TOML file the plug-in reads
    "HICACHE_CP_METRICS_PORT",  # integrations.sglang: the metrics endpoint's base port
    "HICACHE_PEERS",  # scripts/setup.sh: install vLLM and SGLang or not
})  # fmt: skip


def _from_env(env: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(top-level fields, [l3] fields) from `HICACHE_<FIELD>` and `HICACHE_L3_<FIELD>`;
    an unknown `HICACHE_*` variable is a WARNING naming the closest field (ConfigError
    under `HICACHE_STRICT_ENV`, see `NON_FIELD_ENV`). Nothing outside the prefix is read."""
    import difflib

    strict = _flag(env, STRICT_ENV)
    fields = {f"HICACHE_{f.name.upper()}": f.name for f in dataclasses.fields(Config) if f.name not in ("model_layout", "l3")}
    l3_fields = {f"HICACHE_L3_{name.upper()}": name for name in L3Config.field_names()}
    out: dict[str, Any] = {}
    l3: dict[str, Any] = {}
    for key in sorted(k for k in env if k.startswith("HICACHE_")):
        raw = env[key]
        if key in fields:
            out[fields[key]] = raw
        elif key in l3_fields:
            l3[l3_fields[key]] = L3Config.coerce(l3_fields[key], raw, source=f"env:{key}")
        elif key not in NON_FIELD_ENV:
            names = [*fields, *l3_fields, *NON_FIELD_ENV]  # compared without the prefix they all share
            close = difflib.get_close_matches(key[8:], [n[8:] for n in names], n=1)
            hint = f"; did you mean HICACHE_{close[0]}?" if close else ""
            message = f"environment variable {key} is not a hicache-cp setting{hint}"
            if strict:
                raise ConfigError(f"{message} ({STRICT_ENV} refuses unknown HICACHE_* variables)")
            if key not in _WARNED:
                _WARNED.add(key)
                logger.warning("%s; ignored (%s=1 refuses it)", message, STRICT_ENV)
    return out, l3


#: Unknown variables already warned about in this process.
_WARNED: set[str] = set()


def _flag(env: Any, key: str) -> bool:
    """A boolean variable: unset, 0/false/no/off or 1/true/yes/on; ConfigError otherwise."""
    raw = str(env.get(key, "")).strip().lower()
    if raw not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
        raise ConfigError(f"{key}={env[key]!r}: expected 1 or 0 (true/false, yes/no, on/off)")
    return raw in ("1", "true", "yes", "on")


def _check_toml_types(loaded: dict[str, Any], source: str) -> None:
    """TOML has types: a string where a number or a boolean belongs is an error
    (only the environment and the command line spell values as strings)."""
    strings_ok = {"model", "eviction_policy", "io_backend", "write_policy", "verify_restores", "host_budget_bytes", "l3",
                  "model_layout", "node_segment", "node_segment_dir", "node_sharing", "node_numa", "node_model_id"}
    for name, value in loaded.items():
        if isinstance(value, str) and name not in strings_ok:
            raise ConfigError(f"{name}: expected a {'boolean' if name in _BOOL_FIELDS else 'number'}, "
                              f"got the string {value!r} (from {source})")  # fmt: skip
    if loaded.get("host_budget_bytes", "auto") != "auto" and isinstance(loaded["host_budget_bytes"], str):
        raise ConfigError(f"host_budget_bytes: expected a number of bytes or \"auto\", "
                          f"got {loaded['host_budget_bytes']!r} (from {source})")  # fmt: skip


_BOOL_FIELDS = frozenset({"l2_exclusive", "debug_checks", "pin_host", "node_adopt", "node_drop_on_close"})


def _check_node(config: Config) -> None:
    """The node tier's fields (`hicache_cp.node`)."""
    from hicache_cp.node.geometry import Sharing
    from hostmem.numa import NumaPolicy
    from hostmem.segment import check_name

    for name in ("node_segment", "node_segment_dir", "node_sharing", "node_numa", "node_model_id"):
        if not isinstance(getattr(config, name), str):
            raise ConfigError(f"{name}: expected a string, got {getattr(config, name)!r}")
    for name in ("node_adopt", "node_drop_on_close"):
        if not isinstance(getattr(config, name), bool):
            raise ConfigError(f"{name}: expected true or false, got {getattr(config, name)!r}")
    if config.node_segment:
        try:
            check_name(config.node_segment)
        except ValueError as exc:
            raise ConfigError(f"node_segment: {exc}") from None
    if config.node_segment_dir and not os.path.isdir(config.node_segment_dir):
        raise ConfigError(f"node_segment_dir: {config.node_segment_dir!r} is not a directory")
    for name, kind in (("node_sharing", Sharing), ("node_numa", NumaPolicy)):
        if getattr(config, name) not in {m.value for m in kind}:
            raise ConfigError(f"{name}: unknown value {getattr(config, name)!r}; allowed: {', '.join(m.value for m in kind)}")
    if config.node_sharing == Sharing.REPLICATED.value and config.cp_size != 1:
        raise ConfigError(f"node_sharing: replicated keeps one copy of the same KV; CP ranks (cp_size "
                          f"{config.cp_size}) hold different pages: use per_rank or auto")  # fmt: skip


def _merge_l3(values: dict[str, Any], sources: dict[str, str], fields: dict[str, Any], source: str) -> None:
    """Layer `fields` of the [l3] table over what earlier sources gave, field by field."""
    table = dict(values.get("l3") or {})
    table.update(fields)
    values["l3"] = table
    sources["l3"] = source
    for name in fields:
        sources[f"l3.{name}"] = source


def _with_source(message: str, sources: dict[str, str]) -> str:
    """`message` ("field: ...", "l3.field ...": it starts with the field) with the source of that field appended."""
    head = re.match(r"[\w.]*", message.strip()).group(0)  # type: ignore[union-attr]
    source = sources.get(head) or sources.get(head.split(".", 1)[0])
    if source is None or "(from " in message:
        return message
    return f"{message} (from {source})"


def _check_fixed(name: str, given: Any, fixed: Any, source: str, fixed_source: str) -> None:
    """`given` (from `source`) must mean `fixed`, the value `fixed_source` runs with."""
    if name != "model_layout":  # a layout table is never the same as a whole fixed layout
        given = _coerce(name, {f.name: f for f in dataclasses.fields(Config)}[name].type, given)
    if given != fixed:
        shown = getattr(fixed, "name", fixed)
        raise ConfigError(f"{name} = {getattr(given, 'name', given)!r} (from {source}) contradicts {fixed_source}, "
                          f"which runs with {name} = {shown!r}; drop it or give {shown!r}")


def _coerce(name: str, type_: Any, value: Any) -> Any:
    """Turn strings (env, CLI) into the field's type; leave typed values alone."""
    if not isinstance(value, str):
        if name in ("l1_free_room", "l2_free_room") and isinstance(value, bool):
            raise ConfigError(f"{name}: expected a fraction or a page count, got {value!r}")
        return value
    t = str(type_)
    try:
        if name in ("l1_free_room", "l2_free_room"):
            return float(value) if any(c in value for c in ".eE") else int(value)
        if name == "host_budget_bytes":
            return value if value.strip() == "auto" else int(value)
        if t.startswith("bool"):
            return _bool(name, value)
        if t == "int":
            return int(value)
        if t == "float":
            return float(value)
    except ValueError:
        raise ConfigError(f"{name}: expected {t}, got {value!r}") from None
    return value


def _bool(name: str, value: str) -> bool | None:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    if v in ("", "none", "auto"):
        return None
    raise ConfigError(f"{name}: expected true/false, got {value!r}")


def _enum(cls: type[enum.Enum], name: str, value: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        raise ConfigError(f"{name}: unknown value {value!r}; allowed: {', '.join(m.value for m in cls)}") from None


def _positive(name: str, value: object) -> None:
    _at_least(name, value, 1)


def _at_least(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name}: must be an integer >= {low}, got {value!r}")


def _free_room(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}: expected a fraction in [0, 1) or a page count >= 0, got {value!r}")
    if isinstance(value, float) and not 0.0 <= value < 1.0:
        raise ConfigError(f"{name}: a fraction must be in [0, 1), got {value}")
    if isinstance(value, int) and value < 0:
        raise ConfigError(f"{name}: a page count must be >= 0, got {value}")


