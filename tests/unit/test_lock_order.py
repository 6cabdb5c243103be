"""The controller's lock order (nbdist.wire.locks): the checker the whole suite runs under catches a
lock taken out of order, in any thread, and stays out of the way of correct use."""
import threading

import pytest

from nbdist.wire import locks


@pytest.fixture
def checked():
    was = locks._checking
    locks.check(True)
    yield
    locks.check(was)
    locks.violations(clear=True)  # this file's deliberate inversions are not the suite's


def test_the_suite_runs_with_the_check_on():
    assert isinstance(locks.make("group", reentrant=True), locks.OrderedLock)


def test_locks_taken_in_order_pass_and_reentrant_ones_nest(checked):
    group, relay, channel = (locks.make("group", True), locks.make("relay", True),
                             locks.make("channel"))
    with group, group, relay, relay, channel:
        pass
    assert locks.violations() == []


def test_a_lock_taken_out_of_order_raises_and_is_recorded(checked):
    group, relay = locks.make("group", True), locks.make("relay", True)
    with relay:
        with pytest.raises(locks.LockOrderError, match="took lock 'group' while holding 'relay'"):
            group.acquire()
    assert not group._is_owned() and not relay._is_owned()
    assert len(locks.violations()) == 1 and "group -> generations" in locks.violations()[0]


def test_an_inversion_in_another_thread_is_recorded_for_the_suite(checked):
    output, metrics = locks.make("output"), locks.make("metrics")

    def wrong():
        with metrics:
            try:
                output.acquire()
            except locks.LockOrderError:
                pass

    t = threading.Thread(target=wrong, name="inverter")
    t.start()
    t.join(10)
    assert any("'inverter' took lock 'output' while holding 'metrics'" in v
               for v in locks.violations())


def test_two_locks_of_one_name_may_not_nest_unless_declared(checked):
    a, b = locks.make("channel"), locks.make("channel")
    with a:
        with pytest.raises(locks.LockOrderError):
            b.acquire()
    r1, r2 = locks.make("relay", True), locks.make("relay", True)
    with r1, r2:  # OutputRelay.move_to: a generation's relay into the group's
        pass


def test_a_condition_waits_on_an_ordered_lock(checked):
    cond = threading.Condition(locks.make("generations", True))
    box = []

    def give():
        with cond:
            box.append(1)
            cond.notify_all()

    with cond:
        threading.Thread(target=give).start()
        assert cond.wait_for(lambda: box, timeout=10)
        assert cond._is_owned()
    assert locks.violations() == []


def test_unknown_names_and_plain_locks_when_not_checking():
    with pytest.raises(ValueError, match="unknown lock name 'grp'"):
        locks.make("grp")
    was = locks._checking
    locks.check(False)
    try:
        assert not isinstance(locks.make("group", True), locks.OrderedLock)
    finally:
        locks.check(was)
