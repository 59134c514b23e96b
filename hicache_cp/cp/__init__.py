"""Context parallel (CP) shared KV: pages sharded over CP ranks.

Modules:

    mapping     logical <-> physical page ids and owners (pure numpy)
    agreement   the rank-uniform decision step: one MIN all-reduce of votes
    groups      joining the CP process group (torch.distributed, gloo or NCCL)

Nothing here knows the cache: the cache imports these, never the reverse.
"""

from hicache_cp.cp.agreement import Agreement, DistributedAgreement, LocalAgreement, Vote
from hicache_cp.cp.groups import CpGroup, cp_agreement, destroy_process_group, free_port, init_process_group

__all__ = [
    "Agreement",
    "CpGroup",
    "DistributedAgreement",
    "LocalAgreement",
    "Vote",
    "cp_agreement",
    "destroy_process_group",
    "free_port",
    "init_process_group",
]
