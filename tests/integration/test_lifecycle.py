"""No orphans, no leaks, and a closed door (issue 3)."""
import glob
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest

import nbdist
from nbdist.wire import transport
from nbdist.wire.segments import leftover_segments
from stream_paths import each_stream_path

pytestmark = pytest.mark.timeout(180)


def _running(pid):
    """True while ``pid`` is a live process (not gone, not a zombie); a process that exits while
    we look at it is gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _said(proc, tag: str) -> str:
    """What the script printed after ``tag`` on its first line that starts with it (lines the
    ranks print come on stdout too; nbdist's own notes go to stderr in a script)."""
    for line in proc.stdout:
        if line.startswith(tag + " "):
            return line[len(tag) + 1:].strip()
    pytest.fail(f"the script ended without printing {tag}")


def _wait_gone(pids, seconds):
    deadline = time.monotonic() + seconds
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.05)
    return alive


# Tests that take a start method run under forkserver and spawn (issue 20): parent-death detection
# and the sockets a rank opens differ between them (spawned ranks are the caller's own children).
# The rest are forkserver-only: they repeat many starts, so spawn would cost minutes for the same path.
both_methods = pytest.mark.parametrize("start_method", ["forkserver", "spawn"])


@both_methods
@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_workers_exit_when_the_caller_dies(how, start_method):
    script = textwrap.dedent(f"""
        import os, sys, time, nbdist
        g = nbdist.start(2, start_method={start_method!r})
        g.exec("import time") ; print("PIDS", *[r.pid for r in g.status().ranks], flush=True)
        {'time.sleep(600)' if how == 'sigkill' else 'os._exit(0)'}
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in _said(proc, "PIDS").split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        if how == "sigkill":
            proc.kill()
        proc.wait(30)
        assert _wait_gone(pids, 10) == [], "workers outlived their caller"
    finally:
        proc.kill()
        proc.wait()


@both_methods
def test_busy_workers_exit_when_the_caller_is_killed(start_method):
    script = textwrap.dedent(f"""
        import threading, nbdist
        g = nbdist.start(2, start_method={start_method!r})
        print("PIDS", *[r.pid for r in g.status().ranks], flush=True)
        g.exec("import time; time.sleep(600)")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in _said(proc, "PIDS").split()]
        time.sleep(0.5)
        proc.kill()
        proc.wait(30)
        assert _wait_gone(pids, 10) == []
    finally:
        proc.kill()
        proc.wait()


def _fds():
    return len(os.listdir("/proc/self/fd"))


def test_fifty_start_stop_cycles_leave_nothing_behind():
    with nbdist.start(2) as warm:  # warm the forkserver and torch's thread pool first
        warm.push(t=__import__("torch").ones(100_000))
        warm.exec("t")
    fds0, threads0 = _fds(), len(psutil.Process().threads())
    pids, ids = set(), []
    for i in range(50):
        g = nbdist.start(2)
        ids.append(g.id)
        pids.update(r.pid for r in g.status().ranks)
        if i % 10 == 0:
            g.push(t=__import__("torch").ones(100_000))
            g.exec("t * 2")  # a result through a pooled segment
        g.stop()
    assert _wait_gone(pids, 5) == []
    assert _fds() <= fds0, f"file descriptors leaked: {fds0} -> {_fds()}"
    assert len(psutil.Process().threads()) <= threads0
    for gid in ids:  # other test runs on this machine may have groups of their own
        assert glob.glob(os.path.join(tempfile.gettempdir(), f"nbdist-{gid}-*")) == []
        assert leftover_segments(gid) == []
    listening = [c for c in psutil.Process().net_connections() if c.status == "LISTEN"]
    assert listening == []


def _listening_ports(group):
    out = []
    for pid in [os.getpid()] + [r.pid for r in group.status().ranks]:
        for c in psutil.Process(pid).net_connections(kind="inet"):
            if c.status == "LISTEN":
                out.append((pid, c.laddr.ip, c.laddr.port))
    return out


@both_methods
def test_every_listening_socket_is_on_loopback(start_method):
    with nbdist.start(2, start_method=start_method) as g:
        ports = _listening_ports(g)
        assert ports, "expected gloo's listeners in the workers"
        assert all(ip in ("127.0.0.1", "::1") for _, ip, _ in ports), ports


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {EVIDENCE}",))


EVIDENCE = os.path.join(tempfile.gettempdir(), f"nbdist-pwned-{os.getpid()}")


