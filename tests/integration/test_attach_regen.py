"""A generation of ranks that torchrun restarts while the group stops is ended, not left holding
the nodes (issue 25, risk 5); a signed group's next generation is signed as the first was (issue
34, risk 1).

Node 1's restarted worker starts late (a wrapper sleeps before ``nbdist.worker``), so ``stop()``
lands while generation 2 is half joined: rank 0 has connected and waits in the rendezvous for
rank 1.
"""
import os
import sys
import threading
import time

import psutil
import pytest

import nbdist

from attach_helpers import Cluster, free_port, kill_tree, torchrun, wait_all, wait_for

pytestmark = pytest.mark.timeout(240)

#: s: the agents end long before the rendezvous gives up (the default timeout, 60 s) or
#: join_timeout (120 s) once the group stops
BOUND = 30.0

LATE = r"""
import os, runpy, sys, time
if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" and os.environ["GROUP_RANK"] == "1":
    time.sleep(float(os.environ["LATE_BY"]))  # node 1's restarted worker comes late
runpy.run_module("nbdist.runtime.worker", run_name="__main__", alter_sys=True)
"""


def _connections_to(port):
    return [c for c in psutil.Process().net_connections("inet")
            if c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED]


@pytest.fixture
def late_node(tmp_path):
    """Two torchrun nodes (``--max-restarts=1``) attached to a group; yields ``(group, agents,
    port)``."""
    port, rdzv = free_port(), free_port()
    key_file = str(tmp_path / "key.hex")
    script = tmp_path / "late_worker.py"
    script.write_text(LATE)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("g", nbdist.attach(
        2, listen=f"127.0.0.1:{port}", key_file=key_file, join_timeout=120, progress=False)))
    t.start()
    wait_for(key_file)
    agents = [torchrun(n, rdzv, port, key_file, max_restarts=1, env={"LATE_BY": "10"},
                       worker=[str(script)]) for n in range(2)]
    t.join(180)
    try:
        yield box["g"], agents, port
    finally:
        if "g" in box:
            box["g"].stop()
        for p in agents:
            kill_tree(p)
            p.stderr.close()


def test_a_stop_while_a_restarted_generation_joins_ends_it(late_node):
    g, agents, port = late_node
    with pytest.raises(nbdist.RankDiedError, match="generation 2"):
        g.exec("import os\nif rank == 1:\n    os._exit(3)\nt = torch.ones(1); dist.all_reduce(t)")
    deadline = time.monotonic() + 60
    while len(_connections_to(port)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)  # generation 2's rank 0: stdout, stderr, control
    assert len(_connections_to(port)) == 3, "generation 2's rank 0 never connected"
    g.stop()  # node 1's worker is still asleep: generation 2 is half joined
    assert wait_all(agents, BOUND) is not None, "the restarted ranks hold the nodes after stop()"
    assert all(p.returncode != 0 for p in agents)
    told = "the controller ended this rank: its group failed"
    assert agents[0].stderr.read().count(told) == 2  # generation 1's rank 0, then generation 2's
    assert _connections_to(port) == []


def test_a_signed_groups_restarted_generation_is_signed_too(tmp_path):
    """Issue 34, risk 1: generation 2's streams joined the group's relay without their seal.
    Its output was shown as raw frame bytes, and its interrupt, stacks, kill and abort commands
    went unsigned: the worker refused them (exit 73), so a timeout never interrupted those ranks.
    ``protect=True`` signs on loopback as on a shared network."""
    cluster = Cluster(tmp_path, max_restarts=1, protect=True)
    g = cluster.group
    try:
        with pytest.raises(nbdist.RankDiedError, match="generation 2"):
            g.exec("import os\nif rank == 1:\n    os._exit(3)\n"
                   "t = torch.ones(1); dist.all_reduce(t)")
        assert g.exec("print('hello from generation 2')\nrank") == [0, 1]  # generation 2's
        assert all("hello from generation 2" in g.last_output[r] for r in (0, 1)), g.last_output
        with pytest.raises(nbdist.DistTimeoutError, match="ranks 0, 1 still running after 2 s; "
                           "stopped on SIGINT; the group is still usable") as info:
            g.exec("import time\ntime.sleep(60)", timeout=2)
        assert info.value.stacks is not None  # the stacks request reached them, signed
        assert g.exec("rank") == [0, 1]
    finally:
        codes = cluster.close()
    assert codes == [0, 0], codes  # generation 2 stopped cleanly: no rank refused a command
