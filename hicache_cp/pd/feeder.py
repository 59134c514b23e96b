"""Submissions off the forward's thread: run each job once its layer is complete.

Runs in: the prefill rank's process, one worker thread per `PdSender`.

A per-layer PD send is planned on the forward's thread at the layer hook
(cheap numpy, the room's bookkeeping) but submitted here: the job first waits
for ``after`` (a CUDA event recorded on the compute stream at the hook, so
the forward never syncs the host) and then calls the submission. Jobs run in
the order they were put. `flush` waits until every job put so far has run,
with a deadline. A job that raises is logged and its error kept for
`take_errors` (the sender fails the room).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)

__all__ = ["LayerFeeder"]


class LayerFeeder:
    """One worker thread running `(after, fn)` jobs in order."""

    def __init__(self, name: str = "pd-feeder") -> None:
        self._q: queue.Queue[tuple[Any, Callable[[], None]] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._put = 0
        self._ran = 0
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, after: Any, fn: Callable[[], None]) -> None:
        """Run `fn` on the worker once `after.synchronize()` returns (None: at once)."""
        with self._cond:
            self._put += 1
        self._q.put((after, fn))

    def flush(self, timeout: float) -> bool:
        """Wait until every job put so far has run; False at the deadline."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._put
            while self._ran < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def take_errors(self) -> list[BaseException]:
        with self._cond:
            out, self._errors = self._errors, []
        return out

    def close(self, timeout: float = 5.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            after, fn = job
            try:
                if after is not None:
                    after.synchronize()
                fn()
            except BaseException as exc:  # kept for the sender, which fails the room
                logger.warning("PD feeder job failed: %s", exc)
                with self._cond:
                    self._errors.append(exc)
            finally:
                with self._cond:
                    self._ran += 1
                    self._cond.notify_all()