def _attacks(port):
    payload = pickle.dumps(Evil())
    attempts = [b"", b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", payload,
                b"\x00" * 8 + payload, os.urandom(4096)]
    for data in attempts:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                if data:
                    s.sendall(data)
                s.settimeout(0.5)
                try:
                    s.recv(100)
                except OSError:
                    pass
        except OSError:
            pass


def test_garbage_and_malicious_pickles_on_every_port_run_nothing():
    with nbdist.start(2) as g:
        g.push(keep=1)
        for _, _, port in _listening_ports(g):
            _attacks(port)
        assert not os.path.exists(EVIDENCE)
        assert g.pull("keep") == [1, 1]
        assert g.exec("t = torch.ones(1); dist.all_reduce(t); t.item()") == [2.0, 2.0]


def test_the_control_listener_refuses_peers_without_the_key():
    key = transport.new_key()
    server = transport.listen()
    port = server.getsockname()[1]
    try:
        for data in (b"", b"junk" * 10, pickle.dumps(Evil())):
            client = socket.create_connection(("127.0.0.1", port))
            conn, _ = server.accept()
            if data:
                client.sendall(data)
            client.shutdown(socket.SHUT_WR)
            with pytest.raises(transport.AuthenticationError):
                transport.server_handshake(conn, key, timeout=2)
            conn.close()
            client.close()
        # A peer with the wrong key fails; the right key passes and its hello arrives.
        for k, ok in ((transport.new_key(), False), (key, True)):
            client = socket.create_connection(("127.0.0.1", port))
            conn, _ = server.accept()
            import threading

            errors = []
            t = threading.Thread(target=lambda: _client_side(client, k, errors))
            t.start()
            if ok:
                assert transport.server_handshake(conn, key, timeout=5) == {"rank": 0}
            else:
                with pytest.raises(transport.AuthenticationError, match="does not hold the group key"):
                    transport.server_handshake(conn, key, timeout=5)
                conn.close()
            t.join(10)
            conn.close()
            client.close()
        assert not os.path.exists(EVIDENCE)
    finally:
        server.close()


def _client_side(sock, key, errors):
    try:
        transport.client_handshake(sock, key, {"rank": 0}, timeout=5)
    except transport.AuthenticationError as err:
        errors.append(err)


def test_a_silent_peer_times_out_instead_of_hanging():
    server = transport.listen()
    try:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        with pytest.raises(transport.AuthenticationError, match="handshake failed"):
            transport.server_handshake(conn, transport.new_key(), timeout=0.5)
        conn.close()
        client.close()
    finally:
        server.close()


@each_stream_path
def test_a_rank_writing_a_lot_to_stderr_does_not_block(streams):
    counts = {0: 0, 1: 0}

    def sink(rank, stream, text):
        counts[rank] += len(text.splitlines())

    with nbdist.start(2, output=sink, **streams) as g:
        g.exec("import sys\nfor i in range(20000): print('x' * 50, i, file=sys.stderr)")
        assert counts == {0: 20000, 1: 20000}


def test_two_callers_on_one_machine_do_not_interfere():
    script = textwrap.dedent("""
        import nbdist
        with nbdist.start(2) as g:
            for i in range(30):
                out = g.exec("t = torch.ones(1000) * (rank + 1); dist.all_reduce(t); t[0].item()")
                assert out == [3.0, 3.0], out
        print("other ok", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        with nbdist.start(2) as g:
            for _ in range(30):
                assert g.exec("t = torch.ones(1000) * (rank + 5); dist.all_reduce(t); t[0].item()") \
                    == [11.0, 11.0]
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0 and "other ok" in out
    finally:
        proc.kill()
        proc.wait()


def test_leftovers_of_a_killed_caller_are_swept_by_the_next_start():
    script = textwrap.dedent("""
        import nbdist, time
        g = nbdist.start(2)
        t = g.exec("torch.ones(1_000_000)")  # pooled result segments stay with the workers
        print("GROUP", g.id, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        gid = _said(proc, "GROUP")
        assert leftover_segments(gid)
        proc.kill()  # no cleanup runs in the caller
        proc.wait(30)
        assert glob.glob(os.path.join(tempfile.gettempdir(), f"nbdist-{gid}-*"))
        with nbdist.start(2):
            pass
        assert glob.glob(os.path.join(tempfile.gettempdir(), f"nbdist-{gid}-*")) == []
        assert leftover_segments(gid) == []
    finally:
        proc.kill()
        proc.wait()
