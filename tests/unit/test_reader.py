"""The one reader of the ranks' control channels (issue 34): one dispatch table that every thread
reading a rank's channel goes through, whatever it waits for. Messages travel over a real
loopback channel; the rank set around it only records what the handlers hand it."""
import re
from pathlib import Path

import pytest
from loopback import tcp_pair

from nbdist.runtime import reader
from nbdist.runtime.stacks import StacksBox
from nbdist.wire import transport

pytestmark = pytest.mark.timeout(30)

#: Modules whose sends go from a rank to the notebook (rankpdb's "pdb_cmd" goes the other way).
RANK_SIDE = ["worker.py", "rankserver.py", "ranklog.py", "rankpdb.py", "stacks.py"]
TO_RANKS = {"pdb_cmd"}


class _Relay:
    def __init__(self):
        self.expected = []

    def expect(self, r, counts):
        self.expected.append((r, counts))


class _Ranks:
    """A rank set of one rank: its channel, its relay, its stacks box, what it released."""

    def __init__(self, channel):
        self.relay, self.stacks, self.released = _Relay(), StacksBox(), []
        self._channel = channel

    def __getitem__(self, r):
        return type("R", (), {"channel": self._channel})()

    def release(self, r, paths):
        self.released.append((r, paths))


@pytest.fixture
def wire():
    """(notebook's end, rank's end) of a real loopback control channel, and the rank set."""
    a, b = tcp_pair()
    ours, theirs = transport.Channel(a), transport.Channel(b)
    yield ours, theirs, _Ranks(ours)
    a.close()
    b.close()


def test_every_kind_a_rank_sends_has_its_handler_in_the_one_table():
    src = Path(reader.__file__).parent
    sent = set()
    for name in RANK_SIDE:
        sent |= set(re.findall(r'(?:send|encode)\(\("(\w+)"', (src / name).read_text()))
    assert sent - TO_RANKS == set(reader.HANDLERS), "a kind without a handler, or a stale one"


def test_a_stack_answer_read_by_a_waiting_call_reaches_whoever_asked(wire):
    ours, theirs, rs = wire
    theirs.send(("stacks", 7, {"frames": ["f"]}, []))
    message = reader.receive(reader.Waiter(), rs, 0, ours)
    assert message[:2] == ("stacks", 7)
    assert rs.stacks.take(7, [0]) == {0: {"frames": ["f"]}}


def test_a_reply_nobody_waits_for_gives_its_segments_back(wire):
    ours, theirs, rs = wire
    theirs.send(("ok", 3, "late", ["seg-1"]))
    reader.receive(reader.Waiter(), rs, 0, ours)
    assert rs.released == [(0, ["seg-1"])]


def test_a_prompt_no_call_waits_for_is_told_to_quit(wire):
    ours, theirs, rs = wire
    theirs.send(("pdb", 5, {"prompt": "(Pdb) "}, []))
    reader.receive(reader.Waiter(), rs, 0, ours)
    assert theirs.recv() == ("pdb_cmd", 5, "q")


def test_output_counts_go_to_the_relay_and_a_kind_nobody_knows_is_let_go(wire):
    ours, theirs, rs = wire
    theirs.send(("sync", 2, {"stdout": 4}, []))
    theirs.send(("news", 2, None, ["seg-2"]))
    reader.receive(reader.Waiter(), rs, 0, ours)
    assert reader.receive(reader.Waiter(), rs, 0, ours)[0] == "news"
    assert rs.relay.expected == [(0, {"stdout": 4})]
    assert rs.released == [(0, ["seg-2"])]


def test_a_channel_that_ends_loses_its_rank_to_the_waiter(wire):
    ours, theirs, rs = wire
    theirs.sock.sendall(transport._HEADER.pack(5) + b"ab")  # a message cut short...
    theirs.sock.close()  # ...then the end of the stream
    waiter = reader.Waiter()
    assert reader.receive(waiter, rs, 0, ours) is None
    assert waiter.dead == {0}
