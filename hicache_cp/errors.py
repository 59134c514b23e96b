"""The project's exceptions.

`ValueError`/`TypeError` are used for bad input from callers; the classes here
are for broken consistency inside the cache: they carry the context an
operator needs (node, pages, part, layer, rank) and are never turned into a
silent miss or a partial hit (docs/invariants.md rule 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class HiCacheError(Exception):
    """Base class of every error hicache-cp raises on purpose."""


@dataclass
class ConsistencyError(HiCacheError):
    """Parts, layers or ranks of one logical KV object disagree.

    Raised instead of returning a partial or target-only hit. Every field that
    is known at the raise site is filled in; the message lists them all.
    """

    what: str
    node: int | None = None
    pages: object = None
    part: str | None = None
    layer: int | None = None
    rank: int | None = None
    details: dict[str, object] = field(default_factory=dict)

    def __str__(self) -> str:
        ctx = [
            f"{k}={v}"
            for k, v in (
                ("node", self.node),
                ("pages", _short(self.pages)),
                ("part", self.part),
                ("layer", self.layer),
                ("rank", self.rank),
            )
            if v is not None
        ]
        ctx += [f"{k}={_short(v)}" for k, v in self.details.items()]
        return f"{self.what} ({', '.join(ctx)})" if ctx else self.what


class IllegalTransition(HiCacheError):
    """A state machine was asked for a transition its table does not allow."""


class ConfigError(HiCacheError, ValueError):
    """A configuration value is out of range; the message names the field."""


def _short(v: object, limit: int = 16) -> object:
    """Abbreviate long page arrays in error messages."""
    if hasattr(v, "tolist") and getattr(v, "ndim", 0) == 1:  # numpy: plain ints, not np.int64(...)
        v = v.tolist()  # type: ignore[union-attr]
    try:
        n = len(v)  # type: ignore[arg-type]
    except TypeError:
        return v
    if n <= limit:
        return list(v)  # type: ignore[call-overload]
    items = list(v[:limit])  # type: ignore[index]
    return f"{items}... ({n} total)"


@dataclass
class IntegrityError(HiCacheError):
    """Restored bytes (or a restored copy's identity) differ from what was stored.

    Raised where a restore is checked (`hicache_cp.checksum`): an L2 load, an L3
    get, a PD receive. `tier` names where the bad copy came from ("l2", "l3",
    "pd"); `pages` the pages that failed (host or source page ids, or request
    positions for PD), `units` how many (page, part, layer) units failed. An
    op that fails with it is aborted on every rank, and an L2 copy that failed
    is dropped (`hicache_cp.cache.eviction.Evictor.drop_host_copy`)."""

    what: str
    tier: str
    part: str | None = None
    layer: int | None = None
    rank: int | None = None
    pages: object = None
    units: int = 0
    request: object = None

    def __str__(self) -> str:
        ctx = [
            f"{k}={_short(v) if k == 'pages' else v}"
            for k, v in (("tier", self.tier), ("request", self.request), ("part", self.part), ("layer", self.layer),
                         ("rank", self.rank), ("pages", self.pages), ("units", self.units or None))
            if v is not None
        ]  # fmt: skip
        return f"{INTEGRITY_MARK} {self.what} ({', '.join(ctx)})"


#: How every IntegrityError's message starts (`io.verify.failure_from_report` finds
#: it in a failure reported across processes as text).
INTEGRITY_MARK = "integrity check failed:"


def integrity_error_of(exc: BaseException | None) -> IntegrityError | None:
    """The IntegrityError behind `exc` (itself, or its cause or context), if any."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, IntegrityError):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None
