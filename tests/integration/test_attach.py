"""Ranks started by torchrun on two "nodes" (two torchrun invocations on this machine) joining one
notebook-side controller (issue 10)."""
import os
import subprocess
import sys
import threading
import time

import pytest

import nbdist

# tests/integration, on sys.path
from attach_helpers import Cluster, free_port as _free_port, veth_node
from threaded import ctrl_c_elsewhere

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def test_two_torchrun_nodes_join_one_controller(cluster):
    g = cluster.group
    assert g.run(lambda: __import__("torch").distributed.get_rank()) == [0, 1]
    assert g.exec("t = torch.ones(2) * (rank + 1); dist.all_reduce(t); t.tolist()") == [[3.0, 3.0]] * 2
    assert g.run(lambda: os.environ.get("TORCHELASTIC_RUN_ID") is not None) == [True, True]
    g.push(x=5)
    assert g.pull("x") == [5, 5]
    st = g.status()
    assert [r.state for r in st.ranks] == ["idle", "idle"]
    with pytest.raises(nbdist.GroupClosedError, match="started by your launcher"):
        g.restart()
    assert cluster.close() == [0, 0]  # stop ends the workers and torchrun's agents cleanly


def test_interrupt_reaches_remote_ranks_and_their_stacks_are_seen(cluster):
    import signal

    seen = []

    def look_then_interrupt():  # issue 27: the stacks of attached ranks, while they are busy
        time.sleep(1.0)
        seen.append(cluster.group.stacks(timeout=10))
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Thread(target=look_then_interrupt)
    timer.start()
    with pytest.raises(nbdist.GroupInterrupted, match="still usable"):
        cluster.group.exec("import time\ndef nap():\n    time.sleep(60)\nnap()")
    timer.join()
    (line,) = seen[0].summary().splitlines()
    assert line.startswith("ranks 0, 1: <dist-cell-") and line.endswith(" nap"), line
    assert cluster.group.run(lambda: 1) == [1, 1]


def test_a_dying_remote_rank_is_reported_with_its_node(cluster):
    with pytest.raises(nbdist.RankDiedError) as info:
        cluster.group.exec("import os, sys\nif rank == 1:\n"
                           "    print('node going down', file=sys.stderr, flush=True); os._exit(3)\n"
                           "t = torch.ones(10); dist.all_reduce(t)")
    text = str(info.value)
    assert "rank 1" in text and "lost its connection" in text and "node going down" in text


def test_a_ctrl_c_another_thread_received_stops_the_wait_for_ranks_to_join(tmp_path):
    """Was: attach() slept in select() until a rank came or join_timeout passed (600 s by
    default; 24 h for SLURM and Kubernetes jobs) when the OS gave the SIGINT to another thread."""
    key_file = tmp_path / "key.hex"
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_elsewhere(1.0, ready=key_file.exists):  # (written before attach() listens)
            nbdist.attach(1, listen=f"127.0.0.1:{_free_port()}", key_file=str(key_file),
                          join_timeout=120, progress=False)
    assert time.monotonic() - began < 60  # (was: the whole join_timeout)


def test_a_worker_with_the_wrong_key_is_refused(tmp_path):
    port = _free_port()
    key_file = str(tmp_path / "key.hex")
    wrong = tmp_path / "wrong.hex"
    wrong.write_text(os.urandom(32).hex())
    with pytest.raises(nbdist.DistTimeoutError, match="rank 0 did not join within 8 s; 0 of 1"):
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("p", _wrong_worker(port, str(wrong))))
        t.start()
        try:
            nbdist.attach(1, listen=f"127.0.0.1:{port}", key_file=key_file, join_timeout=8,
                          progress=False)
        finally:
            t.join(60)
    p = box["p"]
    out, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "refused this connection: wrong group key" in err
    assert "RuntimeWarning" not in err


def _wrong_worker(port, key_file):
    time.sleep(1.0)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1")
    return subprocess.Popen([sys.executable, "-m", "nbdist.worker", "--connect",
                             f"127.0.0.1:{port}", "--key-file", key_file], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_listen_address_is_checked():
    with pytest.raises(ValueError, match="not on all interfaces"):
        nbdist.attach(2, listen="0.0.0.0:0")
    with pytest.raises(ValueError, match="listen must look like 'HOST:PORT'"):
        nbdist.attach(2, listen="localhost")


def test_worker_outside_a_launcher_says_what_is_missing(tmp_path):
    key = tmp_path / "k.hex"
    key.write_text("00" * 32)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID",
                                                             "PMI_RANK")}
    out = subprocess.run([sys.executable, "-m", "nbdist.worker", "--connect", "127.0.0.1:1",
                          "--key-file", str(key)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "$RANK is not set: start this worker with torchrun" in out.stderr


@pytest.fixture
def netns():
    """A network namespace "node" over a veth pair (10.250.x.0/30)."""
    with veth_node("nb", "10.250") as node:
        yield node


def test_controller_and_ranks_on_different_addresses(netns, tmp_path):
    ns, host_ip, node_ip = netns
    port = _free_port()
    key_file = str(tmp_path / "key.hex")
    box = {}

    def attach():
        try:
            box["g"] = nbdist.attach(2, listen=f"{host_ip}:{port}", key_file=key_file,
                                     join_timeout=90, progress=False, timeout=30)
        except BaseException as err:  # noqa: BLE001 -- re-raised below
            box["err"] = err

    t = threading.Thread(target=attach)
    t.start()
    deadline = time.monotonic() + 30
    while not os.path.exists(key_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "nbdist.worker", "--connect",
             f"{host_ip}:{port}", "--key-file", key_file], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        t.join(120)
        if "err" in box:
            raise box["err"]
        g = box["g"]
        assert g.exec("t = torch.ones(2) * (rank + 1); dist.all_reduce(t); t.tolist()") == \
            [[3.0, 3.0]] * 2
        # the ranks really are on the other side of the veth pair
        seen = g.run(lambda: __import__("os").popen("ip -4 -o addr show").read())
        assert all(node_ip in s for s in seen)
        g.stop()
        for p in procs:
            assert p.wait(30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_rank_joining_twice_is_refused_and_attach_keeps_its_deadline(tmp_path):
    from nbdist.wire import transport

    port = _free_port()
    key_file = str(tmp_path / "key.hex")
    box = {}

    def attach():
        try:
            box["g"] = nbdist.attach(1, listen=f"127.0.0.1:{port}", key_file=key_file,
                                     join_timeout=5, progress=False, backend="gloo", device="cpu")
        except BaseException as err:  # noqa: BLE001 -- checked below
            box["err"] = err

    t = threading.Thread(target=attach)
    t.start()
    deadline = time.monotonic() + 30
    while not os.path.exists(key_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    key = bytes.fromhex(open(key_file).read())
    hello = {"rank": 0, "role": "control", "pid": 1, "world_size": 1}
    first = transport.Channel(transport.connect(("127.0.0.1", port), key, hello))
    assert first.recv()[0] == "config"
    second = transport.Channel(transport.connect(("127.0.0.1", port), key, hello))
    with pytest.raises(ConnectionError):
        second.recv()  # refused: rank 0 has already joined
    t.join(30)
    first.close()
    second.close()
    assert isinstance(box.get("err"), nbdist.DistTimeoutError)  # first never said ready: 5 s
