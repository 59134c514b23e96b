"""The PD control channel and configuration (no transfers).

Asserts: the control channel never unpickles (a pickle from a client that
passed the authkey challenge is refused, its side effect never runs); short
authkeys are refused on both sides and by `decode-peer` (exit 2); the peer
listens on 127.0.0.1; `pd_timeout_s` and `pd_per_layer` follow defaults < TOML
< env < --set < flag and bad values are refused with the field's name. Idle,
slow and silent connections never hold up a client with the key (each
challenge runs apart, under a deadline, on both sides); a port in use is bad
input (exit 2).
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from multiprocessing.connection import Client
from pathlib import Path

import pytest

from hicache_cp.config import Config
from hicache_cp.errors import ConfigError
from hicache_cp.pd.control import MIN_AUTHKEY_BYTES, ControlClient, check_authkey, new_authkey

mooncake = pytest.importorskip("mooncake.engine", reason="Mooncake TransferEngine not importable (libibverbs1?)")


class _Touch:
    """Unpickling this creates a file: the proof that a pickle was loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (Path(self.path),))


def _layout():
    from hicache_cp.layout import KVLayout

    return KVLayout.build(page_size=4, num_layers=2, kv_bytes_per_token=16, state_bytes_per_token=0, draft_layers=0)


def test_control_channel_never_unpickles(tmp_path: Path) -> None:
    from hicache_harness.decode_peer import DecodePeer, control_request

    key = new_authkey()
    peer = DecodePeer(_layout(), 4, authkey=key)
    peer.start()
    marker = tmp_path / "unpickled"
    try:
        assert peer.address[0] == "127.0.0.1"
        with Client(peer.address, authkey=key) as c:  # passes the challenge, then sends a pickle
            c.send(_Touch(str(marker)))
            with pytest.raises((EOFError, OSError)):  # refused: the connection is dropped
                c.recv_bytes()
        time.sleep(0.1)
        assert not marker.exists()
        assert control_request(peer.address, key, {"op": "stats"})["ok"]  # still serving, in JSON
        payload = pickle.dumps(_Touch(str(marker)))
        with Client(peer.address, authkey=key) as c:  # raw bytes that happen to be a pickle
            c.send_bytes(payload)
            with pytest.raises((EOFError, OSError)):
                c.recv_bytes()
        assert not marker.exists()
    finally:
        peer.close()


def test_a_late_reply_is_never_the_next_answer_and_events_survive_a_request() -> None:
    """The prefill side times out on a request; its reply arrives later, then a decode
    abort event and the reply to the next request. The next request gets its own reply,
    and the event waits in `poll_events` (a scripted peer on a real connection)."""
    from multiprocessing.connection import Listener

    from hicache_cp.pd.control import recv_msg, send_msg

    key = new_authkey()
    listener = Listener(("127.0.0.1", 0), authkey=key)
    seen: list[dict] = []
    client_done = threading.Event()

    def peer() -> None:
        with listener.accept() as conn:
            first = recv_msg(conn)
            seen.append(first)
            time.sleep(0.3)  # past the client's timeout
            send_msg(conn, {"seq": first["seq"], "ok": True, "answer": "first"})
            second = recv_msg(conn)
            seen.append(second)
            send_msg(conn, {"event": "abort", "room": 7, "reason": "decode gave up"})
            send_msg(conn, {"seq": second["seq"], "ok": True, "answer": "second"})
            client_done.wait(5)  # a peer stays connected

    thread = threading.Thread(target=peer)
    thread.start()
    client = ControlClient(listener.address, key)
    try:
        with pytest.raises(TimeoutError, match="did not answer open"):
            client.request({"op": "open"}, 0.1)
        time.sleep(0.4)  # the stale reply is on the wire now
        reply = client.request({"op": "done"}, 5.0)
        assert reply["answer"] == "second" and [m["op"] for m in seen] == ["open", "done"]
        assert client.poll_events() == [{"event": "abort", "room": 7, "reason": "decode gave up"}]
        assert client.poll_events() == []
    finally:
        client_done.set()
        client.close()
        thread.join(5)
        listener.close()


