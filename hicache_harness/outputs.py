"""Result files written atomically: a reader sees the old file or the whole
new one, and no temporary file survives a failure."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hicache_harness import lifetime
from hicache_harness.errors import InputError


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside `path`; renamed over it when the block succeeds,
    removed when it raises. The parent directory is created if missing. An
    OSError while writing (ENOSPC, EDQUOT, EROFS, EFBIG...) is `InputError`
    naming the path: the output's place, not the program, is at fault.

    Refuses (ValueError) to replace anything but a regular file: a symlink, a
    device node (/dev/null), a FIFO or a socket at `path` stays as it is."""
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise ValueError(f"{path}: not a regular file (symlink, device, FIFO or socket); refusing to replace it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise InputError(f"{path}: cannot write: {exc.strerror or exc}") from None
    os.close(fd)
    try:
        yield Path(tmp)
        lifetime.raise_if_interrupted()  # an interrupted run commits no result
        os.replace(tmp, path)
    except OSError as exc:  # a full disk, a quota, a read-only mount: the environment, not a bug
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise InputError(f"{path}: cannot write: {exc.strerror or exc}") from None
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: Path, obj: Any, *, default: Callable[[Any], Any] = str) -> None:
    """`obj` as indented JSON at `path`, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, default=default) + "\n")
