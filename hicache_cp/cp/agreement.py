"""Rank-uniform decisions for in-flight ops (docs/invariants.md rule 7).

Each `poll()` condenses every in-flight op into a `Vote` per rank (`ok`: no
failure seen; `settled`: nothing in flight and either fully landed or
failing) and reduces all votes with a MIN all-reduce over a small packed
tensor, so a failure (0) on any rank wins and every rank applies the same
decision at the same step:

    agreed ok and settled  -> commit (backup) / done (load)
    agreed not ok, settled -> abort and release, on every rank together
    agreed not ok          -> stop submitting (FAILING), wait for the drain
    otherwise              -> still in flight

Ops are listed in creation order, which every rank shares because the cache
metadata is replicated. A poll with ops in flight costs two tiny collectives:
first the op count (a fixed-size [n, -n] MIN, so ranks whose op lists
diverged - a bug - are caught with both counts, where a vote tensor of
another length would break or hang the collective), then the votes. None
when no op is in flight.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hicache_cp.errors import ConsistencyError



@dataclass(frozen=True)
class Vote:
    """One rank's view of one op: `ok` (no failure seen), `settled` (nothing in
    flight and either every layer landed or the op is failing) and `intact` (no
    restore check failed: agreed False, every rank drops the bad copy)."""

    ok: bool
    settled: bool
    intact: bool = True


class Agreement(abc.ABC):
    rank: int = 0
    world_size: int = 1

    @abc.abstractmethod
    def reduce(self, votes: Sequence[Vote]) -> list[Vote]:
        """Element-wise MIN of every rank's votes (same length on every rank)."""

    @abc.abstractmethod
    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value`."""


class LocalAgreement(Agreement):
    """A single rank agrees with itself."""

    def reduce(self, votes: Sequence[Vote]) -> list[Vote]:
        return list(votes)

    def min_int(self, value: int) -> int:
        return value


class DistributedAgreement(Agreement):
    """MIN all-reduce over the CP group with torch.distributed (gloo or NCCL)."""

    def __init__(self, group: object | None = None, device: str = "cpu") -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("DistributedAgreement needs torch.distributed.init_process_group first")
        self._dist = dist
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.collectives = 0

    def reduce(self, votes: Sequence[Vote]) -> list[Vote]:
        n = len(votes)
        low, neg_high = self._all_min(np.array([n, -n], dtype=np.int32))
        if low != n or -neg_high != n:
            raise ConsistencyError(
                "CP ranks disagree on the number of in-flight ops",
                rank=self.rank,
                details={"local_ops": n, "min_ops": int(low), "max_ops": int(-neg_high)},
            )
        packed = np.array([(v.ok, v.settled, v.intact) for v in votes], dtype=np.int32).reshape(-1)
        out = self._all_min(packed)
        return [Vote(ok=bool(out[3 * i]), settled=bool(out[3 * i + 1]), intact=bool(out[3 * i + 2])) for i in range(n)]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. a host budget every rank can afford)."""
        return int(self._all_min(np.array([value], dtype=np.int64))[0])

    def _all_min(self, values: np.ndarray) -> np.ndarray:
        import torch

        buf = torch.from_numpy(values).to(self.device)
        self._dist.all_reduce(buf, op=self._dist.ReduceOp.MIN, group=self.group)
        self.collectives += 1
        return buf.cpu().numpy()