def test_short_authkeys_are_refused_everywhere() -> None:
    from hicache_harness.decode_peer import DecodePeer

    assert len(new_authkey()) == MIN_AUTHKEY_BYTES == 32 and new_authkey() != new_authkey()
    for bad in (b"k", os.urandom(31), "x" * 40):
        with pytest.raises(ValueError, match="at least 32 bytes"):
            check_authkey(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 32 bytes"):
        DecodePeer(_layout(), 4, authkey=b"secret")
    with pytest.raises(ValueError, match="at least 32 bytes"):
        ControlClient(("127.0.0.1", 1), b"secret")  # refused before any connection is tried


@pytest.mark.parametrize("key", ["", "short-key"])
def test_decode_peer_command_refuses_a_short_key(key: str, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from hicache_harness.cli import main

    monkeypatch.setenv("HICACHE_CP_PD_AUTHKEY", key)
    assert main(["decode-peer", "--pages", "4"]) == 2
    err = capsys.readouterr().err
    assert "HICACHE_CP_PD_AUTHKEY" in err and ("at least 32 bytes" in err or "set " in err)


def test_pd_fields_follow_the_sources(tmp_path: Path) -> None:
    assert (Config().pd_timeout_s, Config().pd_per_layer) == (300.0, False)
    toml = tmp_path / "c.toml"
    toml.write_text("pd_timeout_s = 120\npd_per_layer = true\n")
    r = Config.resolve(toml, env={})
    assert (r.config.pd_timeout_s, r.config.pd_per_layer) == (120.0, True)
    assert r.sources["pd_timeout_s"] == r.sources["pd_per_layer"] == f"toml:{toml}"
    r = Config.resolve(toml, env={"HICACHE_PD_TIMEOUT_S": "30.5", "HICACHE_PD_PER_LAYER": "0"})
    assert (r.config.pd_timeout_s, r.config.pd_per_layer) == (30.5, False)
    assert r.sources["pd_timeout_s"] == "env:HICACHE_PD_TIMEOUT_S"
    r = Config.resolve(toml, env={"HICACHE_PD_TIMEOUT_S": "30.5"}, overrides={"pd_timeout_s": "7"})
    assert r.config.pd_timeout_s == 7.0 and r.sources["pd_timeout_s"] == "cli"
    for bad in ("nan", "inf", "0", "-1", "abc", True):
        with pytest.raises(ConfigError, match="pd_timeout_s"):
            Config.resolve(None, env={}, overrides={"pd_timeout_s": bad})
    with pytest.raises(ConfigError, match="pd_per_layer"):
        Config.resolve(None, env={"HICACHE_PD_PER_LAYER": "maybe"})


def test_replay_pd_flags_need_pd(capsys: pytest.CaptureFixture[str]) -> None:
    from hicache_harness.cli import main

    assert main(["replay", "--limit", "2", "--pd-timeout-s", "5"]) == 2
    assert "need --pd" in capsys.readouterr().err
    assert main(["replay", "--pd", "--limit", "2", "--pd-timeout-s", "nan"]) == 2
    assert "pd_timeout_s" in capsys.readouterr().err


def _raw_connections(address: tuple[str, int], n: int) -> list:
    import socket

    return [socket.create_connection(address, timeout=10) for _ in range(n)]


def test_idle_and_slow_connections_never_hold_up_a_client_with_the_key() -> None:
    """Many connections that never answer the challenge (idle), answer it a byte
    at a time (slow), or read it and stay silent, more of them than challenges may
    run at once: a client with the key is still served while they all stay open."""
    from hicache_harness.decode_peer import DecodePeer, control_request
    from hicache_cp.pd.control import MAX_PENDING_HANDSHAKES

    key = new_authkey()
    peer = DecodePeer(_layout(), 4, authkey=key)
    peer.start()
    stop = threading.Event()
    idle = _raw_connections(peer.address, MAX_PENDING_HANDSHAKES + 16)
    slow = _raw_connections(peer.address, 8)
    silent = _raw_connections(peer.address, 4)

    def trickle() -> None:  # one byte of a wrong answer every 50 ms
        while not stop.wait(0.05):
            for s in slow:
                try:
                    s.send(b"x")
                except OSError:
                    pass

    for s in silent:
        s.recv(64)  # the challenge arrived; never answered
    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    replies: list[dict] = []
    client = threading.Thread(target=lambda: replies.append(control_request(peer.address, key, {"op": "stats"}, 30)),
                              daemon=True)
    try:
        client.start()
        client.join(30)
        assert replies and replies[0]["ok"], "a client with the key waited behind connections that never authenticate"
    finally:
        stop.set()
        for s in idle + slow + silent:
            s.close()
        peer.close()


def test_a_silent_connection_is_cut_at_the_handshake_deadline() -> None:
    from hicache_cp.pd.control import ControlListener

    key = new_authkey()
    listener = ControlListener("127.0.0.1", 0, key, handshake_timeout_s=0.2)
    try:
        (s,) = _raw_connections(listener.address, 1)
        got = b""
        while True:  # the challenge, then EOF once the deadline cut the connection
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        assert got, "the challenge never came"
        s.close()
        deadline = time.monotonic() + 10
        while listener.timed_out == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert listener.timed_out == 1 and listener.refused == 0
    finally:
        listener.close()
    with pytest.raises(OSError, match="closed"):
        listener.accept()


def test_a_client_gives_up_on_a_peer_that_never_challenges() -> None:
    """The prefill side connects to something that accepts and stays silent: its
    connect ends with TimeoutError instead of hanging."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    errors: list[BaseException] = []

    def connect() -> None:
        try:
            ControlClient(server.getsockname()[:2], new_authkey(), connect_timeout_s=0.2)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    t = threading.Thread(target=connect, daemon=True)
    try:
        t.start()
        t.join(20)
        assert not t.is_alive(), "the client hung on a silent peer"
        assert len(errors) == 1 and isinstance(errors[0], TimeoutError), errors
    finally:
        server.close()


def test_listen_refuses_a_short_key_on_its_own() -> None:
    from hicache_cp.pd.control import listen

    for bad in (b"", b"k" * 31, "x" * 40):
        with pytest.raises(ValueError, match="at least 32 bytes"):
            listen("127.0.0.1", 0, bad)  # type: ignore[arg-type]


def test_a_wrong_key_is_refused_and_the_listener_keeps_serving() -> None:
    from multiprocessing.connection import AuthenticationError

    from hicache_cp.pd.control import connect, listen

    key = new_authkey()
    listener = listen("127.0.0.1", 0, key)
    try:
        with pytest.raises(AuthenticationError):
            connect(listener.address, new_authkey())
        c = connect(listener.address, key)
        server_side = listener.accept()
        c.send_bytes(b"{}")
        assert server_side.recv_bytes() == b"{}"
        c.close()
        server_side.close()
        assert listener.refused == 1
    finally:
        listener.close()


def test_decode_peer_on_a_port_in_use_is_bad_input(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from hicache_harness.cli import main

    monkeypatch.setenv("HICACHE_CP_PD_AUTHKEY", new_authkey().hex())
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["decode-peer", "--pages", "4", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "in use" in err and "internal error" not in err
