"""Attached groups on a shared network (issue 20): every message after the handshake is signed.

Real ``python -m nbdist.worker`` ranks join through a TCP proxy (threads, loopback, or an address
of a network namespace this test makes) that can flip one byte of a message in flight.
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
from nbdist.wire import transport

from attach_helpers import free_port, veth_node, wait_for  # tests/integration, on sys.path

pytestmark = pytest.mark.timeout(180)

TAMPERED = "a message failed its integrity check (tampered or corrupted in transit)"
TOLD = "the other end refused a message sent to it: it failed its integrity check there"


class Proxy:
    """Forwards every connection to ``target``; :meth:`arm` flips one byte of the next chunk
    going ``up`` (rank -> controller) or down on the ``role`` connection of ``rank``."""

    def __init__(self, target, host="127.0.0.1"):
        self.target = target
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self.armed = None
        self.flipped = threading.Event()
        self.socks = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, role, rank, direction):
        self.flipped.clear()
        self.armed = (role, rank, direction)

    def _accept(self):
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.target)
            self.socks += [down, up]
            who = {}
            threading.Thread(target=self._pump, args=(down, up, "up", who), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, "down", who), daemon=True).start()

    def _pump(self, src, dst, direction, who):
        seen = b""
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            if direction == "up" and "role" not in who:  # the hello is signed, not secret
                seen += data
                for role in ("control", "stdout", "stderr"):
                    if f'"role": "{role}"'.encode() in seen:
                        rank = int(seen.split(b'"rank": ')[1].split(b",")[0])
                        who.update(role=role, rank=rank)
            with self._lock:
                if self.armed is not None and self.armed == (who.get("role"), who.get("rank"),
                                                             direction):
                    self.armed = None
                    data = bytearray(data)
                    data[len(data) // 2] ^= 0x10
                    data = bytes(data)
                    self.flipped.set()
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self):
        self.listener.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


class Ranks:
    """An attached group of ``world_size`` plain ``python -m nbdist.worker`` ranks that connect
    through a :class:`Proxy`; each rank's own stderr (the launcher's log) goes to a file."""

    def __init__(self, tmp_path, world_size=2, host="127.0.0.1", netns=None, **attach_kwargs):
        self.port = free_port(host)
        self.key_file = str(tmp_path / "key.hex")
        self.logs = [str(tmp_path / f"rank{r}.log") for r in range(world_size)]
        self.procs = []
        self.proxy = Proxy((host, self.port), host)
        box = {}

        def attach():
            try:
                box["g"] = nbdist.attach(world_size, listen=f"{host}:{self.port}",
                                         key_file=self.key_file, join_timeout=90, progress=False,
                                         timeout=30, **attach_kwargs)
            except BaseException as err:  # noqa: BLE001 -- re-raised below
                box["err"] = err

        t = threading.Thread(target=attach)
        t.start()
        wait_for(self.key_file)
        prefix = ["ip", "netns", "exec", netns] if netns else []
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size),
                       LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
            with open(self.logs[rank], "w") as log:
                self.procs.append(subprocess.Popen(
                    prefix + [sys.executable, "-m", "nbdist.worker", "--connect",
                              f"{host}:{self.proxy.port}", "--key-file", self.key_file],
                    env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True))
        t.join(120)
        if "err" in box:
            self.close()
            raise box["err"]
        self.group = box["g"]

    def log(self, rank):
        with open(self.logs[rank]) as f:
            return f.read()

    def close(self):
        try:
            if hasattr(self, "group"):
                self.group.stop()
        finally:
            for p in self.procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
            self.proxy.close()


@pytest.fixture
def protected(tmp_path):
    ranks = Ranks(tmp_path, protect=True)
    yield ranks
    ranks.close()


def _probe(port, key_file):
    """What the controller's handshake answers a key holder: its Seal, or None (unprotected)."""
    wait_for(key_file)
    key = bytes.fromhex(open(key_file).read())
    sock, seal = transport.connect_session(("127.0.0.1", port), key,
                                           {"rank": 99, "role": "control"})  # then refused
    sock.close()
    return seal


@pytest.mark.parametrize("protect, expected", [(None, False), (True, True), (False, False)])
def test_loopback_is_unprotected_by_default_and_protect_true_forces_it(tmp_path, protect,
                                                                      expected):
    port, key_file = free_port(), str(tmp_path / "key.hex")
    box = {}

    def attach():
        try:
            nbdist.attach(1, listen=f"127.0.0.1:{port}", key_file=key_file, join_timeout=3,
                          progress=False, protect=protect)
        except BaseException as err:  # noqa: BLE001 -- checked below
            box["err"] = err

    t = threading.Thread(target=attach)
    t.start()
    try:
        time.sleep(0.3)  # the key file is written just before the listener accepts
        assert (_probe(port, key_file) is not None) == expected
    finally:
        t.join(30)
    assert isinstance(box.get("err"), nbdist.DistTimeoutError)  # nobody joined


