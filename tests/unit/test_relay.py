"""The output relay with real socket pairs: what the caller's thread and the relay thread do to the
same streams (issue 25, failure 2).

An attached group's lifeline hook (:meth:`RankSet._lifeline_closed`) drains the relay when a rank's
stderr ends, from inside a read. A drain that held a list of streams taken before that read then
went on to read streams the nested drain had already closed, and the user saw
``ValueError: Invalid file descriptor: -1`` where a ``RankDiedError`` belonged.
"""
import socket
import threading

import pytest

from nbdist.wire.relay import OutputRelay

pytestmark = pytest.mark.timeout(30)


class Ranks:
    """``n`` ranks whose stdout/stderr reach ``relay`` through real socket pairs."""

    def __init__(self, relay, n):
        self.peers = {}
        for rank in range(n):
            for stream in ("stdout", "stderr"):
                ours, theirs = socket.socketpair()
                relay.add(rank, stream, ours)
                self.peers[(rank, stream)] = theirs

    def end(self, rank, text=""):
        """Rank ``rank`` writes ``text`` on stderr and exits (both streams end)."""
        if text:
            self.peers[(rank, "stderr")].sendall(text.encode())
        for stream in ("stdout", "stderr"):
            self.peers[(rank, stream)].close()

    def close(self):
        for sock in self.peers.values():
            sock.close()


@pytest.fixture
def relay():
    lines = []
    r = OutputRelay(lambda rank, stream, text: lines.append((rank, stream, text)))
    r.lines = lines
    yield r
    r.close()


def test_a_drain_inside_the_lifeline_hook_leaves_the_outer_drain_working(relay):
    """The exact interleaving: the caller's drain reads rank 0's end of stream; the hook drains
    again and closes rank 1's streams, which the outer drain still had on its list."""
    closed = []

    def hook(rank):  # as RankSet._lifeline_closed: see who else is gone before aborting them
        closed.append(rank)
        relay.drain()

    relay.on_close = hook
    ranks = Ranks(relay, 2)
    with relay._lock:  # the relay thread reads nothing until the caller's drain is done
        ranks.end(0, "boom 0\n")
        ranks.end(1, "boom 1\n")
        relay.drain()
    assert closed == [0, 1]
    assert relay.closed(0) and relay.closed(1)
    assert relay.tail(0) == "boom 0" and relay.tail(1) == "boom 1"
    ranks.close()


def test_ends_of_stream_race_between_the_relay_thread_and_drains(relay):
    """Many ranks end at once while two threads drain, as the caller and a job's thread may: every
    stream is read to its end exactly once and nothing raises."""
    closed = []
    relay.on_close = lambda rank: (closed.append(rank), relay.drain())
    ranks = Ranks(relay, 16)
    errors = []
    go = threading.Barrier(3)

    def drainer():
        go.wait()
        try:
            for _ in range(50):
                relay.drain()
        except Exception as err:  # noqa: BLE001 -- reported by the assert below
            errors.append(err)

    threads = [threading.Thread(target=drainer) for _ in range(2)]
    for t in threads:
        t.start()
    go.wait()
    for rank in range(16):
        ranks.end(rank, f"bye {rank}\n")
    for t in threads:
        t.join()
    for rank in range(16):
        assert relay.wait_closed(rank, 10.0)
    assert errors == []
    assert sorted(closed) == list(range(16))
    assert sorted(t for _, _, t in relay.lines) == sorted(f"bye {r}" for r in range(16))
    ranks.close()


def test_a_drain_or_a_second_close_after_close_does_nothing(relay):
    ranks = Ranks(relay, 1)
    ranks.peers[(0, "stdout")].sendall(b"held")
    relay.close()
    relay.drain(flush_partial=True)  # a rank's join after its relay closed: no error
    relay.close()
    assert relay.lines == []  # what came after close is not shown
    ranks.close()


def test_a_signed_stream_moved_to_the_groups_relay_stays_signed():
    """Issue 34, risk 1: ranks torchrun restarted join a relay of their own, then move to the
    group's (``move_to``). Their streams were re-added there without their seal, frame reader and
    counters: the group printed raw frame bytes, and sent the lifeline's commands (interrupt,
    stacks, kill, abort) unsigned, which the rank refuses (it exits with code 73). Here a frame
    is cut in half by the move, and the commands after it must still read as signed frames."""
    from nbdist.wire import seal as seal_module
    from nbdist.wire.transport import recv_exact

    key, ours, theirs = b"k" * 32, {}, {}
    lines = []
    generation = OutputRelay(lambda rank, stream, text: lines.append(("gen", stream, text)))
    group = OutputRelay(lambda rank, stream, text: lines.append(("group", stream, text)))
    peers = {}
    try:
        for stream in ("stdout", "stderr"):
            mine, peer = socket.socketpair()
            nonce = stream.encode().ljust(16, b"-")
            ours[stream] = seal_module.Seal(key, nonce, nonce, is_server=True)
            theirs[stream] = seal_module.Seal(key, nonce, nonce, is_server=False)
            generation.add(0, stream, mine, ours[stream])
            peers[stream] = peer
        first = theirs["stdout"].frame(b"before the move\n")
        cut = theirs["stdout"].frame(b"across the move\n")
        peers["stdout"].sendall(first + cut[:20])
        generation.drain()
        generation.move_to(group)
        peers["stdout"].sendall(cut[20:] + theirs["stdout"].frame(b"after the move\n"))
        group.expect(0, {"stdout": 3})  # the rank sent 3 frames before its reply
        group.drain()
        shown = [(w, line) for w, s, t in lines if s == "stdout" for line in t.splitlines()]
        assert shown == [("gen", "before the move"), ("group", "across the move"),
                         ("group", "after the move")], lines
        assert group._got[(0, "stdout")] == 3  # what drain waits for counts every frame
        lifeline = group.lifeline(0)
        assert lifeline.interrupt(7) and lifeline.stacks(8)
        peers["stderr"].settimeout(10)
        for want in (b"I7;", b"S8;"):  # the worker's watchdog reads each command as a frame
            assert seal_module.read_frame(peers["stderr"], theirs["stderr"], recv_exact) == want
    finally:
        generation.close()
        group.close()
        for peer in peers.values():
            peer.close()


def test_cursor_and_erase_codes_leave_no_line_of_their_own(relay):
    """Lightning's rich progress bar ends with '\\x1b[?25h' (show the cursor) on a line of its
    own, and erases its line with '\\x1b[2K': the notebook showed an empty '[rank 0]' line under
    every fit (tutorial 05, issue 35's review). Colours stay; an empty line printed stays."""
    ranks = Ranks(relay, 1)
    ranks.end(0, "\x1b[2KEpoch 1/1 \x1b[35m━━━\x1b[0m 4/4\n\x1b[?25h\n\nend\n")
    assert relay.wait_closed(0, 10.0)
    relay.drain()
    shown = "\n".join(t for _, _, t in relay.lines)
    assert shown == "Epoch 1/1 \x1b[35m━━━\x1b[0m 4/4\n\nend"
    assert relay.tail(0) == shown
    ranks.close()
