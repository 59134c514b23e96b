"""How the harness ends: exit codes, and the errors that choose them.

    0  ok
    1  integrity failure anywhere: a cache hit, a PD room or an L3 fetch whose
       bytes differ from what prefill computed, or byte checks that did not
       cover everything that was reused
    2  invalid input: a flag, a config value, a trace, an environment that
       lacks an optional dependency (the message names the extra)
    3  internal error: a bug or a broken invariant (the traceback with -v)

The CLI (`hicache_harness.cli.main`) is the one boundary that catches
broad exceptions and turns them into these codes.
"""

from __future__ import annotations

import enum
import importlib
from types import ModuleType

from hicache_cp.errors import ConfigError, HiCacheError


class ExitCode(enum.IntEnum):
    OK = 0
    INTEGRITY = 1
    BAD_INPUT = 2
    INTERNAL = 3


class InputError(HiCacheError):
    """Bad input to a command (flag, file, environment): one line, exit code 2."""


class IntegrityFailure(HiCacheError):
    """Bytes that arrived differ from what was written: exit code 1."""


class MissingExtra(InputError):
    """An optional dependency is not installed; the message names the extra."""

    def __init__(self, module: str, extra: str, what: str) -> None:
        super().__init__(f"{what} needs the '{module}' package: pip install 'hicache-cp[{extra}]'")
        self.module = module
        self.extra = extra


def bad_input_types() -> tuple[type[BaseException], ...]:
    """The exception types that mean bad input (exit code 2)."""
    from hicache_harness.trace import TraceError

    return (InputError, ConfigError, TraceError)


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import an optional dependency, or raise MissingExtra naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(module, extra, what) from None
