"""Two torchrun "nodes" on this machine (two torchrun invocations, static rendezvous) whose ranks
join one notebook-side :func:`nbdist.attach` group: shared by the attached-group tests."""
import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import nbdist


def _ephemeral_low():
    """The lowest port the kernel hands out by itself (bind to port 0, outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152  # macOS and Windows (IANA's dynamic range)


def free_port(host="127.0.0.1"):
    """A TCP port free on ``host`` right now, for a process the test starts later to bind.

    Picked below the kernel's ephemeral range where there is room: a port from ``bind(0)`` could
    be handed to another process (a gloo pair, a TCPStore on port 0, an outgoing connection; other
    test runs share the machine) before the test's process binds it."""
    low = _ephemeral_low()
    for _ in range(100) if low > 12_000 else ():
        port = random.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # taken (or in TIME_WAIT): another one
                continue
            return port
    with socket.socket() as s:  # no room below the range (a tuned machine): as the kernel picks
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent():
    """In the child before exec: its own session (killpg reaches its workers), and SIGKILL when
    the test process dies -- a killed test run leaves no torchrun agent behind."""
    os.setsid()
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def torchrun(node_rank, rdzv_port, port, key_file, nproc=1, nnodes=2, max_restarts=0, env=None,
             stdout=subprocess.DEVNULL, worker=("-m", "nbdist.worker")):
    """Start one torchrun agent ("node" ``node_rank``) running ``python -m nbdist.worker`` (or
    ``python *worker``: a script that runs it)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
           f"--nproc-per-node={nproc}", "--rdzv-backend=static", f"--node-rank={node_rank}",
           "--master-addr=127.0.0.1", f"--master-port={rdzv_port}",
           f"--max-restarts={max_restarts}",
           *worker, "--connect", f"127.0.0.1:{port}", "--key-file", key_file]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_die_with_parent)


def wait_for(path, timeout=30.0):
    """Wait until ``path`` exists (the key file attach() writes before it listens)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


class Cluster:
    """``nnodes`` torchrun 'nodes' of ``nproc`` ranks each, and the attached group."""

    def __init__(self, tmp_path, nnodes=2, nproc=1, max_restarts=0, **attach_kwargs):
        self.port, self.rdzv = free_port(), free_port()
        self.key_file = str(tmp_path / "key.hex")
        self.box = {}
        world_size = nnodes * nproc
        kwargs = dict(listen=f"127.0.0.1:{self.port}", key_file=self.key_file, join_timeout=120,
                      progress=False, timeout=30)
        kwargs.update(attach_kwargs)
        self.thread = threading.Thread(target=self._attach, args=(world_size, kwargs))
        self.thread.start()
        wait_for(self.key_file)
        self.nodes = [torchrun(n, self.rdzv, self.port, self.key_file, nproc=nproc, nnodes=nnodes,
                               max_restarts=max_restarts) for n in range(nnodes)]
        self.thread.join(180)
        if "error" in self.box:
            self.close()
            raise self.box["error"]
        self.group = self.box["group"]

    def _attach(self, world_size, kwargs):
        try:
            self.box["group"] = nbdist.attach(world_size, **kwargs)
        except BaseException as err:  # noqa: BLE001 -- re-raised in the test thread
            self.box["error"] = err

    def close(self, wait=30):
        """Stop the group, wait up to ``wait`` s for each agent (then kill it); the exit codes."""
        if "group" in self.box:
            self.group.stop()
        for p in self.nodes:
            try:
                p.wait(wait)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            p.stderr.close()
        return [p.returncode for p in self.nodes]


CONTROLLER = r"""
import sys, nbdist
port, key_file, world_size, code = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
g = nbdist.attach(world_size, listen=f"127.0.0.1:{port}", key_file=key_file, join_timeout=120,
                  progress=False, timeout=60)
print("attached", flush=True)
g.exec(code)
"""


def controller(tmp_path, world_size, code):
    """A notebook kernel stand-in: a process that attaches ``world_size`` ranks, says "attached"
    on stdout, then runs ``code`` on them (e.g. a collective that never completes). Returns
    ``(process, port, key_file)``; kill it with SIGKILL to play a kernel that died."""
    port = free_port()
    key_file = str(tmp_path / "key.hex")
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    p = subprocess.Popen([sys.executable, str(script), str(port), key_file, str(world_size), code],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_die_with_parent)
    wait_for(key_file)
    return p, port, key_file


def wait_attached(ctl) -> None:
    """Read the controller's stdout up to its "attached" line; nbdist's own notes (the threads per
    rank...) may come first, on stdout too. Fails with what it said if it ends before."""
    said = []
    for line in ctl.stdout:
        if line.strip() == "attached":
            return
        said.append(line)
    pytest.fail(f"the controller ended before it attached; stdout: {''.join(said)!r}, stderr: "
                f"{ctl.stderr.read()!r}")


def wait_all(procs, timeout):
    """Wait up to ``timeout`` s for every process to exit; the seconds it took (or None)."""
    start = time.monotonic()
    for p in procs:
        try:
            p.wait(max(0.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            return None
    return time.monotonic() - start


def kill_tree(p):
    """SIGKILL a process started with :func:`_die_with_parent` and everything in its session."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def _sh(*cmd):
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def veth_node(prefix, subnet):
    """A network namespace "node" reachable from this one over a veth pair, addresses
    ``{subnet}.x.1`` (here) and ``{subnet}.x.2`` (there) on a /30; yields
    ``(ns, host_ip, node_ip)``.
    Skips the test where namespaces or veth pairs cannot be made. ``prefix`` (2 letters) and
    ``subnet`` keep the fixtures of different test modules apart."""
    import secrets

    import pytest

    tag = secrets.token_hex(2)
    ns, host_if, node_if = f"{prefix}d{tag}", f"{prefix}h{tag}", f"{prefix}n{tag}"
    made = _sh("ip", "netns", "add", ns)
    if made.returncode != 0:
        pytest.skip(f"network namespaces are not available here: {made.stderr.strip()}")
    octet = int(tag, 16) % 250
    host_ip, node_ip = f"{subnet}.{octet}.1", f"{subnet}.{octet}.2"
    try:
        for cmd in (("ip", "link", "add", host_if, "type", "veth", "peer", "name", node_if),
                    ("ip", "link", "set", node_if, "netns", ns),
                    ("ip", "addr", "add", f"{host_ip}/30", "dev", host_if),
                    ("ip", "link", "set", host_if, "up"),
                    ("ip", "netns", "exec", ns, "ip", "addr", "add", f"{node_ip}/30", "dev",
                     node_if),
                    ("ip", "netns", "exec", ns, "ip", "link", "set", node_if, "up"),
                    ("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")):
            res = _sh(*cmd)
            if res.returncode != 0:
                pytest.skip(f"cannot build a veth pair here ({' '.join(cmd)}): "
                            f"{res.stderr.strip()}")
        yield ns, host_ip, node_ip
    finally:
        _sh("ip", "link", "del", host_if)
        _sh("ip", "netns", "del", ns)
