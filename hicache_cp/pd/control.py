"""The PD control channel: JSON messages over an authenticated local connection.

Runs in: the prefill sender (`ControlClient`) and the decode peer (`listen`,
`send_msg`, `recv_msg`).

`multiprocessing.connection` does the HMAC challenge with the authkey; this
module never uses its pickling `send`/`recv`: every message is one JSON
object (`send_bytes`/`recv_bytes`, at most ``MAX_MESSAGE_BYTES``), so a peer
that gets past the challenge still cannot make the other side unpickle
anything. The authkey must be at least ``MIN_AUTHKEY_BYTES`` bytes
(`new_authkey()` makes one); a short key is refused on both sides.

Messages (see `hicache_cp.harness.decode_peer` for the ops): a request has
``op`` and ``seq``; its reply echoes ``seq``. The decode side may also push
an *event* at any time (``{"event": "abort", "room": id, "reason": ...}``);
`ControlClient` keeps events aside (`take_events`) while it waits for a
reply, and `poll_events` collects those that arrived since, without blocking.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["MAX_MESSAGE_BYTES", "MIN_AUTHKEY_BYTES", "ControlClient", "check_authkey", "listen", "new_authkey",
           "recv_msg", "send_msg"]

#: Shortest authkey accepted (bytes): 256 bits, as `secrets.token_bytes(32)`.
MIN_AUTHKEY_BYTES = 32
#: Largest control message accepted (digest lists of long prompts stay far below it).
MAX_MESSAGE_BYTES = 256 << 20


def new_authkey() -> bytes:
    """A fresh random authkey of ``MIN_AUTHKEY_BYTES`` bytes."""
    return secrets.token_bytes(MIN_AUTHKEY_BYTES)


def check_authkey(authkey: bytes) -> bytes:
    """The key itself, or ValueError when it is not bytes of at least ``MIN_AUTHKEY_BYTES``."""
    if not isinstance(authkey, bytes) or len(authkey) < MIN_AUTHKEY_BYTES:
        n = len(authkey) if isinstance(authkey, (bytes, str)) else type(authkey).__name__
        raise ValueError(f"PD control authkey must be at least {MIN_AUTHKEY_BYTES} bytes, got {n} "
                         f"(make one with secrets.token_hex({MIN_AUTHKEY_BYTES}))")
    return authkey


def send_msg(conn: Connection, msg: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(msg, separators=(",", ":")).encode())


def recv_msg(conn: Connection) -> dict[str, Any]:
    """One message; ValueError when it is not a JSON object (nothing is unpickled)."""
    raw = conn.recv_bytes(MAX_MESSAGE_BYTES)
    try:
        msg = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"control message is not JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise ValueError(f"control message is a JSON {type(msg).__name__}, not an object")
    return msg


def listen(host: str, port: int, authkey: bytes) -> Listener:
    return Listener((host, port), authkey=check_authkey(authkey))


class ControlClient:
    """The prefill side's connection: one request at a time, events kept aside.

    Not thread-safe (one caller thread, like `PdSender`)."""

    def __init__(self, address: tuple[str, int], authkey: bytes) -> None:
        self.conn = Client(tuple(address), authkey=check_authkey(authkey))
        self._seq = 0
        self._events: list[dict[str, Any]] = []

    def request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one request, wait `timeout` s for its reply (stale replies are
        dropped, events kept). TimeoutError past it; OSError/EOFError when the
        connection is gone."""
        self._seq += 1
        msg["seq"] = self._seq
        send_msg(self.conn, msg)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.conn.poll(left):
                raise TimeoutError(f"decode peer did not answer {msg['op']} within {timeout:g} s")
            reply = recv_msg(self.conn)
            if "event" in reply:
                self._events.append(reply)
            elif reply.get("seq") == self._seq:
                return reply
            else:
                logger.debug("dropping stale control reply %s", reply.get("seq"))

    def poll_events(self) -> list[dict[str, Any]]:
        """Events received so far (kept ones first); never blocks."""
        while self.conn.poll(0):
            msg = recv_msg(self.conn)
            if "event" in msg:
                self._events.append(msg)
            else:
                logger.debug("dropping stale control reply %s", msg.get("seq"))
        out, self._events = self._events, []
        return out

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
