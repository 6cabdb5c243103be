"""A generation of an attached group that completes its join just as the group stops is told to
exit and its resources closed (issue 25, risk 5): nobody will ever take it.

The ranks' lifelines are real socket pairs; only the admission itself (the accept/ready loop,
tested with real workers in tests/integration/test_attach_regen.py) is replaced, by one that
finishes at the racy moment: after ``close()`` began.
"""
import socket
import threading
import time

import pytest

from nbdist.runtime import generations
from nbdist.runtime.processes import RemoteProcess
from nbdist.runtime.ranks import Rank
from nbdist.runtime.ready import Admission
from nbdist.wire import transport
from nbdist.wire.relay import OutputRelay

pytestmark = pytest.mark.timeout(60)


def test_a_generation_that_joins_as_the_group_stops_is_told_to_exit(monkeypatch):
    peers, joined = {}, threading.Event()

    def admit_until_closed(listener, key, world_size, ranks, relay, timeout, admission):
        for r in range(world_size):
            for stream in ("stdout", "stderr"):
                ours, theirs = socket.socketpair()
                relay.add(r, stream, ours)
                peers[(r, stream)] = theirs
            ranks[r] = Rank(r, RemoteProcess(r, 1000 + r, "node-host", relay, "1"))
            ranks[r].ready({})
        joined.set()
        while not regen._closed:  # the last rank joins right as the group stops
            time.sleep(0.01)
        return [ranks[r] for r in range(world_size)]

    monkeypatch.setattr(generations, "accept_until_ready", admit_until_closed)
    listener = transport.listen()
    group_relay = OutputRelay(lambda *a: None)
    relays = _relay_threads()
    regen = generations.Regenerator(listener, b"k" * 32, 2, {"timeout": 10.0}, group_relay, 10.0,
                                    lambda config, relay: Admission())
    knock = socket.create_connection(listener.getsockname())  # torchrun's restart knocks
    try:
        assert joined.wait(20)
        told = [_obey(peers, r) for r in range(2)]  # each fake worker exits when told
        regen.close()
        for t in told:
            t.join(10)
        assert [t.command for t in told] == [b"X", b"X"]  # told to exit (ABORT_EXIT_CODE)
        assert not regen.pending
        with pytest.raises(Exception, match="stopped"):
            regen.take(0.1)
        assert _relay_threads() == relays  # the generation's relay is closed
    finally:
        knock.close()
        group_relay.close()
        for s in peers.values():
            s.close()


def _relay_threads():
    return sum(t.name == "nbdist-output" for t in threading.enumerate())


def _obey(peers, rank):
    """A worker's watchdog: read the first command on stderr, then exit (close both streams)."""
    def watch():
        stderr = peers[(rank, "stderr")]
        stderr.settimeout(10)
        try:
            t.command = stderr.recv(1)
        except OSError:
            t.command = None
        peers[(rank, "stdout")].close()
        stderr.close()

    t = threading.Thread(target=watch)
    t.command = None
    t.start()
    return t
