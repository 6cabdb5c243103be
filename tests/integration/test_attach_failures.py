"""No job outlives a failure or a stop (issue 20): when a rank of an attached group dies, is killed
after an interrupt, or the controller (the notebook's kernel) dies or its host vanishes, every
remote worker exits -- even one blocked inside a collective -- and each torchrun agent exits with a
failure instead of holding its node.

The issue asks for "within 10 s". The bounds asserted here are 20 s (30 s for the keepalive path),
a correctness bound with room for this loaded 2-core machine, not a speed target; the measured
figures are in docs/benchmarks.md.
"""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import nbdist
from nbdist.wire.relay import ABORT_EXIT_CODE

from attach_helpers import (Cluster, controller, free_port, kill_tree, torchrun, wait_all,
                            wait_attached)
from test_attach import netns  # noqa: F401 -- the fixture: a network namespace "node"
from threaded import ctrl_c_elsewhere

pytestmark = pytest.mark.timeout(240)

BOUND = 20.0  # s: the 10 s, doubled for a loaded machine (see the module docstring)


@pytest.fixture
def four(tmp_path):
    c = Cluster(tmp_path, nnodes=2, nproc=2)
    yield c
    c.close(wait=5)


@pytest.fixture
def two(tmp_path):
    c = Cluster(tmp_path, nnodes=2, nproc=1)
    yield c
    c.close(wait=5)


def _agent_logs(cluster):
    return [p.stderr.read() for p in cluster.nodes]


def test_a_rank_death_ends_the_others_and_both_agents_fail(four):
    g = four.group
    with pytest.raises(nbdist.RankDiedError) as info:
        g.exec("import os\nif rank == 3:\n    os._exit(3)\nt = torch.ones(10); dist.all_reduce(t)")
    raised = time.monotonic()
    text = str(info.value)
    assert 3 in info.value.ranks
    assert f"told to exit (code {ABORT_EXIT_CODE}) so that torchrun/srun ends the job" in text
    assert "nbdist cannot restart ranks it did not start" in text
    assert "call restart()" not in text
    # the other node's ranks were blocked in the all_reduce with the dead rank: told to exit,
    # its agent fails too (before any stop(): the group ended them itself)
    assert wait_all(four.nodes, BOUND) is not None, f"agents alive {BOUND} s after the death"
    assert time.monotonic() - raised < BOUND
    assert all(p.returncode != 0 for p in four.nodes)
    logs = _agent_logs(four)
    assert "the controller ended this rank: its group failed" in logs[0]
    g.stop()
    assert g.state == "stopped"


def test_a_rank_dying_between_calls_ends_the_others(two):
    g = two.group
    g.exec("import os, threading\nif rank == 1:\n    threading.Timer(0.3, os._exit, (3,)).start()")
    assert wait_all(two.nodes, BOUND) is not None, "agents alive after a rank died while idle"
    assert [p.returncode != 0 for p in two.nodes] == [True, True]
    with pytest.raises(nbdist.RankDiedError) as info:
        g.run(lambda: 1)
    assert info.value.ranks == [1]
    assert f"Rank 0 was told to exit (code {ABORT_EXIT_CODE})" in str(info.value)


def test_an_interrupt_past_the_grace_period_ends_every_remote_rank(two):
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(nbdist.GroupInterrupted) as info:
        # rank 0 waits in a collective rank 1 never joins: SIGINT cannot reach it, it is killed
        two.group.exec("import time\nt = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(t)\n"
                       "else:\n    time.sleep(60)")
    timer.join()
    text = str(info.value)
    assert info.value.killed == [0] and "did not react within" in text
    assert f"rank 1 was told to exit (code {ABORT_EXIT_CODE})" in text
    assert "call restart()" not in text
    assert wait_all(two.nodes, BOUND) is not None, "agents alive after the interrupt"
    assert all(p.returncode != 0 for p in two.nodes)


def test_a_clean_stop_still_ends_the_agents_with_success(two):
    assert two.group.run(lambda: 1) == [1, 1]
    assert two.close() == [0, 0]


@pytest.mark.parametrize("code", ["import time; time.sleep(600)",
                                  "import time\nt = torch.ones(1)\nif rank == 0:\n"
                                  "    dist.all_reduce(t)\nelse:\n    time.sleep(600)"],
                         ids=["idle-in-a-call", "blocked-in-a-collective"])
