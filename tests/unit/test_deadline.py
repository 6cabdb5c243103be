"""One deadline for a chain of waits (nbdist.wire.deadline), and the one reaper
(nbdist.runtime.reaper) bounded by it, whatever the processes do."""
import threading
import time

import pytest

from nbdist.runtime.processes import Process
from nbdist.runtime.reaper import KILLED_S, reap
from nbdist.wire.deadline import Deadline, poll_until

pytestmark = pytest.mark.timeout(60)
#: a hang guard, not a speed target: the bound each check below allows itself
GUARD = 5.0


def test_a_deadline_says_what_is_left_and_never_goes_below_zero():
    never = Deadline(None)
    assert never.left() is None and never.left(cap=2.0) == 2.0 and not never.passed()
    soon = Deadline(0.0)
    assert soon.passed() and soon.left() == 0.0 and soon.left(cap=1.0) == 0.0
    later = Deadline(100.0)
    assert 0 < later.left() <= 100.0 and later.left(cap=1.0) == 1.0
    assert Deadline.earliest(later, soon, None, never).at == soon.at
    assert Deadline.earliest(never, None).at is None
    assert repr(never) == "<Deadline never>" and repr(soon) == "<Deadline in 0.000 s>"


def test_poll_until_asks_first_and_stops_at_the_deadline():
    steps = []
    assert poll_until(lambda: True, steps.append, Deadline(0.0))
    assert steps == []  # nothing waits for what is already true
    assert not poll_until(lambda: False, lambda left: steps.append(left), Deadline(0.0))
    flag = threading.Event()
    threading.Timer(0.05, flag.set).start()
    assert poll_until(flag.is_set, lambda left: flag.wait(left), Deadline(GUARD), cap=0.01)


class Unreachable(Process):
    """A rank whose host stopped answering: killing it changes nothing, joining waits."""

    def __init__(self):
        self.kills, self.waited, self.released = 0, [], False

    @property
    def exit_status(self):
        return None

    def kill(self):
        self.kills += 1

    def join(self, timeout=None):
        self.waited.append(timeout)
        time.sleep(timeout or 0.0)

    def release(self):
        self.released = True


class Obedient(Unreachable):
    """A process that ends when killed."""

    @property
    def exit_status(self):
        return 0 if self.kills else None


def test_reap_shares_one_deadline_and_returns_what_it_left():
    procs = [Unreachable() for _ in range(3)] + [Obedient()]
    began = time.monotonic()
    left = reap(procs, Deadline(0.3), asked=Deadline(0.1))
    took = time.monotonic() - began
    assert left == procs[:3]  # what did not end, handles kept
    assert all(p.kills == 1 for p in procs) and procs[3].released
    assert not any(p.released for p in procs[:3])
    assert took < 0.3 + KILLED_S + GUARD  # hang guard: one wait for all, not one each
    assert sum(sum(p.waited) for p in procs) <= 0.3 + KILLED_S + 0.1 * 3 + 0.05  # shared