def test_a_protected_group_works_like_any_other(protected, capsys):
    g = protected.group
    assert g.run(lambda: __import__("torch").distributed.get_rank()) == [0, 1]
    assert g.exec("t = torch.ones(2) * (rank + 1); dist.all_reduce(t); t.tolist()") == \
        [[3.0, 3.0]] * 2
    import torch

    big = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: a message in three pieces
    g.push(big=big, x=5)
    assert g.pull("x") == [5, 5]
    assert all(torch.equal(t, big) for t in g.pull("big"))
    g.exec("print(f'hello from {rank}'); import sys; print(f'to stderr {rank}', file=sys.stderr)")
    out = capsys.readouterr()
    assert "[rank 0] hello from 0" in out.out and "[rank 1] hello from 1" in out.out
    assert "[rank 1] to stderr 1" in out.err
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(nbdist.GroupInterrupted, match="still usable"):
        g.exec("import time; time.sleep(60)")  # the interrupt travels as a signed command
    timer.join()
    assert g.run(lambda: 1) == [1, 1]
    g.stop()
    assert [p.wait(30) for p in protected.procs] == [0, 0]


def test_a_tampered_reply_is_refused_and_the_rank_reported(protected):
    protected.proxy.arm("control", 1, "up")
    with pytest.raises(nbdist.RankDiedError) as info:
        protected.group.run(lambda: "a reply worth tampering with")
    assert protected.proxy.flipped.is_set()
    assert f"rank 1 (host {socket.gethostname()}) lost its connection to the controller: {TAMPERED}" \
        in str(info.value)
    assert protected.procs[1].wait(30) == 73
    assert TOLD in protected.log(1)  # the rank's own stderr (the launcher's log) says why


def test_a_tampered_request_is_refused_by_the_rank(protected):
    protected.proxy.arm("control", 0, "down")
    with pytest.raises(nbdist.RankDiedError) as info:
        protected.group.run(lambda: "never run on rank 0")
    text = str(info.value)
    assert f"rank 0 (host {socket.gethostname()}) lost its connection to the controller: {TOLD}" \
        in text
    assert protected.procs[0].wait(30) == 73
    assert f"rank 0, connection to the controller: {TAMPERED}" in protected.log(0)
    assert TAMPERED in text  # the rank's line reached the caller too (its stderr tail)


def test_a_tampered_output_line_is_not_shown_and_the_rank_is_stopped(protected, capsys):
    protected.proxy.arm("stdout", 1, "up")
    with pytest.raises(nbdist.RankDiedError) as info:
        for _ in range(50):  # the call in flight may still finish; the rank is killed soon after
            protected.group.run(lambda: print("secret plans"))
            protected.proxy.flipped.wait(30)
    out = capsys.readouterr()
    assert "[rank 1] secret plans" not in out.out
    assert f"rank 1's stdout stream: {TAMPERED}" in str(info.value) + out.err
    assert protected.procs[1].wait(30) != 0


@pytest.fixture
def netns():
    """A network namespace "node" over a veth pair (10.251.x.0/30)."""
    with veth_node("np", "10.251") as node:
        yield node


def test_a_group_off_loopback_is_protected_without_being_asked(netns, tmp_path):
    ns, host_ip, node_ip = netns
    ranks = Ranks(tmp_path, host=host_ip, netns=ns)  # protect not given
    try:
        g = ranks.group
        assert g.exec("t = torch.ones(2) * (rank + 1); dist.all_reduce(t); t.tolist()") == \
            [[3.0, 3.0]] * 2
        seen = g.run(lambda: __import__("os").popen("ip -4 -o addr show").read())
        assert all(node_ip in s for s in seen)  # the ranks really are across the veth pair
        ranks.proxy.arm("control", 0, "up")
        with pytest.raises(nbdist.RankDiedError, match="integrity check"):
            g.run(lambda: 0)
    finally:
        ranks.close()


def test_a_tampered_lifeline_command_is_refused_by_the_rank(protected):
    protected.proxy.arm("stderr", 1, "down")  # the next command down rank 1's lifeline
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(nbdist.NbdistError):  # interrupted; rank 1 refused its "interrupt"
        protected.group.exec("import time; time.sleep(60)")
    timer.join()
    assert protected.proxy.flipped.is_set()
    assert protected.procs[1].wait(30) == 73
    assert f"rank 1, connection to the controller: {TAMPERED}" in protected.log(1)


def test_a_local_group_can_be_protected_too(capsys):
    import torch

    with nbdist.start(2, backend="gloo", device="cpu", protect=True) as g:
        assert all(ch.seal is not None for ch in (r.channel for r in g._inc.rs.ranks))
        g.exec("print(f'signed {rank}'); t = torch.arange(300_000.0)")
        assert all(torch.equal(t, torch.arange(300_000.0)) for t in g.pull("t"))
        out = capsys.readouterr().out
        assert "[rank 0] signed 0" in out and "[rank 1] signed 1" in out
    with nbdist.start(1, backend="gloo", device="cpu") as g:  # the default: plain, as before
        assert g._inc.rs.ranks[0].channel.seal is None
