"""`L3Config`: the L3 tier's section of the configuration (off by default).

TOML::

    [l3]
    backend = "mooncake"              # "none" (default): no L3
    master = "127.0.0.1:50051"        # the Mooncake master's RPC address
    protocol = "tcp"                  # "rdma" with device_name in production
    namespace = "hicache"             # key prefix: deployments sharing a master
    kv_dtype = "fp8"                  # part of the layout fingerprint
    pages_per_object = 8              # a run of pages grouped into one object (default: 512 tokens' worth)
    group_parts = true                # every part of a rank's pages in one object
    write_min_hits = 0                # write back pages hit at least this often
    write_queue_pages = 0             # bound of the write-back queue in pages (0: a quarter of L2)
    prefetch_wait = true              # a request waits for its prefetch (deadline); false: never
                                      # waits (a queued request's prefetch, `HiCache.prefetch_queued`)
    prefetch_timeout_s = 2.0          # deadline of one prefetch
    lookup_timeout_s = 0.5            # deadline of one existence lookup
    retry_interval_s = 1.0            # store down: probe again after this long
    connect_timeout_s = 5.0           # start-up: the master must accept a connection within this

Everything binds to loopback by default; the store's transfer engine uses the
P2P handshake (no HTTP metadata server).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from hicache_cp.errors import ConfigError

BACKENDS = ("none", "mooncake")

#: Bumped whenever the object byte layout or the key scheme changes: objects
#: written by another format version are never read (they have other keys).
FORMAT_VERSION = 1

#: Tokens an object holds at least by default (`pages_per_object` unset:
#: ceil(512 / page_size) pages). The store's master handles every key of
#: every lookup, get and put: at one page per object and page 64 a request
#: costs it about 600 item operations, 6 M/s for 100 nodes at 100 requests/s;
#: objects of 512 tokens keep it under 1 M/s (docs/integrations/l3.md, object size).
MIN_OBJECT_TOKENS = 512


@dataclass
class L3Config:
    """The L3 tier's knobs; `__post_init__` validates every field."""

    backend: str = "none"
    master: str = "127.0.0.1:50051"
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"  # "rdma" in production
    device_name: str = ""  # RDMA devices (empty for tcp)
    namespace: str = "hicache"
    kv_dtype: str = "opaque"
    pages_per_object: int | None = None  # None: ceil(MIN_OBJECT_TOKENS / page_size) (`object_pages`)
    group_parts: bool = True
    write_min_hits: int = 0
    write_queue_pages: int = 0  # 0: a quarter of L2 (pages held by puts in flight cannot be reused)
    prefetch_wait: bool = True
    prefetch_min_pages: int = 1
    prefetch_timeout_s: float = 2.0
    lookup_timeout_s: float = 0.5
    retry_interval_s: float = 1.0
    close_timeout_s: float = 15.0
    connect_timeout_s: float = 5.0  # the master must accept a connection within this at start-up
    #: After a store call failed in a way that may leave a transfer running
    #: (TRANSFER_FAIL, unknown codes), its L2 pages stay held this long.
    #: None: 0 over tcp (its transfers end with the call), 300 s over rdma.
    unsafe_hold_s: float | None = None
    segment_bytes: int = 0  # memory this client lends the store (0: a pure client)
    local_buffer_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        for name in ("backend", "master", "local_hostname", "protocol", "device_name", "namespace", "kv_dtype"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"l3.{name}: expected a string, got {getattr(self, name)!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"l3.backend: unknown backend {self.backend!r}; supported: {', '.join(BACKENDS)}")
        host, sep, port = self.master.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"l3.master: expected HOST:PORT, got {self.master!r}")
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"l3.protocol: expected tcp or rdma, got {self.protocol!r}")
        if not self.namespace or "/" in self.namespace:
            raise ConfigError(f"l3.namespace: a non-empty name without '/', got {self.namespace!r}")
        if "/" in self.kv_dtype or not self.kv_dtype:
            raise ConfigError(f"l3.kv_dtype: a non-empty name without '/', got {self.kv_dtype!r}")
        for name, low in (
            *((("pages_per_object", 1),) if self.pages_per_object is not None else ()),
            ("write_min_hits", 0),
            ("write_queue_pages", 0),
            ("prefetch_min_pages", 1),
            ("segment_bytes", 0),
            ("local_buffer_bytes", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"l3.{name}: must be an integer >= {low}, got {value!r}")
        for name in ("prefetch_timeout_s", "lookup_timeout_s", "retry_interval_s", "close_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"l3.{name}: must be a finite number of seconds > 0, got {value!r}")
        if self.unsafe_hold_s is not None and (
            isinstance(self.unsafe_hold_s, bool) or not isinstance(self.unsafe_hold_s, (int, float))
            or not 0 <= self.unsafe_hold_s < math.inf
        ):
            raise ConfigError(f"l3.unsafe_hold_s: must be a number of seconds >= 0, got {self.unsafe_hold_s!r}")
        for name in ("group_parts", "prefetch_wait"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"l3.{name}: expected true/false, got {getattr(self, name)!r}")

    def object_pages(self, page_size: int) -> int:
        """Pages per object: `pages_per_object`, else the fewest pages holding MIN_OBJECT_TOKENS."""
        return self.pages_per_object if self.pages_per_object is not None else -(-MIN_OBJECT_TOKENS // page_size)

    @property
    def enabled(self) -> bool:
        return self.backend != "none"

    @property
    def hold_after_unsafe_failure_s(self) -> float:
        if self.unsafe_hold_s is not None:
            return float(self.unsafe_hold_s)
        return 0.0 if self.protocol == "tcp" else 300.0

    @classmethod
    def from_value(cls, value: Any) -> L3Config:
        """An `L3Config` from itself, None (off) or a dict (a TOML section)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        return cls(**cls.table(value))

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def table(cls, value: Any) -> dict[str, Any]:
        """A checked [l3] table: known fields only; `enabled = true` means
        `backend = "mooncake"` (the only backend), `enabled = false` "none"."""
        if not isinstance(value, dict):
            raise ConfigError(f"l3: expected a table of L3 settings, got {value!r}")
        value = dict(value)
        if "enabled" in value:
            enabled = value.pop("enabled")
            if not isinstance(enabled, bool):
                raise ConfigError(f"l3.enabled: expected true/false, got {enabled!r}")
            backend = "mooncake" if enabled else "none"
            if value.setdefault("backend", backend) != backend:
                raise ConfigError(f"l3.enabled = {str(enabled).lower()} contradicts l3.backend = {value['backend']!r}")
        known = set(cls.field_names())
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"l3: unknown field(s) {unknown}; known: enabled, {', '.join(sorted(known))}")
        return value

    @classmethod
    def coerce(cls, name: str, raw: str, source: str = "") -> Any:
        """The value of field `name` spelt as a string (environment, --set), typed."""
        where = f" (from {source})" if source else ""
        if name == "enabled":
            name = "backend"
            raw = {"1": "mooncake", "true": "mooncake", "0": "none", "false": "none"}.get(raw.strip().lower(), raw)
        types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        if name not in types:
            raise ConfigError(f"l3: unknown field {name!r}{where}; known: {', '.join(sorted(types))}")
        t, v = types[name], raw.strip()
        try:
            if t == "bool":
                if v.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                    return v.lower() in ("1", "true", "yes", "on")
                raise ValueError(v)
            if t == "int":
                return int(v)
            if t.startswith("int"):  # int | None
                return None if v.lower() in ("", "none", "auto") else int(v)
            if t.startswith("float"):
                return None if v.lower() in ("", "none", "auto") and "None" in t else float(v)
        except ValueError:
            raise ConfigError(f"l3.{name}: expected {t}, got {raw!r}{where}") from None
        return raw