def test_a_dead_kernel_ends_every_remote_worker_and_agent(tmp_path, code):
    ctl, port, key_file = controller(tmp_path, 2, code)
    rdzv = free_port()
    nodes = [torchrun(n, rdzv, port, key_file, nproc=1, nnodes=2) for n in range(2)]
    try:
        wait_attached(ctl)
        time.sleep(1.0)  # the call is on the ranks now
        ctl.kill()  # as the OOM killer would: no stop(), no FIN sent by nbdist
        ctl.wait()
        assert wait_all(nodes, BOUND) is not None, "workers outlived the kernel"
        assert all(p.returncode != 0 for p in nodes)
        assert "lost the controller" in nodes[0].stderr.read()
    finally:
        for p in nodes + [ctl]:
            kill_tree(p)
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()


def test_the_lifeline_keeps_alive_and_a_vanished_controller_host_ends_the_rank(netns, tmp_path):
    """A controller host that vanishes sends no FIN: TCP keepalive on the lifeline ends the rank
    (probes from 4 s idle; 10 s without an answer). The veth link to the rank's namespace is cut
    to play it."""
    ns, host_ip, _ = netns
    port = free_port()
    key_file = str(tmp_path / "key.hex")
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("g", nbdist.attach(
        1, listen=f"{host_ip}:{port}", key_file=key_file, join_timeout=90, progress=False,
        protect=False)))  # unsigned: fd 2 is then the lifeline socket itself, to read its options
    t.start()
    deadline = time.monotonic() + 30
    while not os.path.exists(key_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", OMP_NUM_THREADS="1")
    worker = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "nbdist.worker",
                               "--connect", f"{host_ip}:{port}", "--key-file", key_file], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    host_if = None
    try:
        t.join(120)
        g = box["g"]

        def lifeline_options():
            s = socket.socket(fileno=os.dup(2))
            try:
                return (s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                        s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                        s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                        s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT))
            finally:
                s.close()

        assert g.run(lifeline_options) == [(1, 4, 2, 3)]
        host_if = _veth_of(host_ip)
        subprocess.run(["ip", "link", "set", host_if, "down"], check=True, timeout=30)
        worker.wait(30)  # gone after ~10 s without an answer; 30 s: a bound, not a target
        assert worker.returncode == 70
        assert "lost the controller" in worker.stderr.read()
    finally:
        if host_if is not None:
            subprocess.run(["ip", "link", "set", host_if, "up"], timeout=30)
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        worker.stderr.close()
        if "g" in box:
            box["g"].stop()


def _veth_of(ip):
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                         timeout=30).stdout
    return next(line.split()[1] for line in out.splitlines() if f" {ip}/" in line)


@pytest.fixture
def restartable(tmp_path):
    c = Cluster(tmp_path, nnodes=2, nproc=1, max_restarts=1)
    yield c
    c.close(wait=5)


def test_a_torchrun_restart_is_a_new_generation_of_the_same_group(restartable):
    g = restartable.group
    g.push(x=5)
    with pytest.raises(nbdist.GroupClosedError, match="started by your launcher"):
        g.restart()  # a healthy group: torchrun would not restart anything
    with pytest.raises(nbdist.RankDiedError) as info:
        g.exec("import os\nif rank == 1:\n    os._exit(3)\nt = torch.ones(1); dist.all_reduce(t)")
    text = str(info.value)
    assert "Rank 0 was told to exit (code 75) so that torchrun restarts them all" in text
    assert "torchrun restarts the ranks (restart 1 of 1): they join this group again as " \
           "generation 2" in text and "variables on the ranks are gone" in text
    # no attach(): the next call waits for the restarted ranks and runs on them
    assert g.exec("t = torch.ones(2) * (rank + 1); dist.all_reduce(t); t.tolist()") == \
        [[3.0, 3.0]] * 2
    assert "generation 2, 2 ranks" in repr(g) and "generation 2, 2 ranks" in str(g.status())
    assert g.run(lambda: os.environ["TORCHELASTIC_RESTART_COUNT"]) == ["1", "1"]
    with pytest.raises(nbdist.RemoteError, match="name 'x' not defined"):
        g.pull("x")
    assert restartable.close() == [0, 0]  # a clean stop of generation 2 ends the job cleanly


def test_a_failure_after_the_last_restart_ends_the_job(restartable):
    g = restartable.group
    with pytest.raises(nbdist.RankDiedError):
        g.exec("import os\nif rank == 0:\n    os._exit(3)\nt = torch.ones(1); dist.all_reduce(t)")
    assert g.run(lambda: 1) == [1, 1]  # generation 2
    with pytest.raises(nbdist.RankDiedError) as info:
        g.exec("import os\nif rank == 0:\n    os._exit(3)\nt = torch.ones(1); dist.all_reduce(t)")
    assert "nbdist cannot restart ranks it did not start" in str(info.value)
    assert wait_all(restartable.nodes, BOUND) is not None, "agents alive after the last restart"
    assert all(p.returncode != 0 for p in restartable.nodes)
    with pytest.raises(nbdist.GroupClosedError, match="broken after an earlier failure .see the "
                       "error above.; nbdist cannot restart ranks that torchrun/srun started"):
        g.run(lambda: 1)


