"""Protected connections at the wire level (issue 20): the handshake's mode byte, sealed frames
over real sockets, and what happens when one byte changes on the way."""
import socket
import threading

import pytest

from loopback import tcp_pair

from nbdist.wire import transport
from nbdist.wire.seal import REFUSED_BY_PEER, REFUSED_BY_US, FrameReader, IntegrityError, Seal

pytestmark = pytest.mark.timeout(30)



def _pair(protect, key=None, hello=None):
    """A connected (server, client) pair after a real handshake over loopback TCP."""
    key = key or transport.new_key()
    a, b = tcp_pair()
    box = {}

    def serve():
        box["server"] = transport.accept_session(a, key, 5.0, protect)

    t = threading.Thread(target=serve)
    t.start()
    client_seal = transport.client_handshake(b, key, hello or {"rank": 0, "role": "control"})
    t.join(10)
    got_hello, server_seal = box["server"]
    return (a, server_seal), (b, client_seal), got_hello


def test_the_server_decides_protection_and_the_client_learns_it():
    (a, s_seal), (b, c_seal), hello = _pair(protect=False)
    assert s_seal is None and c_seal is None and hello == {"rank": 0, "role": "control"}
    (a2, s_seal2), (b2, c_seal2), hello2 = _pair(protect=True, hello={"rank": 1, "role": "stdout"})
    assert isinstance(s_seal2, Seal) and isinstance(c_seal2, Seal)
    assert hello2 == {"rank": 1, "role": "stdout"}  # the hello itself travelled sealed
    for s in (a, b, a2, b2):
        s.close()


def test_the_mode_byte_cannot_be_flipped_on_the_way():
    key = transport.new_key()
    a, b = socket.socketpair()
    mitm_a, mitm_b = socket.socketpair()  # client <-> mitm_b ... mitm_a <-> a (server)

    def serve():
        try:
            transport.accept_session(a, key, 5.0, protect=True)
        except transport.AuthenticationError:
            pass

    def forward():
        head = transport.recv_exact(b, 8 + 32)
        mitm_a.sendall(head)
        b.sendall(transport.recv_exact(mitm_a, 8 + 32 + 32))
        answer = bytearray(transport.recv_exact(b, 1 + 32))
        answer[0:1] = b"-"  # try to turn protection off
        mitm_a.sendall(bytes(answer))

    threads = [threading.Thread(target=serve), threading.Thread(target=forward)]
    for t in threads:
        t.start()
    with pytest.raises(transport.AuthenticationError, match="does not hold the group key"):
        transport.client_handshake(mitm_b, key, {"rank": 0, "role": "control"}, timeout=5)
    for s in (a, b, mitm_a, mitm_b):
        s.close()
    for t in threads:
        t.join(10)


def test_sealed_channel_carries_small_and_large_messages_both_ways():
    (a, s_seal), (b, c_seal), _ = _pair(protect=True)
    server, client = transport.Channel(a, s_seal), transport.Channel(b, c_seal)
    big = bytes(range(256)) * 4096  # 1 MiB: sent in three pieces
    t = threading.Thread(target=lambda: [client.send(("run", 1, "x")), client.send_bytes(big)])
    t.start()
    assert server.recv() == ("run", 1, "x")
    assert server.recv_bytes() == big
    t.join(10)
    server.send({"reply": [1, 2]})
    assert client.recv() == {"reply": [1, 2]}
    server.close()
    client.close()


def _ended(sock) -> bool:
    """Nothing more can be read: Linux reads b"" from a socket shut down here; Windows raises
    WSAESHUTDOWN (10058, a BrokenPipeError) instead."""
    try:
        return sock.recv(1) == b""
    except BrokenPipeError as err:
        return getattr(err, "winerror", None) == 10058


def _tamper_case(flip_at):
    """The client sends one message whose byte ``flip_at`` is flipped on the wire."""
    (a, s_seal), (b, c_seal), _ = _pair(protect=True)
    server, client = transport.Channel(a, s_seal), transport.Channel(b, c_seal)
    frame = bytearray(c_seal.frame(transport.encode(("ok", 7, "payload", []))))
    frame[flip_at] ^= 0x01
    b.sendall(bytes(frame))
    with pytest.raises(IntegrityError, match="integrity check") as info:
        server.recv()
    assert str(info.value) == REFUSED_BY_US and server.failure == REFUSED_BY_US
    # the client is told why, then sees the connection end
    with pytest.raises(IntegrityError) as told:
        client.recv()
    assert str(told.value) == REFUSED_BY_PEER and client.failure == REFUSED_BY_PEER
    assert _ended(b)
    server.close()
    client.close()


@pytest.mark.parametrize("where", ["length", "header tag", "body", "body tag"])
def test_a_flipped_byte_anywhere_is_refused_before_unpickling(where):
    _tamper_case({"length": 7, "header tag": 20, "body": 45, "body tag": -1}[where])


def test_replayed_or_reordered_frames_are_refused():
    (a, s_seal), (b, c_seal), _ = _pair(protect=True)
    server = transport.Channel(a, s_seal)
    first = c_seal.frame(b"one")
    second = c_seal.frame(b"two")
    b.sendall(second + first)  # reordered: the sequence number no longer matches
    with pytest.raises(IntegrityError):
        server.recv_bytes()
    a.close()
    b.close()
    (a, s_seal), (b, c_seal), _ = _pair(protect=True)
    server = transport.Channel(a, s_seal)
    first = c_seal.frame(b"one")
    b.sendall(first + first)  # replayed
    assert server.recv_bytes() == b"one"
    with pytest.raises(IntegrityError):
        server.recv_bytes()
    a.close()
    b.close()


def test_a_frame_is_not_accepted_in_the_other_direction():
    (a, s_seal), (b, c_seal), _ = _pair(protect=True)
    reflected = s_seal.frame(b"from the server")  # sent back to the server as if from the client
    with pytest.raises(IntegrityError):
        FrameReader(s_seal).feed(reflected)
    assert FrameReader(c_seal).feed(reflected) == [b"from the server"]
    a.close()
    b.close()


def test_frame_reader_takes_any_split_of_the_stream():
    (a, s_seal), (b, c_seal), _ = _pair(protect=True)
    stream = b"".join(c_seal.frame(m) for m in (b"hello\n", b"x" * 70000))
    reader = FrameReader(s_seal)
    out = []
    for i in range(0, len(stream), 999):
        out += reader.feed(stream[i:i + 999])
    assert out == [b"hello\n", b"x" * 70000]
    with pytest.raises(IntegrityError, match="refused a message sent to it"):
        reader.feed(c_seal.frame(b""))  # the empty frame is the peer's refusal notice, never data
    a.close()
    b.close()


def test_unprotected_channel_is_unchanged_on_the_wire():
    (a, _), (b, _), _ = _pair(protect=False)
    client = transport.Channel(b)
    client.send_bytes(b"abc")
    assert transport.recv_exact(a, 11) == b"\x00" * 7 + b"\x03abc"
    a.close()
    b.close()
