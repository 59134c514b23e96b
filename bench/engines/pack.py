"""What the device packers share (bench/engines/vllm_pack.py, bench/engines/sglang_pack.py): a package tree
into a tarball, and wheels for the device image's Python 3.12 on manylinux x86-64."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

#: The manylinux x86-64 tags pip may pick for the device, newest first.
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64"]  # fmt: skip


def add_tree(tar: tarfile.TarFile, root: Path, prefix: str, skipped: Callable[[str], bool]) -> tuple[int, int, int]:
    """Every file under `root` as `prefix/<relative path>`, except those `skipped(relative path)`;
    (files kept, files skipped, bytes kept)."""
    kept = left_out = nbytes = 0
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        if skipped(rel):
            left_out += 1
            continue
        tar.add(path, arcname=f"{prefix}/{rel}")
        kept += 1
        nbytes += path.stat().st_size
    return kept, left_out, nbytes


def pip_download(dest: Path, specs: list[str]) -> None:
    """`pip download` the binary wheels of `specs` (pinned, no dependencies) for the device image."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]  # fmt: skip
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run([*cmd, *specs], check=True)
