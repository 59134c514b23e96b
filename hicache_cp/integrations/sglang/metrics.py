"""The plug-in's metrics: each request counted once, and the Prometheus endpoint.

SGLang matches a waiting request again every scheduling round (and its
priority policies match every waiting request), so the plug-in's matches
leave the cache's hit metrics alone (`match_prefix(count=False)`) and each
request is counted once, at its first forward (`RequestCounts`): its prompt
tokens, SGLang's device prefix as L1 and the admitted load as L2. A load that
fails afterwards is uncounted by the cache, as for any load.

`serve_metrics` starts the endpoint of `HICACHE_CP_METRICS_PORT`
(`settings.metrics_port`) in this scheduler process, at the base port plus
the process's torch.distributed rank, so a server's TP ranks never share one.
"""

from __future__ import annotations

from typing import Any

from hicache_cp import ConfigError, Exporter, HiCache, start_exporter
from hicache_cp.integrations.sglang.settings import METRICS_PORT_ENV


class RequestCounts:
    """The last match of each request not yet counted (see the module docstring)."""

    def __init__(self) -> None:
        # request handle -> [prompt tokens, SGLang's device pages, host pages its admitted load brings]
        self._last: dict[Any, list[int]] = {}

    def matched(self, handle: Any, tokens: int, device_pages: int) -> None:
        self._last[handle] = [tokens, device_pages, 0]

    def admitted(self, handle: Any, host_pages: int) -> None:
        if handle in self._last:
            self._last[handle][2] = host_pages

    def first_forward(self, handle: Any, cache: HiCache) -> None:
        """Count the request's last match, once."""
        last = self._last.pop(handle, None)
        if last is not None:
            cache.metrics.record_match(*last, cache.layout.page_size)

    def forget(self, handle: Any) -> None:
        self._last.pop(handle, None)

    def clear(self) -> None:
        self._last.clear()


def serve_metrics(cache: HiCache, port: int) -> Exporter:
    """The endpoint for `cache` at `port` + this process's rank (0: a free port), with
    SGLang's names. A failure closes `cache` (the plug-in is not built) and is a
    `ConfigError` naming the variable."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    try:
        return start_exporter(cache, port + rank if port else 0, naming="sglang")
    except (ImportError, OSError, ConfigError) as exc:
        cache.close()
        need = " (pip install 'hicache-cp[metrics]')" if isinstance(exc, ImportError) else ""
        raise ConfigError(f"{METRICS_PORT_ENV}={port}: rank {rank} cannot serve metrics: {exc}{need}") from exc
