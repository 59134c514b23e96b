"""DecodeSession: one prefill rank's control session with its decode peer.

Runs in: each prefill rank's process, on the `PdSender`'s caller thread.

    connect(sources)   the handshake: this rank's registration descriptors go to
                       the decode peer, its own comes back and must be compatible
                       with every one of ours (`registration.check_compatible`);
                       RegistrationMismatch names every difference. Once per
                       connection; the summary is logged at INFO.
    request(msg, t)    one request and its reply within `t` seconds.
    abort_events()     the decode peer's "abort" events that arrived since the last
                       call, without blocking; a lost channel is a WARNING and no events.
    drop()             close the channel; the next `connect` opens a new one.

The messages themselves (ops and events) are `pd.control`'s.
"""

from __future__ import annotations

import logging
from typing import Any

from hicache_cp.pd.control import ControlClient
from hicache_cp.pd.registration import RegistrationDescriptor, RegistrationMismatch, check_compatible

logger = logging.getLogger(__name__)


class DecodeSession:
    """The control channel of one prefill rank to the decode peer at `address`."""

    def __init__(self, address: tuple[str, int], authkey: bytes, *, rank: int, cp_size: int,
                 connect_timeout_s: float) -> None:  # fmt: skip
        self.address = tuple(address)
        self._authkey = authkey
        self.rank = rank
        self.cp_size = cp_size
        self.connect_timeout_s = connect_timeout_s
        self._ctl: ControlClient | None = None
        self.peer: str | None = None  # the decode side's transfer-engine session
        self.dest: RegistrationDescriptor | None = None  # the decode side's registration
        self.whole_prompt = False  # the decode side asks for the partial last page too

    @property
    def connected(self) -> bool:
        return self._ctl is not None

    def connect(self, sources: dict[int, RegistrationDescriptor]) -> None:
        """Handshake: exchange registration descriptors; RegistrationMismatch on any disagreement."""
        if self._ctl is not None:
            return
        self._ctl = ControlClient(self.address, self._authkey)
        try:
            reply = self.request({"op": "hello", "rank": self.rank, "cp_size": self.cp_size,
                                  "descriptors": [d.to_dict() for d in sources.values()]},
                                 self.connect_timeout_s)
            dest = RegistrationDescriptor.from_dict(reply["descriptor"])
            diffs: list[tuple[str, object, object]] = []
            for desc in sources.values():
                try:
                    check_compatible(desc, dest)
                except RegistrationMismatch as exc:
                    diffs += [(f"{desc.tier} {w}", a, b) for w, a, b in exc.differences]
            if diffs or not reply["ok"]:
                raise RegistrationMismatch("prefill", "decode", diffs or [("decode", None, reply.get("error"))])
        except BaseException:
            self.drop()
            raise
        self.dest = dest
        self.peer = reply["session"]
        self.whole_prompt = bool(reply.get("whole_prompt", False))
        self._log_registration(sources)

    def _log_registration(self, sources: dict[int, RegistrationDescriptor]) -> None:
        """The registration summary, once per connection (INFO)."""
        for desc in [*sources.values(), self.dest]:
            assert desc is not None
            parts = "; ".join(f"{p.part} {p.slots} buffers layers {p.layer_ids} {p.page_bytes} B/page"
                              for p in desc.parts)
            logger.info("PD registration rank %d %s: kv buffers %d (draft kv at %d, %d), state buffers %d "
                        "(draft state at %d, %d); %s", self.rank, desc.tier, desc.kv_count, desc.draft_kv_start,
                        desc.draft_kv_count, desc.state_count, desc.draft_state_start, desc.draft_state_count, parts)
        logger.info("PD rank %d -> decode %s (control %s:%d), whole prompt %s", self.rank, self.peer,
                    *self.address, self.whole_prompt)

    def request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self._ctl is None:
            raise ConnectionError("no control connection to the decode peer")
        return self._ctl.request(msg, timeout)

    def drop(self) -> None:
        if self._ctl is not None:
            self._ctl.close()
        self._ctl = None

    def abort_events(self) -> list[dict[str, Any]]:
        """The decode peer's abort events since the last call (unknown events are logged and dropped)."""
        if self._ctl is None:
            return []
        try:
            events = self._ctl.poll_events()
        except (OSError, EOFError, ValueError) as exc:
            logger.warning("PD rank %d: control channel lost while polling: %s", self.rank, exc)
            self.drop()
            return []
        aborts = []
        for ev in events:
            if ev.get("event") != "abort":
                logger.warning("PD rank %d: unknown control event %r", self.rank, ev.get("event"))
                continue
            aborts.append(ev)
        return aborts
