"""What the two connector roles tell each other, once per engine step.

scheduler -> workers (`HiCacheMetadata`, bound to the workers before the forward):
    loads      `CopyJob`s: host pages -> vLLM blocks, H2D, waited per layer by the forward
    saves      `CopyJob`s: vLLM blocks -> host pages, D2H, submitted per layer by the hooks
    preempted  requests vLLM preempted this step: their blocks are free now, so the
               worker waits for their saves before this step's forward may write them
    delayed    finished requests whose blocks vLLM keeps (`request_finished` returned
               True) until every worker reports them through `get_finished`

workers -> scheduler (`HiCacheWorkerMetadata`, aggregated over the workers by vLLM):
    results  job id -> (workers that finished it, first error or None)

A load's verdict is reported in the step that ran it (vLLM's recompute path
needs the failed blocks in that step). A save's verdict is reported in the
first step whose end finds its copies settled, often a later one: saves
never block the host. The scheduler acts on a job once all `world_size`
workers reported it, whatever the steps their reports came in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class CopyJob:
    """One op of the scheduler's cache, to run in every worker."""

    job_id: int  # the scheduler-side op id
    req_id: str
    device_pages: np.ndarray  # vLLM block ids
    host_pages: np.ndarray  # L2 page ids (this worker's host pool)
    first_position: int  # request-absolute page position of the first page

    def __post_init__(self) -> None:
        if len(self.device_pages) != len(self.host_pages) or len(self.device_pages) == 0:
            raise ValueError(
                f"job {self.job_id} of {self.req_id}: {len(self.device_pages)} blocks for "
                f"{len(self.host_pages)} host pages; copies are never truncated"
            )


@dataclass
class HiCacheMetadata(KVConnectorMetadata):
    host_pages: int  # L2 capacity the scheduler allocates from; every worker's pool must match
    layout: str = ""  # the scheduler's `KVLayout.describe()`; every worker's must match
    loads: list[CopyJob] = field(default_factory=list)
    saves: list[CopyJob] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    delayed: list[str] = field(default_factory=list)


@dataclass
class HiCacheWorkerMetadata(KVConnectorWorkerMetadata):
    results: dict[int, tuple[int, str | None]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, HiCacheWorkerMetadata), type(other)
        merged = dict(self.results)
        for job, (count, error) in other.results.items():
            had_count, had_error = merged.get(job, (0, None))
            merged[job] = (had_count + count, had_error or error)
        return HiCacheWorkerMetadata(merged)
