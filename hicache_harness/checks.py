"""Input checks the commands run before any work: one line each, exit code 2.

Every check raises `InputError` naming the flag and the allowed range or
form; nothing here creates or writes a file.
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
from pathlib import Path

from hicache_harness.errors import InputError

GIB = 1 << 30


def positive(flag: str, value: float | None, *, limit: float | None = None) -> None:
    """None (unset) or a finite number > 0 (and <= limit)."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{flag} must be a finite number, got {value}")
    if value <= 0:
        raise InputError(f"{flag} must be > 0, got {value}")
    if limit is not None and value > limit:
        raise InputError(f"{flag} must be at most {limit:g}, got {value:g}")


def in_range(flag: str, value: float | None, low: float, high: float) -> None:
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{flag} must be a finite number, got {value}")
    if not low <= value <= high:
        raise InputError(f"{flag} must be in [{low:g}, {high:g}], got {value:g}")


def input_file(flag: str, path: Path | None) -> None:
    """An existing, readable regular file."""
    if path is None:
        return
    if not path.exists():
        raise InputError(f"{flag} {path}: no such file")
    if path.is_dir():
        raise InputError(f"{flag} {path}: is a directory, expected a file")
    if not os.access(path, os.R_OK):
        raise InputError(f"{flag} {path}: not readable")


#: Kernel file systems: a "file" there is an interface, never a place for a report.
_PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs",
    "pstore", "bpf", "fusectl", "mqueue", "efivarfs", "binfmt_misc", "autofs", "rpc_pipefs", "nsfs",
})  # fmt: skip


def _filesystem(path: Path) -> str:
    """The type of the file system `path` (an existing directory) is on, from /proc/self/mounts."""
    best, kind = "", ""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    target = str(path.resolve())
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind


def output_file(flag: str, path: Path | None) -> None:
    """A path the command can write at the end: a regular file or none yet (never
    a symlink, device node, FIFO or socket, which the atomic rename would
    replace), not on a kernel file system, and its nearest existing ancestor
    is a writable directory. Creates nothing."""
    if path is None:
        return
    if path.is_symlink():
        raise InputError(f"{flag} {path}: is a symbolic link; give the real path of a regular file")
    if path.is_dir():
        raise InputError(f"{flag} {path}: is a directory, expected a file path")
    if path.exists() and not path.is_file():
        raise InputError(f"{flag} {path}: is not a regular file (a device, FIFO or socket); refusing to replace it")
    if path.exists() and not os.access(path, os.W_OK):
        raise InputError(f"{flag} {path}: not writable")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: cannot create files in {parent}")
    kind = _filesystem(parent)
    if kind in _PSEUDO_FILESYSTEMS:
        raise InputError(f"{flag} {path}: {parent} is on a kernel file system ({kind}), not a place for files")


def ip_literal(flag: str, address: str | None) -> None:
    """An IPv4 or IPv6 address written out: a host name would mean a DNS look-up."""
    if address is None:
        return
    try:
        ipaddress.ip_address(address)
    except ValueError:
        raise InputError(f"{flag} {address!r}: expected an IP address such as 127.0.0.1 (host names are not looked up)") from None


def ports_free(flag: str, address: str, ports: range) -> None:
    """Every port of `ports` can be bound on `address` now (a port in use is found before the work, not after)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    for port in ports:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((address, port))
            except OSError as exc:
                raise InputError(f"{flag}: {address}:{port} is not free ({exc.strerror})") from None


def device(flag: str, name: str) -> str:
    """`auto`, `cpu`, `cuda` or `cuda:N`, checked against this machine; returns the device to use."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise InputError(f"{flag} {name}: this machine has no CUDA device (use cpu or auto)")
        index = name.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise InputError(f"{flag} {name}: the devices here are cuda:0..cuda:{torch.cuda.device_count() - 1}")
        return name
    raise InputError(f"{flag} {name!r}: expected auto, cpu, cuda or cuda:N")


def fits_host_memory(what: str, nbytes: int) -> None:
    """Refuse a host allocation larger than what this machine or container has available."""
    from hostmem.sizing import host_memory

    memory = host_memory(reserve_bytes=0)
    if nbytes > memory.available_bytes:
        raise InputError(
            f"{what} needs {nbytes / GIB:.2f} GiB of host memory but {memory.available_bytes / GIB:.2f} GiB "
            f"is available ({memory.describe()})"
        )


def fits_device_memory(what: str, nbytes: int, device: str) -> None:
    """Refuse a GPU allocation larger than the device's free memory."""
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    if nbytes > free:
        raise InputError(
            f"{what} needs {nbytes / GIB:.2f} GiB on {device} but {free / GIB:.2f} of {total / GIB:.2f} GiB is free"
        )
