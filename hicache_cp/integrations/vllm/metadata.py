"""What the two connector roles tell each other, once per engine step.

scheduler -> workers (`HiCacheMetadata`, bound to the workers before the forward):
    loads   `CopyJob`s: host pages -> vLLM blocks, H2D, waited per layer by the forward
    saves   `CopyJob`s: vLLM blocks -> host pages, D2H, submitted per layer by the hooks

workers -> scheduler (`HiCacheWorkerMetadata`, aggregated over the workers by vLLM):
    results  job id -> (workers that finished it, first error or None)

Every job a worker starts in a step has landed or failed when that step's
forward returns (`wait_for_save` waits for both directions), so each step's
report covers exactly the jobs of that step. The scheduler acts on a job
once all `world_size` workers reported it.
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
