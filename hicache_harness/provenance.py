"""Where a benchmark result came from: the commit and the machine.

Every benchmark JSON records both (with the command line) so that numbers
can be compared only with numbers of the same code on the same hardware.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path


def git_commit() -> str | None:
    """Short hash of the checkout this package runs from; None outside git.

    `HICACHE_COMMIT` overrides it, for copies of a working tree without its
    .git (the device machine gets such a copy)."""
    if os.environ.get("HICACHE_COMMIT"):
        return os.environ["HICACHE_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def machine() -> str:
    """Platform, CPU model, core count and Python version, on one line."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.platform()}; {cpu}; {os.cpu_count()} cpus; python {platform.python_version()}"


def command_line(subcommand: str) -> str:
    """`hicache-cp SUBCOMMAND ARGS...` as this process was started (console
    script or `python -m hicache_harness`), for the record in a result file."""
    argv = sys.argv[1:]
    if subcommand in argv:
        argv = argv[argv.index(subcommand) + 1 :]
    return " ".join(["hicache-cp", subcommand, *argv])


#: The first line of a device log (`bench/device/env.sh`'s `header`).
_LOG_HEADER = re.compile(r"#\s*commit\s+(?P<commit>[^;]+);\s*machine\s+(?P<machine>[^;]+);\s*command:\s*(?P<command>.*)")


def log_header(line: str) -> tuple[str, str, str] | None:
    """(commit, machine, command) of a device log's header line, else None."""
    m = _LOG_HEADER.match(line.strip())
    return (m["commit"].strip(), m["machine"].strip(), m["command"].strip()) if m else None
