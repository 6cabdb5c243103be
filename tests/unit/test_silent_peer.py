"""A peer that goes silent is given up, with a reason (issue 25, risk 2): the controller's sockets
probe a silent host (keepalive), and a message that stops halfway is not waited on for ever.

A whole host vanishing is played in tests/integration/test_attach_vanish.py; here, real sockets on
this machine."""
import socket
import struct
import threading
import time

import pytest

from nbdist.wire import transport

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32


def tcp_pair():
    """Two connected TCP sockets on loopback (a channel sets TCP options)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        theirs = socket.create_connection(listener.getsockname())
        ours, _ = listener.accept()
    return ours, theirs


def _recv_in_thread(channel, wait=10.0):
    box = {}

    def recv():
        try:
            box["value"] = channel.recv_bytes()
        except BaseException as err:  # noqa: BLE001 -- checked by the caller
            box["err"] = err

    t = threading.Thread(target=recv, daemon=True)
    t.start()
    t.join(wait)
    assert not t.is_alive(), f"recv still blocked after {wait} s"
    return box


def test_a_message_that_stops_halfway_is_given_up_and_says_why():
    ours, theirs = tcp_pair()
    channel = transport.Channel(ours)
    channel.stall = 0.3
    theirs.sendall(struct.pack("!Q", 100) + b"x" * 40)  # 40 of 100 bytes, then nothing
    box = _recv_in_thread(channel)
    assert isinstance(box.get("err"), transport.MessageStalled), box
    assert channel.failure == "the peer sent part of a message, then nothing for 0.3 s"
    assert channel.peer_silent
    ours.close()
    theirs.close()


def test_a_header_that_stops_halfway_is_given_up_too():
    ours, theirs = tcp_pair()
    channel = transport.Channel(ours)
    channel.stall = 0.3
    theirs.sendall(b"\0\0\0")  # 3 of the 8 header bytes
    assert isinstance(_recv_in_thread(channel).get("err"), transport.MessageStalled)
    ours.close()
    theirs.close()


def test_waiting_for_a_message_to_begin_has_no_bound():
    """A worker waits for its next request as long as the notebook is idle: only a message that
    has begun is bounded."""
    ours, theirs = tcp_pair()
    channel = transport.Channel(ours)
    channel.stall = 0.2
    timer = threading.Timer(0.6, theirs.sendall, (struct.pack("!Q", 5) + b"hello",))
    timer.start()
    assert _recv_in_thread(channel) == {"value": b"hello"}
    assert channel.failure == "" and not channel.peer_silent
    timer.join()
    ours.close()
    theirs.close()


def test_the_controller_probes_every_connection_it_accepts():
    """Every connection a rank makes to the controller (control, stdout, stderr) is accepted by
    ``accept_session``: each probes a silent peer and gives it up after PEER_SILENCE s."""
    listener = transport.listen("127.0.0.1", 0)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("client", transport.connect_session(
        listener.getsockname(), KEY, {"rank": 0, "role": "control"})))
    t.start()
    conn, _ = listener.accept()
    hello, _ = transport.accept_session(conn, KEY)
    t.join(10)
    assert hello == {"rank": 0, "role": "control"}
    assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux: the names and values nbdist sets
        got = [conn.getsockopt(socket.IPPROTO_TCP, getattr(socket, name))
               for name in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_USER_TIMEOUT")]
        assert got == [4, 2, 3, transport.PEER_SILENCE * 1000]
    conn.close()
    box["client"][0].close()
    listener.close()


def test_a_slow_but_steady_message_is_read_whole():
    """The bound is on each pause, not on the whole message: bytes trickling in keep it going."""
    ours, theirs = tcp_pair()
    channel = transport.Channel(ours)
    channel.stall = 0.5

    def trickle():
        theirs.sendall(struct.pack("!Q", 10))
        for i in range(10):
            time.sleep(0.1)
            theirs.sendall(bytes([48 + i]))

    t = threading.Thread(target=trickle)
    t.start()
    assert _recv_in_thread(channel) == {"value": b"0123456789"}
    t.join()
    ours.close()
    theirs.close()
