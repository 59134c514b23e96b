"""`python -m hicache_cp ...`: the CLI (an entry point, part of the harness layer).

SIGINT/SIGTERM before the CLI takes over its signals (`lifetime.stop_on_signals`)
end the process with one line and 130/143, no KeyboardInterrupt traceback: the
handler is installed before the CLI's imports (torch takes a second or more).
"""

import signal
import sys


def _early_stop(signum: int, frame: object) -> None:
    sys.stderr.write(f"hicache-cp: interrupted by {signal.Signals(signum).name}\n")
    raise SystemExit(128 + signum)  # unwinds the import without a traceback


for _sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_sig, _early_stop)

from hicache_cp.harness.cli import main  # noqa: E402 - after the handlers, on purpose

sys.exit(main())
