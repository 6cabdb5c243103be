"""A node of an attached group that vanishes -- power lost, cable pulled: no FIN, no RST, nothing --
is noticed by the controller (issue 25, risk 2).

Node 1 is a network namespace behind a veth pair; it vanishes when a blackhole route inside it
drops everything it would send to the controller's host (its ranks' keepalive answers, output and
replies alike), while the link itself stays up, as a switch port does when a host loses power.
Node 0 is rank 0 in this namespace.
"""
import os
import subprocess
import sys
import threading
import time

import pytest

import nbdist
from nbdist.wire.relay import ABORT_EXIT_CODE

from attach_helpers import free_port, veth_node, wait_for

pytestmark = pytest.mark.timeout(180)

#: s from the cut to the RankDiedError: the issue's bound ("within 15 s, with default settings"),
#: asserted as given. The controller's sockets give up after 10 s without an answer.
NOTICED_WITHIN = 15.0


def _sh(*cmd):
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=True)


def _interface(ip, ns=None):
    """The name of the interface that holds ``ip`` (in namespace ``ns``)."""
    prefix = ("ip", "netns", "exec", ns) if ns else ()
    out = _sh(*prefix, "ip", "-o", "-4", "addr", "show").stdout
    return next(line.split()[1] for line in out.splitlines() if f" {ip}/" in line)


class Nodes:
    """An attached group with default settings: ``here`` ranks here (node 0), then ``there`` in
    the namespace (node 1); gloo runs over the veth pair."""

    def __init__(self, netns, tmp_path, here=1, there=1):
        self.ns, self.host_ip, self.node_ip = netns
        port = free_port()
        key_file = str(tmp_path / "key.hex")
        box = {}

        def attach():
            try:
                box["g"] = nbdist.attach(here + there, listen=f"{self.host_ip}:{port}", key_file=key_file,
                                         join_timeout=90, progress=False)
            except BaseException as err:  # noqa: BLE001 -- re-raised below
                box["err"] = err

        t = threading.Thread(target=attach)
        t.start()
        wait_for(key_file)
        worker = [sys.executable, "-m", "nbdist.worker", "--connect", f"{self.host_ip}:{port}",
                  "--key-file", key_file]
        self.procs = []
        nodes = [((), _interface(self.host_ip))] * here + \
            [(("ip", "netns", "exec", self.ns), _interface(self.node_ip, self.ns))] * there
        for rank, (prefix, ifname) in enumerate(nodes):
            node, local = (0, rank) if rank < here else (1, rank - here)
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(len(nodes)),
                       LOCAL_RANK=str(local), GROUP_RANK=str(node), OMP_NUM_THREADS="1",
                       GLOO_SOCKET_IFNAME=ifname)
            self.procs.append(subprocess.Popen([*prefix, *worker], env=env,
                                               stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL))
        t.join(120)
        if "err" in box:
            self.close()
            raise box["err"]
        self.group = box["g"]
        self.cut_at = None

    def cut(self):
        """Node 1 vanishes: nothing it sends reaches this host any more."""
        _sh("ip", "netns", "exec", self.ns, "ip", "route", "add", "blackhole",
            f"{self.host_ip}/32")
        self.cut_at = time.monotonic()

    def close(self):
        if self.cut_at is not None:  # let the FINs through again: the group can end cleanly
            subprocess.run(["ip", "netns", "exec", self.ns, "ip", "route", "del", "blackhole",
                            f"{self.host_ip}/32"], capture_output=True, timeout=30)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if hasattr(self, "group"):
            self.group.stop()


@pytest.fixture
def netns():
    with veth_node("nv", "10.252") as node:
        yield node


@pytest.fixture
def nodes(netns, tmp_path):
    two = Nodes(netns, tmp_path)
    yield two
    two.close()


def test_a_node_that_vanishes_during_a_call_is_reported_by_name(nodes):
    g = nodes.group
    assert g.exec("t = torch.ones(1) * (rank + 1); dist.all_reduce(t); t.item()") == [3.0, 3.0]
    box = {}

    def call():  # the caller's thread, blocked in a call with no deadline (the default)
        try:
            g.exec("import time\nt = torch.ones(1)\nwhile True:\n    dist.all_reduce(t)\n"
                   "    time.sleep(0.01)")
        except BaseException as err:  # noqa: BLE001 -- checked below
            box["err"] = err
        box["at"] = time.monotonic()

    t = threading.Thread(target=call)
    t.start()
    time.sleep(2.0)  # the collectives run across the veth pair now
    nodes.cut()
    t.join(NOTICED_WITHIN + 30)
    assert not t.is_alive(), "the call still waits on a node that vanished 45 s ago"
    err = box["err"]
    assert isinstance(err, nbdist.RankDiedError), repr(err)
    took = box["at"] - nodes.cut_at
    assert took < NOTICED_WITHIN, f"noticed after {took:.1f} s"
    text = str(err)
    assert 1 in err.ranks and "rank 1 (node 1, host " in text
    assert "no answer from its host for 10 s" in text
    assert f"told to exit (code {ABORT_EXIT_CODE})" in text  # rank 0, blocked in all_reduce
    assert nodes.procs[0].wait(30) == ABORT_EXIT_CODE


