"""Context-parallel process groups: one process per CP rank.

Runs in: every CP rank's process. `hicache_harness.launch` spawns the ranks of a
replay on one machine; under torchrun each rank calls `init_process_group()`
with no arguments and the torchrun environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is used:

    group = init_process_group()             # or (rank, world_size, port=...)
    agreement = cp_agreement(group)          # DistributedAgreement on the right device
    cache = HiCache(config, rank=group.rank, agreement=agreement, device=group.device)
    ...
    destroy_process_group()

    torchrun --nproc-per-node 2 -m hicache_harness.torchrun --trace t.jsonl --l2-fraction 0.1

Backends: gloo when CUDA is absent (the agreement tensor stays on the CPU),
NCCL when it is present (the agreement tensor lives on the rank's GPU,
`cuda:LOCAL_RANK`). With NCCL, NVLink multicast (NVLS) is switched off
before the group is created (NCCL_NVLS_ENABLE=0): the agreement moves a few
bytes per poll, for which multicast buys nothing, and NVLS setup reserves
GPU memory and fails on hosts where it is not provisioned.

The rank-uniform decision rule (docs/invariants.md rule 7): every rank makes the same
cache calls in the same order (the radix tree, both page allocators and the
op lists are replicated metadata), and the only rank-local facts - whether
this rank's share of a copy landed or failed - are condensed into votes that
one MIN all-reduce per `HiCache.poll()` combines. A failure (0) on any rank
wins, so every rank commits, waits or aborts the same op at the same poll.
See `hicache_cp.cp.agreement` for the vote encoding and the op-count check.
Nothing in a path that ends in the collective may branch on rank-local state.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

from hicache_cp.cp.agreement import DistributedAgreement

DEFAULT_MASTER_ADDR = "127.0.0.1"
# A dead peer must surface as an error, not a half-hour hang in a collective
# (gloo's default); the launcher also watches its ranks and kills them.
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class CpGroup:
    """What one rank knows about its CP group after `init_process_group`."""

    rank: int
    world_size: int
    local_rank: int
    backend: str  # "gloo" or "nccl"
    device: str  # where this rank's L1 and the agreement tensor live: "cpu" or "cuda:N"


def free_port(host: str = DEFAULT_MASTER_ADDR) -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    port: int | None = None,
    master_addr: str | None = None,
    local_rank: int | None = None,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> CpGroup:
    """Join the CP group (blocks until all `world_size` ranks joined).

    Arguments left out come from the torchrun environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT); ValueError names what is missing.
    With NCCL the rank's GPU becomes the current device and NVLS is turned
    off. Idempotent for an already initialised group of the same shape.
    """
    import torch
    import torch.distributed as dist

    rank = _env_int("RANK") if rank is None else rank
    world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    local_rank = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a CP group of {world_size}")
    backend = backend or default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")
    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"a process group is already initialised as rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"asked for rank {rank} of {world_size}"
            )
        return _group(rank, world_size, local_rank, dist.get_backend())
    os.environ["MASTER_ADDR"] = master_addr or os.environ.get("MASTER_ADDR", DEFAULT_MASTER_ADDR)
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    elif "MASTER_PORT" not in os.environ:
        raise ValueError("no port: pass port= or set MASTER_PORT (torchrun sets it)")
    if backend == "nccl":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # multicast off (module docstring)
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent runs the store
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
    else:
        store = _store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world_size, timeout)
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout, store=store)
    return _group(rank, world_size, local_rank, backend)


def _store(host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta) -> object:
    """The group's TCPStore. Rank 0 serves it on a socket bound to `host` only:
    torch's own server binds every interface (IPv4 and IPv6 wildcards)
    whatever MASTER_ADDR says, so it gets a socket bound here instead."""
    import torch.distributed as dist

    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(max(128, world_size))
    fd = sock.detach()
    try:
        return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def _group(rank: int, world_size: int, local_rank: int, backend: str) -> CpGroup:
    device = f"cuda:{local_rank}" if backend == "nccl" else "cpu"
    return CpGroup(rank, world_size, local_rank, backend, device)


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"{name} is not set: pass it explicitly or run under torchrun")
    return int(value)


def cp_agreement(group: CpGroup | None = None) -> DistributedAgreement:
    """The MIN all-reduce agreement over the default group, on the backend's device."""
    import torch.distributed as dist

    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("cp_agreement() needs init_process_group() first")
        group = _group(dist.get_rank(), dist.get_world_size(),
                       int(os.environ.get("LOCAL_RANK", dist.get_rank())), dist.get_backend())
    return DistributedAgreement(device=group.device)


def destroy_process_group() -> None:
    """Leave the group (no-op when none is initialised)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
