"""The rank side of piped streams (issue 26): nbdist.wire.pump.PipePump on a spare file descriptor
of this process, over a real socket pair, and how NBDIST_STREAMS chooses the way
(nbdist.runtime.streams.stream_mode). Reads are blocking: no select on the pipe, which Windows'
select refuses."""
import os
import select
import socket
import sys
import threading
import time

import pytest

from nbdist.runtime import streams
from nbdist.wire.pump import CHUNK, PipePump
from nbdist.wire.seal import FrameReader, Seal

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pumps():
    """Make pumps on a spare file descriptor of this process, as a rank's fd 1 or 2 is, over a
    socket pair; each ends with the test (its socket closed last: a rank's pump that cannot send
    ends the process, here it is told to set an event)."""
    made = []

    def make(seal=None, name="stdout"):
        fd = os.open(os.devnull, os.O_WRONLY)
        ours, theirs = socket.socketpair()
        lost = threading.Event()
        made.append((PipePump(fd, ours, seal, lost.set, name), fd, ours, theirs, lost))
        return made[-1]

    yield make
    for pump, fd, ours, theirs, _ in made:
        os.close(fd)
        pump.close()
        ours.close()
        theirs.close()
        assert not pump.thread.is_alive()


def received(sock) -> bytes:
    """Everything already in ``sock`` (what was sent to it so far)."""
    sock.setblocking(False)
    chunks = []
    try:
        while True:
            data = sock.recv(1 << 20)
            if not data:
                break
            chunks.append(data)
    except BlockingIOError:
        pass
    return b"".join(chunks)


def test_what_was_written_is_sent_when_drain_returns(pumps, monkeypatch):
    def refused(*args, **kwargs):
        raise OSError(10038, "select on a pipe (Windows)")

    monkeypatch.setattr(select, "select", refused)
    pump, fd, _, theirs, _ = pumps()
    for i in range(200):
        os.write(fd, b"line %d\n" % i)
        assert pump.drain()
        assert received(theirs) == b"line %d\n" % i  # all of it, and no marker


def test_any_bytes_pass_unchanged_whatever_the_reads_cut(pumps):
    """Binary output full of 0xFF (a marker's first byte), in writes larger than one read: the
    pump holds back what could start a marker, and strips only its own markers."""
    pump, fd, _, theirs, _ = pumps(name="stderr")
    blob = bytes(range(256)) * 700 + b"\xff" * 20 + os.urandom(3 * CHUNK) + b"tail\xff"
    got = []
    reader = threading.Thread(target=lambda: got.append(_read_until(theirs, len(blob))))
    reader.start()
    for start in range(0, len(blob), 40_000):
        os.write(fd, blob[start:start + 40_000])
        pump.drain()
    reader.join(30)
    assert got == [blob]


def _read_until(sock, size):
    buf = bytearray()
    while len(buf) < size:
        buf += sock.recv(1 << 20)
    return bytes(buf)


def test_a_sealed_pump_sends_frames_and_counts_them(pumps):
    key, a, b = os.urandom(32), os.urandom(16), os.urandom(16)
    pump, fd, _, theirs, _ = pumps(Seal(key, a, b, is_server=False))
    reader = FrameReader(Seal(key, a, b, is_server=True))
    for i in range(20):
        os.write(fd, b"step %d\n" % i)
        pump.drain()
    bodies = reader.feed(received(theirs))
    assert b"".join(bodies) == b"".join(b"step %d\n" % i for i in range(20))
    assert pump.sent == len(bodies)


@pytest.mark.skipif(sys.platform == "win32", reason="Windows' send() buffers what the peer has "
                    "not read without blocking, whatever SO_SNDBUF says: the pump never waits")
def test_drain_gives_up_after_its_timeout_while_the_caller_reads_nothing(pumps):
    pump, fd, ours, theirs, _ = pumps()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    os.write(fd, b"x" * 100_000)  # more than the socket takes: the pump waits to send the rest
    assert pump.drain(timeout=0.2) is False
    assert len(_read_until(theirs, 100_000)) == 100_000  # the caller reads: it all comes
    assert pump.drain(timeout=10)


def test_a_stream_the_caller_dropped_ends_the_process(pumps):
    pump, fd, _, theirs, lost = pumps()
    theirs.close()
    deadline = time.monotonic() + 10
    while not lost.is_set() and time.monotonic() < deadline:  # Windows accepts the first send
        os.write(fd, b"nobody reads this\n")                 # after the close, fails a later one
        lost.wait(0.1)
    assert lost.is_set()
    assert pump.drain() is False  # the pump has ended: nothing waits for it


def test_the_stream_mode_comes_from_the_environment(monkeypatch):
    monkeypatch.setattr(streams, "WINDOWS", False)
    assert streams.stream_mode({}) == "socket"
    assert streams.stream_mode({"NBDIST_STREAMS": "pipe"}) == "pipe"
    with pytest.raises(ValueError, match=r"NBDIST_STREAMS must be one of 'socket', 'pipe' on "
                                         r"this platform, got 'Pipe'"):
        streams.stream_mode({"NBDIST_STREAMS": "Pipe"})
    monkeypatch.setattr(streams, "WINDOWS", True)
    assert streams.stream_mode({}) == "pipe"
    with pytest.raises(ValueError, match=r"must be one of 'pipe' on this platform, got 'socket' "
                                         r"\(a Windows socket is a handle, not a C-runtime file "
                                         r"descriptor: it cannot be a rank's stdout\); unset it "
                                         r"for the default \('pipe'\)"):
        streams.stream_mode({"NBDIST_STREAMS": "socket"})