def test_stopping_a_group_whose_node_vanished_waits_once_not_per_rank(netns, tmp_path):
    """Risk 3: a teardown waited ~11 s for each unreachable rank (5 s per stream to see it gone,
    then 0.5 s more per stream), under the group's lock. Now every wait is one deadline shared by
    all ranks (issue 34: one deadline for the whole teardown, 7.5 s by default), whatever their
    number, and the stop says which ranks it could not see end. Asserted: under 11 s for three
    unreachable ranks, less than one rank used to cost (they used to take about 37 s)."""
    three = Nodes(netns, tmp_path, here=0, there=3)
    try:
        assert three.group.run(lambda: 1) == [1, 1, 1]
        three.cut()
        start = time.monotonic()
        with pytest.raises(nbdist.DistTimeoutError, match=r"the group is stopped, but ranks "
                           r"0, 1, 2 could not be confirmed gone within 7.5 s: rank 0: it did not "
                           r"end within the time left \(its host does not answer\?\)"):
            three.group.stop()  # before keepalive could tell that the node is gone
        took = time.monotonic() - start
        assert three.group.state == "stopped"
        assert took < 11.0, f"stop() took {took:.1f} s for 3 unreachable ranks"
    finally:
        three.close()


def _stop_from_another_thread(g):
    """stop(timeout=0.2) from a second thread; returns (thread, box with its error)."""
    box = {}

    def stop():
        try:
            g.stop(timeout=0.2)
        except BaseException as err:  # noqa: BLE001 -- checked by the test
            box["err"] = err

    t = threading.Thread(target=stop)
    t.start()
    return t, box


def test_a_stop_that_waits_for_another_stop_says_so(netns, tmp_path):
    """Risk 6, a third case: one thread's stop() waits for unreachable ranks (7 s at least); a
    stop(timeout=0.2) from another thread cannot take the group 5 s later and says what holds it."""
    two = Nodes(netns, tmp_path, here=0, there=2)
    try:
        g = two.group
        assert g.run(lambda: 1) == [1, 1]
        two.cut()
        said = {}

        def first_stop():
            try:
                g.stop()
            except nbdist.DistTimeoutError as err:  # the unreachable ranks, named
                said["err"] = err

        first = threading.Thread(target=first_stop)
        first.start()
        assert wait_for_state(lambda: g._stopping), "the first stop never began"
        second, box = _stop_from_another_thread(g)
        second.join(30)
        err = box.get("err")
        assert isinstance(err, nbdist.GroupBusyError), repr(err)
        assert str(err) == ("stop(timeout=0.2) could not stop the group: another thread still "
                            "holds it 5 s later (stopping ranks). The stop is recorded: that "
                            "thread stops the group as soon as it is done; call stop() again to "
                            "wait for it.")
        first.join(30)
        assert g.state == "stopped"
        assert said["err"].ranks == [0, 1], said
    finally:
        two.close()


def test_a_stop_during_a_call_to_a_vanished_node_kills_the_call_s_ranks_and_says_so(nodes):
    """Risk 6: stop(timeout=0.2) from another thread kills the call's ranks; the call's thread
    then tears the group down within the stop's time (issue 34: it used to wait for the
    unreachable rank's end past it, and the stop raised GroupBusyError), and the stop says which
    rank it could not see end."""
    g = nodes.group
    box = {}

    def call():
        try:
            g.exec("import time\nwhile True:\n    time.sleep(0.01)")
        except BaseException as err:  # noqa: BLE001 -- checked below
            box["err"] = err

    caller = threading.Thread(target=call)
    caller.start()
    assert wait_for_state(lambda: g.state == "busy")
    nodes.cut()
    second, stop_box = _stop_from_another_thread(g)
    second.join(30)
    err = stop_box.get("err")
    assert isinstance(err, nbdist.DistTimeoutError), repr(err)
    assert str(err).startswith("the group is stopped, but rank 1 could not be confirmed gone "
                               "within 5 s: rank 1: it did not end within the time left (its "
                               "host does not answer?)."), str(err)
    caller.join(NOTICED_WITHIN + 30)
    assert not caller.is_alive()
    assert isinstance(box.get("err"), nbdist.GroupClosedError), repr(box.get("err"))
    assert g.state == "stopped"


def wait_for_state(check, within=30.0):
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
