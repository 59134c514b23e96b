"""Rank-uniform decisions for in-flight ops (DOMAIN.md rule 7).

Each `poll()` condenses every in-flight op into a `Vote` per rank (`ok`: no
failure seen; `settled`: nothing in flight and either fully landed or
failing) and reduces all votes with one MIN all-reduce over a small packed
tensor, so a failure (0) on any rank wins and every rank applies the same
decision at the same step:

    agreed ok and settled  -> commit (backup) / done (load)
    agreed not ok, settled -> abort and release, on every rank together
    agreed not ok          -> stop submitting (FAILING), wait for the drain
    otherwise              -> still in flight

Ops are listed in creation order, which every rank shares because the cache
metadata is replicated. At most one collective per poll, none when no op is
in flight.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from hicache_cp.errors import ConsistencyError



@dataclass(frozen=True)
class Vote:
    """One rank's view of one op: `ok` (no failure seen) and `settled`
    (nothing in flight and either every layer landed or the op is failing)."""

    ok: bool
    settled: bool


class Agreement(abc.ABC):
    rank: int = 0
    world_size: int = 1

    @abc.abstractmethod
    def reduce(self, votes: Sequence[Vote]) -> list[Vote]:
        """Element-wise MIN of every rank's votes (same length on every rank)."""


class LocalAgreement(Agreement):
    """A single rank agrees with itself."""

    def reduce(self, votes: Sequence[Vote]) -> list[Vote]:
        return list(votes)


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
        import torch

        n = len(votes)
        packed = torch.empty(2 * n + 1, dtype=torch.int32)
        packed[0] = n
        for i, v in enumerate(votes):
            packed[1 + 2 * i] = int(v.ok)
            packed[2 + 2 * i] = int(v.settled)
        # The op count rides along so that ranks whose op lists diverged are
        # caught (a bug) instead of silently mixing two ops' votes.
        check = torch.tensor([n, -n], dtype=torch.int32)
        buf = torch.cat([check, packed]).to(self.device)
        self._dist.all_reduce(buf, op=self._dist.ReduceOp.MIN, group=self.group)
        self.collectives += 1
        out = buf.cpu()
        if int(out[0]) != n or int(-out[1]) != n:
            raise ConsistencyError(
                "CP ranks disagree on the number of in-flight ops",
                rank=self.rank,
                details={"local_ops": n, "min_ops": int(out[0]), "max_ops": int(-out[1])},
            )
        body = out[3:]
        return [Vote(ok=bool(body[2 * i]), settled=bool(body[2 * i + 1])) for i in range(n)]
