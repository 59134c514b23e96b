"""The PD control channel: JSON messages over an authenticated local connection.

Runs in: the prefill sender (`ControlClient`) and the decode peer (`listen`,
`send_msg`, `recv_msg`).

`multiprocessing.connection` does the HMAC challenge with the authkey; this
module never uses its pickling `send`/`recv`: every message is one JSON
object (`send_bytes`/`recv_bytes`, at most ``MAX_MESSAGE_BYTES``), so a peer
that gets past the challenge still cannot make the other side unpickle
anything. The authkey must be at least ``MIN_AUTHKEY_BYTES`` bytes
(`new_authkey()` makes one); a short key is refused on both sides.

Handshakes never hold anyone up: `ControlListener` accepts on its own thread
and runs each client's authkey challenge on a thread of its own, cut off
(the socket shut down) ``HANDSHAKE_TIMEOUT_S`` after the connection arrived.
An idle or slow client, authenticated or not, therefore delays no other
client, and at most ``MAX_PENDING_HANDSHAKES`` challenges run at once (a new
connection past that cuts the oldest one). `ControlClient` bounds its own
connect and challenge the same way.

Messages (see `hicache_harness.decode_peer` for the ops): a request has
``op`` and ``seq``; its reply echoes ``seq``. The decode side may also push
an *event* at any time (``{"event": "abort", "room": id, "reason": ...}``);
`ControlClient` keeps events aside (`take_events`) while it waits for a
reply, and `poll_events` collects those that arrived since, without blocking.
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import socket
import threading
import time
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["HANDSHAKE_TIMEOUT_S", "MAX_MESSAGE_BYTES", "MAX_PENDING_HANDSHAKES", "MIN_AUTHKEY_BYTES", "ControlClient",
           "ControlListener", "check_authkey", "connect", "listen", "new_authkey", "recv_msg", "send_msg"]

#: Shortest authkey accepted (bytes): 256 bits, as `secrets.token_bytes(32)`.
MIN_AUTHKEY_BYTES = 32
#: Largest control message accepted (digest lists of long prompts stay far below it).
MAX_MESSAGE_BYTES = 256 << 20
#: Seconds a connection has to pass the authkey challenge (loopback needs well under one).
HANDSHAKE_TIMEOUT_S = 5.0
#: Challenges running at once; a connection past it cuts the oldest.
MAX_PENDING_HANDSHAKES = 64
#: Connections the kernel queues before `ControlListener` accepts them.
BACKLOG = 128


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


class _Handshake:
    """One connection's authkey challenge, cut (socket shut down) if it outlives its deadline.

    `cut` and `finish` decide under one lock: whichever comes first wins. The
    connection is closed only by the thread that ran the challenge, after
    `finish`, so `cut` never shuts down a descriptor that was reused."""

    def __init__(self, conn: Connection, timeout_s: float) -> None:
        self.conn = conn
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._over = False
        self.was_cut = False
        self._timer = threading.Timer(timeout_s, self.cut)
        self._timer.daemon = True

    def run(self, authkey: bytes, *, server: bool) -> None:
        """The challenge both ways (the server's order or the client's), under the deadline.
        AuthenticationError for a wrong key; TimeoutError when it was cut."""
        self._timer.start()
        try:
            if server:
                deliver_challenge(self.conn, authkey)
                answer_challenge(self.conn, authkey)
            else:
                answer_challenge(self.conn, authkey)
                deliver_challenge(self.conn, authkey)
        except (OSError, EOFError) as exc:
            if self.finish():
                raise
            raise TimeoutError(f"authkey challenge not completed within {self.timeout_s:g} s") from exc
        except BaseException:
            self.finish()
            raise
        if not self.finish():
            raise TimeoutError(f"authkey challenge not completed within {self.timeout_s:g} s")

    def cut(self) -> None:
        """Shut the socket down: a read blocked in the challenge returns at once."""
        with self._lock:
            if self._over:
                return
            self._over = self.was_cut = True
            try:
                with socket.socket(fileno=self.conn.fileno()) as sock:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    finally:
                        sock.detach()  # the descriptor stays the connection's
            except OSError:
                pass

    def finish(self) -> bool:
        """End the deadline; False when `cut` came first."""
        with self._lock:
            self._timer.cancel()
            if self._over:
                return False
            self._over = True
            return True


class ControlListener:
    """The decode side's listening socket: authenticated connections, never held up by another client.

    `accept()` returns connections that passed the challenge, in the order
    they passed it. A connection that fails it (wrong key, closed, silent past
    `handshake_timeout_s`) is closed and counted (`refused`, `timed_out`).
    Threads: one accepting, one per challenge in progress (at most
    `max_pending`)."""

    def __init__(self, host: str, port: int, authkey: bytes, *, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 max_pending: int = MAX_PENDING_HANDSHAKES) -> None:
        self._authkey = check_authkey(authkey)
        self.handshake_timeout_s = handshake_timeout_s
        self.max_pending = max_pending
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(BACKLOG)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.address: tuple[str, int] = sock.getsockname()[:2]
        self._ready: queue.Queue[Connection | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending: dict[int, _Handshake] = {}  # insertion order: the oldest first
        self._next = 0
        self._closed = False
        self.refused = 0
        self.timed_out = 0
        self._acceptor = threading.Thread(target=self._accept_loop, name="pd-control-accept", daemon=True)
        self._acceptor.start()

    def accept(self) -> Connection:
        """The next authenticated connection (blocks); OSError once the listener is closed."""
        conn = self._ready.get()
        if conn is None:
            self._ready.put(None)  # for every other waiter
            raise OSError("control listener is closed")
        return conn

    def close(self) -> None:
        """Stop accepting, cut every challenge in progress, wake `accept` (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending.values())
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (Linux)
        except OSError:
            pass
        self._sock.close()
        for h in pending:
            h.cut()
        self._ready.put(None)
        self._acceptor.join(5.0)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                logger.warning("PD control: accept failed", exc_info=True)
                time.sleep(0.01)
                continue
            sock.setblocking(True)
            h = _Handshake(Connection(sock.detach()), self.handshake_timeout_s)
            with self._lock:
                if self._closed:
                    h.conn.close()
                    return
                key, self._next = self._next, self._next + 1
                self._pending[key] = h
                oldest = next(iter(self._pending.values())) if len(self._pending) > self.max_pending else None
            if oldest is not None:
                logger.warning("PD control: %d authkey challenges in progress; cutting the oldest", self.max_pending)
                oldest.cut()
            threading.Thread(target=self._authenticate, args=(key, h), name="pd-control-handshake",
                             daemon=True).start()

    def _authenticate(self, key: int, h: _Handshake) -> None:
        try:
            h.run(self._authkey, server=True)
        except TimeoutError:
            self._drop(key, h, "timed_out", f"silent past the {self.handshake_timeout_s:g} s handshake deadline")
            return
        except (OSError, EOFError, AuthenticationError) as exc:
            self._drop(key, h, "refused", f"failed the authkey challenge ({type(exc).__name__}: {exc})")
            return
        with self._lock:
            self._pending.pop(key, None)
        self._ready.put(h.conn)

    def _drop(self, key: int, h: _Handshake, counter: str, why: str) -> None:
        with self._lock:
            self._pending.pop(key, None)
            setattr(self, counter, getattr(self, counter) + 1)
        logger.warning("PD control: a connection %s; closed", why)
        h.conn.close()


def listen(host: str, port: int, authkey: bytes, **kwargs: Any) -> ControlListener:
    """A `ControlListener` on (host, port); ValueError for a short key, OSError when the port is taken."""
    return ControlListener(host, port, authkey, **kwargs)


def connect(address: tuple[str, int], authkey: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Connection:
    """An authenticated connection to a `ControlListener`: connect and challenge within `timeout_s`.

    TimeoutError past it (a peer that accepts and stays silent), ConnectionRefusedError,
    AuthenticationError for a key the other side does not share."""
    sock = socket.create_connection(tuple(address), timeout=timeout_s)
    sock.setblocking(True)
    conn = Connection(sock.detach())
    try:
        _Handshake(conn, timeout_s).run(check_authkey(authkey), server=False)
    except BaseException:
        conn.close()
        raise
    return conn


class ControlClient:
    """The prefill side's connection: one request at a time, events kept aside.

    Not thread-safe (one caller thread, like `PdSender`)."""

    def __init__(self, address: tuple[str, int], authkey: bytes, connect_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.conn = connect(address, check_authkey(authkey), connect_timeout_s)
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