def _end_the_whole_job(c):
    """Kill the agents, then the workers, of cluster ``c``: nothing will restart. The next call
    reports the rank death; the one after it waits for a generation that never comes."""
    workers = [r.pid for r in c.group.status().ranks]
    for p in c.nodes:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    for pid in workers:  # torchrun's workers have sessions of their own
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(nbdist.RankDiedError):
        c.group.run(lambda: 1)


def test_a_restart_that_never_comes_is_reported_after_join_timeout(tmp_path):
    c = Cluster(tmp_path, nnodes=2, nproc=1, max_restarts=1, join_timeout=40)
    try:
        # 40 s for the first join (two torchruns on a loaded machine); the wait for a next
        # generation reads the same setting when it starts: 6 s of it is enough to test
        c.group._launcher.join_timeout = 6
        _end_the_whole_job(c)
        began = time.monotonic()
        with pytest.raises(nbdist.NbdistError, match="no new generation of ranks joined within "
                                                     "6 s .did torchrun restart them"):
            c.group.run(lambda: 1)
        assert time.monotonic() - began >= 6  # it waited the whole join_timeout
    finally:
        c.close(wait=5)


def test_a_ctrl_c_another_thread_received_stops_the_wait_for_a_restart(tmp_path):
    """Was: the wait for torchrun's next generation slept until join_timeout (600 s by default)
    when the OS gave the SIGINT to another thread."""
    c = Cluster(tmp_path, nnodes=1, nproc=1, max_restarts=1, join_timeout=120)
    try:
        _end_the_whole_job(c)
        began = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            with ctrl_c_elsewhere(1.0):
                c.group.run(lambda: 1)  # waits for a generation that never comes
        assert time.monotonic() - began < 60  # (was: the whole join_timeout)
    finally:
        c.close(wait=5)


def test_a_next_generation_that_fails_to_join_is_reported_and_the_group_goes_on(tmp_path, capfd):
    from nbdist.wire import transport

    c = Cluster(tmp_path, nnodes=1, nproc=1)
    try:
        key = bytes.fromhex(open(c.key_file).read())
        hello = {"rank": 0, "role": "control", "pid": 1, "world_size": 1}
        impostor = transport.Channel(transport.connect(("127.0.0.1", c.port), key, hello))
        assert impostor.recv()[0] == "config"  # admitted as generation 2's rank 0 ...
        impostor.close()  # ... which then dies before it is ready
        deadline = time.monotonic() + 30
        err = ""
        while "tried to join and failed" not in err and time.monotonic() < deadline:
            time.sleep(0.2)
            err += capfd.readouterr().err
        assert "nbdist: a new generation of ranks tried to join and failed: rank 0" in err
        assert c.group.run(lambda: 1) == [1]  # generation 1 goes on
    finally:
        assert c.close() == [0]


def test_a_stop_right_after_a_failure_ends_the_job_torchrun_restarts(restartable):
    g = restartable.group
    with pytest.raises(nbdist.RankDiedError, match="generation 2"):
        g.exec("import os\nif rank == 1:\n    os._exit(3)\nt = torch.ones(1); dist.all_reduce(t)")
    g.stop()  # the restarted ranks find the group gone: they exit, torchrun's restarts run out
    assert wait_all(restartable.nodes, BOUND) is not None, "agents alive after the stop"
    assert all(p.returncode != 0 for p in restartable.nodes)


def test_the_next_generation_of_a_signed_group_is_signed_too(tmp_path):
    piped = "import os, stat\nstat.S_ISFIFO(os.fstat(1).st_mode)"  # signed: fd 1 is a pipe
    c = Cluster(tmp_path, nnodes=2, nproc=1, max_restarts=1, protect=True)
    try:
        g = c.group
        assert g.exec(piped) == [True, True]
        with pytest.raises(nbdist.RankDiedError):
            g.exec("import os\nif rank == 1:\n    os._exit(3)\nt = torch.ones(1); dist.all_reduce(t)")
        assert g.exec(piped) == [True, True]  # generation 2, admitted in the background
        assert "generation 2" in repr(g)
    finally:
        c.close(wait=5)
