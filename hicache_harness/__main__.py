"""`python -m hicache_harness ...`: the CLI (an entry point, part of the harness layer).

SIGINT/SIGTERM before the CLI takes over its signals (`lifetime.stop_on_signals`),
and after it gave them back, end the process with one line and 130/143, no
KeyboardInterrupt traceback: the handler is installed before the CLI's imports,
and it ends the process at once (`os._exit`): nothing has started yet, or the
run's own clean-up is over, and an exception raised here while the interpreter
winds down (an atexit callback, a finalizer) would be dropped and end in 0.
"""

import os
import signal
import sys


def _early_stop(signum: int, frame: object) -> None:
    try:
        sys.stderr.write(f"hicache-cp: interrupted by {signal.Signals(signum).name}\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(128 + signum)


for _sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_sig, _early_stop)

from hicache_harness.cli import main  # noqa: E402 - after the handlers, on purpose

sys.exit(main())
