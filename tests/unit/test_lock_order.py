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
    assert len(locks.violations()) == 1 and "group -> ranks -> generations" in locks.violations()[0]


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


def test_module_level_locks_made_at_import_are_checked_too(checked):
    """Was: the leaf locks (the spares' pool, the __main__ swap, a rank's raise lock, a job's
    pauses, the stacks box, the launcher panel's refresh) were plain ``threading.Lock`` s, made at
    import time before the suite turned the check on: the checker never saw them."""
    from nbdist.runtime import forkserver, spares, worker_signals

    for lock in (spares._Pool.lock._lock, forkserver._Hidden.lock, worker_signals._RAISING):
        assert isinstance(lock, locks.OrderedLock), lock
    with forkserver._Hidden.lock:  # a leaf: nothing may be taken under it
        with pytest.raises(locks.LockOrderError, match="took lock 'group' while holding 'main'"):
            locks.make("group", reentrant=True).acquire()
    plain = locks.make("spares", module_level=True)
    locks.check(False)
    try:  # made for import time: usable, and unchecked, while the suite does not check
        with plain, locks.make("group", reentrant=True):
            pass
    finally:
        locks.check(True)


def test_a_rank_moved_without_its_rank_set_s_lock_fails_the_suite(checked):
    """The threading model says a rank's state moves only under its rank set's ``ranks`` lock
    (nbdist.runtime.ranks): code that differs -- as the job thread's replied() / died() did,
    holding no lock -- is recorded, so the test that ran it fails."""
    from nbdist.runtime.processes import Process
    from nbdist.runtime.ranks import Rank, RankSet
    from nbdist.wire.relay import OutputRelay

    class Idle(Process):
        exit_status = None

    import socket
    server = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(server.getsockname())
    b, _ = server.accept()
    server.close()
    relay = OutputRelay(lambda *line: None)
    try:
        from nbdist.wire.transport import Channel

        rank = Rank(0, Idle(), Channel(a))
        rank.ready({})  # starting -> idle: no rank set yet, the starting thread owns it
        rs = RankSet([rank], relay)
        with rs.lock:
            rank.begin("x", 0.0)
        with pytest.raises(locks.LockOrderError, match="moved rank 0 from 'busy' to 'idle' "
                                                       "without holding lock 'ranks'"):
            rank.replied()
        assert any("without holding lock 'ranks'" in v for v in locks.violations())
        assert rank.state == "busy"
    finally:
        relay.close()
        a.close()
        b.close()
