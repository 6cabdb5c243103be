#!/usr/bin/env python
"""nbdist core benchmarks, side by side with the alternatives, in one run.

    python benchmarks/bench_core.py [--quick] [--out results.json] [--sections startup,dispatch,tensor]

What it measures (world sizes 2 and 4, gloo on CPU), each alternative interleaved round by round with
nbdist so that machine noise hits all of them alike:

1. startup -- time to a ready group (torch.distributed initialised, a trivial function returned on
   every rank):
   * nbdist, the first ``nbdist.start`` in a fresh Python process (a subprocess per sample, so the
     forkserver is cold), later ``nbdist.start`` calls in this process, and ``Group.restart()``;
   * ``torch.multiprocessing.start_processes(..., start_method="spawn")`` (what ``mp.spawn`` does),
     each rank ``init_process_group("gloo", init_method="file://...")``, from a subprocess that has
     torch imported;
   * ``accelerate.notebook_launcher`` (fork + torch elastic agent), same work, same kind of
     subprocess. Each launch is bounded by a timeout; launches that do not return are counted as
     hangs and their processes killed.
2. dispatch -- per-call latency of ``g.run(lambda: None)`` and ``g.exec("1")`` on a warm group,
   against ipyparallel ``DirectView.apply_sync(lambda: 1)`` on a running cluster of the same size, and
   against the lower bound: a pool of forked workers fed through ``multiprocessing.Pipe`` with
   cloudpickle (written below).
3. tensor -- a 100 MiB float32 CPU tensor that already lives on rank 0, returned to the caller:
   nbdist ``g.exec("big", ranks=[0])`` and ``g.pull("big", ranks=[0])``, against a
   ``torch.multiprocessing`` queue (tensor private to the producer, and already in shared memory)
   and against pickling through ``multiprocessing.Queue`` (a numpy array: bytes through the pipe);
   next to single-core memcpy of 256 MiB measured in the same rounds.

Raw samples (seconds) and summaries go to the JSON file; a compact table is printed at the end.
Everything the script starts is stopped at the end (a final sweep kills and reports leftovers).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

MIB = 1 << 20
BIG_BYTES = 100 * MIB
BIG_NUMEL = BIG_BYTES // 4  # float32
MEMCPY_BYTES = 256 * MIB
RESULT_TAG = "BENCH-RESULT "

FULL = dict(startup_rounds=10, acc_per_round=6, later_per_round=2, dispatch_rounds=10,
            dispatch_block=300, ipp_block=80, tensor_rounds=20)
QUICK = dict(startup_rounds=2, acc_per_round=4, later_per_round=1, dispatch_rounds=4,
             dispatch_block=100, ipp_block=20, tensor_rounds=5)
ACC_LAUNCH_TIMEOUT = 10.0   # a notebook_launcher launch normally returns in ~0.2 s
CHILD_IMPORT_TIMEOUT = 90.0  # allowance for a child's imports before its first result


# =============================================================================== statistics
def percentile(xs, q):
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    s = sorted(xs)
    if not s:
        return None
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "median": percentile(xs, 50), "p10": percentile(xs, 10),
            "p90": percentile(xs, 90), "min": min(xs), "max": max(xs),
            "mean": sum(xs) / len(xs)}


def emit(obj):
    """Child processes report one JSON object per line, tagged, on stdout."""
    sys.stdout.write(RESULT_TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


RUN_TMP = None  # a private temp dir for the child processes, removed at the end


def loopback_env():
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if RUN_TMP:
        env["TMPDIR"] = RUN_TMP  # what a killed (hung) child leaves behind goes away with it
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        names = []
    # nbdist binds gloo to the loopback interface itself; give the alternatives the same setting,
    # so that nobody pays for hostname resolution.
    if "lo" in names and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# =============================================================================== child modes
def _rank_payload():
    import torch.distributed as dist

    return dist.get_rank()


def child_nbdist_first(n):
    """A fresh interpreter: import torch, import nbdist, then time the first start."""
    t = time.perf_counter()
    import torch  # noqa: F401
    t_torch = time.perf_counter() - t
    t = time.perf_counter()
    import nbdist
    t_nbdist = time.perf_counter() - t
    emit({"hello": True})
    t0 = time.perf_counter()
    g = nbdist.start(world_size=n)
    t1 = time.perf_counter()
    res = g.run(_rank_payload)
    t2 = time.perf_counter()
    assert res == list(range(n)), res
    g.stop()
    t3 = time.perf_counter()
    emit({"start": t1 - t0, "ready": t2 - t0, "stop": t3 - t2, "import_torch": t_torch,
          "import_nbdist": t_nbdist})


def _spawn_rank(rank, n, init_method, queue):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=n)
    queue.put((rank, _rank_payload()))
    dist.destroy_process_group()


def child_spawn(n, reps):
    import torch.multiprocessing as tmp

    import queue as queue_mod

    ctx = tmp.get_context("spawn")
    queue = ctx.Queue()
    emit({"hello": True})
    for _ in range(reps):
        d = tempfile.mkdtemp(prefix="bench-spawn-")
        try:
            t0 = time.perf_counter()
            pctx = tmp.start_processes(_spawn_rank, args=(n, f"file://{d}/store", queue), nprocs=n,
                                       join=False, start_method="spawn")
            got = []
            while len(got) < n:
                try:
                    got.append(queue.get(timeout=0.02)[1])
                except queue_mod.Empty:
                    pctx.join(0)  # raises at once if a rank failed
            got.sort()
            t1 = time.perf_counter()
            while not pctx.join():
                pass
            t2 = time.perf_counter()
            assert got == list(range(n)), got
            emit({"ready": t1 - t0, "total": t2 - t0, "teardown": t2 - t1})
        finally:
            shutil.rmtree(d, ignore_errors=True)


def _acc_rank(fd):
    import torch.distributed as dist

    dist.init_process_group("gloo")  # env:// -- the elastic agent set everything
    r = _rank_payload()
    os.write(fd, f"{r} {time.perf_counter()!r}\n".encode())
    dist.destroy_process_group()


def child_accelerate(n, reps):
    import torch  # noqa: F401
    from accelerate import notebook_launcher

    emit({"hello": True})
    for _ in range(reps):
        rfd, wfd = os.pipe()
        try:
            port = free_port()
            with contextlib.redirect_stdout(sys.stderr):  # "Launching training on N CPUs."
                t0 = time.perf_counter()
                notebook_launcher(_acc_rank, args=(wfd,), num_processes=n, use_port=str(port))
                t2 = time.perf_counter()
            os.close(wfd)
            wfd = None
            os.set_blocking(rfd, False)  # every rank wrote before it exited: no need to wait
            try:
                lines = os.read(rfd, 65536).decode().split()
            except BlockingIOError:
                lines = []
            ranks = sorted(int(x) for x in lines[0::2])
            stamps = [float(x) for x in lines[1::2]]
            assert ranks == list(range(n)), ranks
            t1 = max(stamps)
            emit({"ready": t1 - t0, "total": t2 - t0, "teardown": t2 - t1})
        finally:
            for fd in (rfd, wfd):
                if fd is not None:
                    os.close(fd)


# =============================================================================== process hygiene
def _descendants(pid):
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def kill_tree(proc):
    """SIGKILL a child started with start_new_session=True, its process group and descendants."""
    import psutil

    kids = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for k in kids:
        with contextlib.suppress(psutil.Error):
            k.kill()
    with contextlib.suppress(Exception):
        proc.kill()
    with contextlib.suppress(Exception):
        proc.wait(10)


class ChildRun:
    """Run ``bench_core.py --child MODE`` and read its tagged result lines with deadlines."""

    def __init__(self, mode, n, reps):
        self.errfile = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", mode, "--n", str(n),
             "--reps", str(reps)], stdout=subprocess.PIPE, stderr=self.errfile,
            env=loopback_env(), start_new_session=True)
        self.buf = b""
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)

    def next_result(self, timeout):
        """The next result dict; None on EOF; raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(RESULT_TAG):
                    return json.loads(text[len(RESULT_TAG):])
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if not self.sel.select(remaining):
                continue
            data = os.read(self.proc.stdout.fileno(), 65536)
            if not data:
                return None
            self.buf += data

    def stderr_tail(self, n=1500):
        self.errfile.seek(0)
        return self.errfile.read().decode(errors="replace")[-n:]

    def close(self):
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
        kill_tree(self.proc)  # also reaps anything left in its process group
        self.sel.close()
        self.proc.stdout.close()
        self.errfile.close()


def run_child(mode, n, reps, item_timeout):
    """Collect ``reps`` results from child processes; a result missing after ``item_timeout`` is a
    hang: the child and everything it started are killed and a fresh child does the rest."""
    results, hangs, errors = [], 0, []
    hang_tails = []
    attempts = 0
    while len(results) + hangs < reps and attempts < reps + 3:
        attempts += 1
        child = ChildRun(mode, n, reps - len(results) - hangs)
        try:
            try:
                hello = child.next_result(CHILD_IMPORT_TIMEOUT)
            except TimeoutError:
                hello = None
            if not hello:
                kill_tree(child.proc)
                errors.append(f"no start-up report within {CHILD_IMPORT_TIMEOUT:g} s: "
                              f"{child.stderr_tail()}")
                continue
            while len(results) + hangs < reps:
                try:
                    res = child.next_result(item_timeout)
                except TimeoutError:
                    hangs += 1
                    kill_tree(child.proc)
                    hang_tails.append(child.stderr_tail(600))
                    break
                if res is None:
                    child.proc.wait(15)
                    errors.append(f"exit {child.proc.returncode}: {child.stderr_tail()}")
                    break
                results.append(res)
        finally:
            child.close()
        if errors and len(errors) >= 3:
            break
    errors += [f"hang (killed after {item_timeout:g} s), stderr tail: {t}" for t in hang_tails]
    return results, hangs, errors


# =============================================================================== pipe pool
class PipePool:
    """The lower bound for dispatch: N forked workers, multiprocessing.Pipe, cloudpickle."""

    def __init__(self, n):
        import cloudpickle
        from multiprocessing import Pipe

        self.cloudpickle = cloudpickle
        self.conns, self.pids = [], []
        for _ in range(n):
            parent, child = Pipe()
            pid = os.fork()
            if pid == 0:  # worker
                try:
                    for c in self.conns:
                        c.close()
                    parent.close()
                    self._serve(child)
                finally:
                    os._exit(0)
            child.close()
            self.conns.append(parent)
            self.pids.append(pid)

    def _serve(self, conn):
        loads, dumps = self.cloudpickle.loads, self.cloudpickle.dumps
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                return
            fn = loads(data)
            if fn is None:
                return
            conn.send_bytes(dumps(fn()))

    def run(self, fn):
        data = self.cloudpickle.dumps(fn)
        for c in self.conns:
            c.send_bytes(data)
        return [self.cloudpickle.loads(c.recv_bytes()) for c in self.conns]

    def close(self):
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.send_bytes(self.cloudpickle.dumps(None))
            c.close()
        for pid in self.pids:
            for _ in range(50):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
                time.sleep(0.02)
            else:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
        self.conns, self.pids = [], []


# =============================================================================== deadlines
class Deadline(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds, what):
    """Raise Deadline in the main thread after ``seconds`` (bounds calls into ipyparallel)."""
    def on_alarm(signum, frame):
        raise Deadline(f"{what}: no answer within {seconds:g} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def timed_block(fn, count, out):
    pc = time.perf_counter
    for _ in range(count):
        t0 = pc()
        fn()
        out.append(pc() - t0)


# =============================================================================== ipyparallel
class IppCluster:
    """An ipyparallel cluster in a private IPYTHONDIR, so that cleanup can find all of it."""

    ipython_dir = None

    def __init__(self, n):
        import logging

        import ipyparallel as ipp

        self.n = n
        self.cluster = ipp.Cluster(n=n, log_level=logging.ERROR)
        self.rc = None
        t0 = time.perf_counter()
        with deadline(180, f"ipyparallel cluster of {n}"):
            self.rc = self.cluster.start_and_connect_sync()
            self.view = self.rc[:]
            self.view.block = True
            assert self.view.apply_sync(lambda: 1) == [1] * n
        self.start_time = time.perf_counter() - t0

    def apply(self):
        return self.view.apply_sync(_one)

    def stop(self):
        t0 = time.perf_counter()
        try:
            with deadline(60, "stopping the ipyparallel cluster"):
                if self.rc is not None:
                    self.rc.close()
                self.cluster.stop_cluster_sync()
        except Exception as err:  # noqa: BLE001 -- the sweep below kills what is left
            print(f"  ipyparallel stop: {type(err).__name__}: {err}", file=sys.stderr)
        sweep_ipyparallel()
        return time.perf_counter() - t0


def _one():
    return 1


def sweep_ipyparallel():
    """Kill any process that runs with our private IPYTHONDIR (controller, engines)."""
    import psutil

    if not IppCluster.ipython_dir:
        return []
    killed = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid == os.getpid():
            continue
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if "ipyparallel" in cmd and p.environ().get("IPYTHONDIR") == IppCluster.ipython_dir:
                p.kill()
                killed.append(" ".join(p.info["cmdline"] or [])[:120])
        except psutil.Error:
            pass
    return killed


# =============================================================================== sections
def versions():
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "nbdist", "cloudpickle", "numpy", "accelerate", "ipyparallel", "pyzmq"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    import torch

    out["torch_runtime"] = torch.__version__
    return out


def nbdist_source_info():
    """Where nbdist comes from and a hash of its sources (to see whether they changed mid-run)."""
    import hashlib
    import importlib.util

    spec = importlib.util.find_spec("nbdist")
    root = os.path.dirname(spec.origin)
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    h.update(name.encode() + b"\0" + f.read())
    info = {"path": root, "sources_sha256": h.hexdigest()[:16]}
    try:
        top = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10)
        if top.returncode == 0:
            head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                                  capture_output=True, text=True, timeout=10).stdout.strip()
            dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "."],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            info.update({"git_head": head, "git_dirty": bool(dirty)})
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def noop():
    return None


def bench_startup(cfg, sizes, res, log):
    import nbdist

    have_acc = _have("accelerate")
    sec = res["startup"] = {"sizes": sizes, "accelerate_launch_timeout_s": ACC_LAUNCH_TIMEOUT}
    raw = {n: {"nbdist_first": [], "nbdist_later": [], "nbdist_later_stop": [],
               "nbdist_restart": [], "nbdist_restart_ready": [], "spawn": [], "accelerate": [],
               "nbdist_first_hangs": 0, "spawn_hangs": 0, "accelerate_hangs": 0,
               "errors": []} for n in sizes}
    # the first start in *this* process (forkserver cold here too, torch already imported)
    t0 = time.perf_counter()
    g = nbdist.start(world_size=sizes[0])
    g.run(noop)
    sec["nbdist_first_in_bench_process_s"] = time.perf_counter() - t0
    g.stop()
    for rnd in range(cfg["startup_rounds"]):
        for n in sizes:
            r = raw[n]
            got, hangs, errs = run_child("nbdist-first", n, 1, 60.0)
            r["nbdist_first"] += got
            r["nbdist_first_hangs"] += hangs
            r["errors"] += [f"nbdist-first: {e}" for e in errs]
            got, hangs, errs = run_child("spawn", n, 1, 60.0)
            r["spawn"] += got
            r["spawn_hangs"] += hangs
            r["errors"] += [f"spawn: {e}" for e in errs]
            if have_acc:
                got, hangs, errs = run_child("accelerate", n, cfg["acc_per_round"],
                                             ACC_LAUNCH_TIMEOUT)
                r["accelerate"] += got
                r["accelerate_hangs"] += hangs
                r["errors"] += [f"accelerate: {e}" for e in errs]
            for _ in range(cfg["later_per_round"]):
                gc.collect()
                t0 = time.perf_counter()
                g = nbdist.start(world_size=n)
                g.run(noop)
                r["nbdist_later"].append(time.perf_counter() - t0)
                for _ in range(cfg["later_per_round"]):
                    t0 = time.perf_counter()
                    g.restart()
                    t1 = time.perf_counter()
                    g.run(noop)
                    t2 = time.perf_counter()
                    r["nbdist_restart"].append(t1 - t0)
                    r["nbdist_restart_ready"].append(t2 - t0)
                t0 = time.perf_counter()
                g.stop()
                r["nbdist_later_stop"].append(time.perf_counter() - t0)
            log(f"  startup round {rnd + 1}/{cfg['startup_rounds']} N={n}: "
                f"nbdist first {_last(r['nbdist_first'], 'ready')}, spawn {_last(r['spawn'], 'ready')}, "
                f"accelerate {_last(r['accelerate'], 'ready')} (hangs so far {r['accelerate_hangs']}), "
                f"later start {_fmt(r['nbdist_later'][-1])}, restart {_fmt(r['nbdist_restart_ready'][-1])}")
    sec["raw"] = {str(n): raw[n] for n in sizes}
    sec["summary"] = {}
    for n in sizes:
        r = raw[n]
        sec["summary"][str(n)] = {
            "nbdist_first_ready": summary([x["ready"] for x in r["nbdist_first"]]),
            "nbdist_first_stop": summary([x["stop"] for x in r["nbdist_first"]]),
            "child_import_torch": summary([x["import_torch"] for x in r["nbdist_first"]]),
            "child_import_nbdist": summary([x["import_nbdist"] for x in r["nbdist_first"]]),
            "nbdist_later_ready": summary(r["nbdist_later"]),
            "nbdist_stop": summary(r["nbdist_later_stop"]),
            "nbdist_restart": summary(r["nbdist_restart"]),
            "nbdist_restart_ready": summary(r["nbdist_restart_ready"]),
            "spawn_ready": summary([x["ready"] for x in r["spawn"]]),
            "spawn_total": summary([x["total"] for x in r["spawn"]]),
            "accelerate_ready": summary([x["ready"] for x in r["accelerate"]]),
            "accelerate_total": summary([x["total"] for x in r["accelerate"]]),
            "accelerate_launches": len(r["accelerate"]) + r["accelerate_hangs"],
            "accelerate_hangs": r["accelerate_hangs"],
            "nbdist_first_hangs": r["nbdist_first_hangs"],
            "spawn_hangs": r["spawn_hangs"],
            "errors": len(r["errors"]),
        }


def bench_dispatch(cfg, sizes, res, log):
    import nbdist

    have_ipp = _have("ipyparallel")
    sec = res["dispatch"] = {"sizes": sizes, "raw": {}, "summary": {}, "ipyparallel": {}}
    pools = {n: PipePool(n) for n in sizes}  # forked now: this process has no extra threads yet
    try:
        for n in sizes:
            raw = {"nbdist_run": [], "nbdist_exec": [], "pipe_pool": [], "ipyparallel": []}
            g = nbdist.start(world_size=n)
            ipp = None
            try:
                if have_ipp:
                    try:
                        ipp = IppCluster(n)
                        sec["ipyparallel"][str(n)] = {"start_and_connect_s": ipp.start_time}
                    except Exception as err:  # noqa: BLE001
                        sec["ipyparallel"][str(n)] = {"error": f"{type(err).__name__}: {err}"}
                        log(f"  ipyparallel N={n} failed to start: {err}")
                        if ipp is not None:
                            ipp.stop()
                        ipp = None
                        sweep_ipyparallel()
                pool = pools[n]
                assert g.run(noop) == [None] * n and g.exec("1") == [1] * n
                assert pool.run(noop) == [None] * n
                methods = [("nbdist_run", lambda: g.run(noop), cfg["dispatch_block"]),
                           ("nbdist_exec", lambda: g.exec("1"), cfg["dispatch_block"]),
                           ("pipe_pool", lambda: pool.run(noop), cfg["dispatch_block"])]
                if ipp is not None:
                    methods.append(("ipyparallel", ipp.apply, cfg["ipp_block"]))
                for name, fn, _ in methods:  # warm-up
                    for _ in range(20):
                        fn()
                for rnd in range(cfg["dispatch_rounds"]):
                    k = rnd % len(methods)
                    for name, fn, count in methods[k:] + methods[:k]:
                        gc.collect()
                        if name == "ipyparallel":
                            try:
                                with deadline(120, "ipyparallel apply_sync block"):
                                    timed_block(fn, count, raw[name])
                            except Deadline as err:
                                sec["ipyparallel"][str(n)]["error"] = str(err)
                                methods = [m for m in methods if m[0] != "ipyparallel"]
                        else:
                            timed_block(fn, count, raw[name])
                log(f"  dispatch N={n}: " + ", ".join(
                    f"{k} {_fmt(percentile(v, 50), ms=True)}" for k, v in raw.items() if v))
            finally:
                g.stop()
                if ipp is not None:
                    sec["ipyparallel"][str(n)]["stop_s"] = ipp.stop()
            sec["raw"][str(n)] = raw
            sec["summary"][str(n)] = {k: summary(v) for k, v in raw.items()}
    finally:
        for p in pools.values():
            p.close()


def _tensor_source(conn, tq, pq, numel):
    """Producer process for the queue comparisons (spawned, torch imported)."""
    import torch

    torch.set_num_threads(1)
    shared = torch.ones(numel)
    shared.share_memory_()
    obj = None
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            return
        if cmd == "prep-private":
            obj = ("t", torch.ones(numel))  # a fresh private tensor, every page touched
        elif cmd == "prep-shared":
            obj = ("t", shared)
        elif cmd == "prep-pickle":
            obj = ("p", torch.ones(numel).numpy())
        if cmd.startswith("prep-"):
            conn.send("ready")
            continue
        kind, value = obj
        (tq if kind == "t" else pq).put(value)
        obj = None


def touch_pages(x):
    """Read one element per 4 KiB page (what any use of the result costs at least)."""
    import torch

    if not isinstance(x, torch.Tensor):
        x = torch.from_numpy(x)
    v = x.view(-1)
    assert v.numel() == BIG_NUMEL
    return float(v[::1024].sum())


def bench_tensor(cfg, sizes, res, log):
    import multiprocessing

    import numpy as np
    import torch
    import torch.multiprocessing as tmp

    import nbdist

    sec = res["tensor"] = {"bytes": BIG_BYTES, "memcpy_bytes": MEMCPY_BYTES, "sizes": sizes}
    raw = {f"nbdist_exec_n{n}": [] for n in sizes}
    raw.update({f"nbdist_pull_n{n}": [] for n in sizes})
    for k in ("torch_queue_private", "torch_queue_shared", "mp_queue_pickle"):
        raw[k] = []
    touched = {k: [] for k in raw}
    mem = {"torch_copy": [], "torch_copy_fresh_dst": [], "numpy_copyto": []}

    groups = {}
    ctx = tmp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    tq = ctx.Queue()
    pq = multiprocessing.get_context("spawn").Queue()
    src_proc = ctx.Process(target=_tensor_source, args=(child_conn, tq, pq, BIG_NUMEL), daemon=True)
    src_proc.start()
    threads = torch.get_num_threads()
    try:
        for n in sizes:
            g = groups[n] = nbdist.start(world_size=n)
            g.exec(f"big = torch.ones({BIG_NUMEL})", ranks=[0])

        def via_queue(kind):
            def fn():
                parent_conn.send(f"prep-{kind}")
                assert parent_conn.recv() == "ready"
                t0 = time.perf_counter()
                parent_conn.send("go")
                x = (pq if kind == "pickle" else tq).get(timeout=120)
                return t0, x
            return fn

        def via_nbdist(g, how):
            def fn():
                t0 = time.perf_counter()
                x = (g.exec("big", ranks=[0]) if how == "exec" else g.pull("big", ranks=[0]))[0]
                return t0, x
            return fn

        methods = []
        for n in sizes:
            methods.append((f"nbdist_exec_n{n}", via_nbdist(groups[n], "exec")))
            methods.append((f"nbdist_pull_n{n}", via_nbdist(groups[n], "pull")))
        methods += [("torch_queue_private", via_queue("private")),
                    ("torch_queue_shared", via_queue("shared")),
                    ("mp_queue_pickle", via_queue("pickle"))]

        src = torch.ones(MEMCPY_BYTES // 4)
        dst = torch.empty_like(src)
        nsrc, ndst = src.numpy(), dst.numpy()

        def memcpy_round():
            torch.set_num_threads(1)
            try:
                t0 = time.perf_counter()
                dst.copy_(src)
                mem["torch_copy"].append(time.perf_counter() - t0)
                fresh = torch.empty_like(src)
                t0 = time.perf_counter()
                fresh.copy_(src)
                mem["torch_copy_fresh_dst"].append(time.perf_counter() - t0)
                del fresh
                t0 = time.perf_counter()
                np.copyto(ndst, nsrc)
                mem["numpy_copyto"].append(time.perf_counter() - t0)
            finally:
                torch.set_num_threads(threads)

        # warm-up (first touches, queue feeder threads, resource sharer)
        for name, fn in methods:
            _, x = fn()
            touch_pages(x)
            del x
        memcpy_round()
        for k in mem:
            mem[k].clear()
        for rnd in range(cfg["tensor_rounds"]):
            k = rnd % len(methods)
            for name, fn in methods[k:] + methods[:k]:
                gc.collect()
                t0, x = fn()
                t1 = time.perf_counter()
                touch_pages(x)
                t2 = time.perf_counter()
                raw[name].append(t1 - t0)
                touched[name].append(t2 - t0)
                del x
            gc.collect()
            memcpy_round()
        log("  tensor: " + ", ".join(f"{k} {_fmt(percentile(v, 50), ms=True)}"
                                     for k, v in raw.items()))
    finally:
        for g in groups.values():
            g.stop()
        with contextlib.suppress(Exception):
            parent_conn.send("stop")
        src_proc.join(10)
        if src_proc.is_alive():
            src_proc.kill()
            src_proc.join(5)
    sec["raw_returned"] = raw
    sec["raw_touched"] = touched
    sec["raw_memcpy_256MiB"] = mem
    sec["summary"] = {k: {"returned": summary(raw[k]), "touched": summary(touched[k])} for k in raw}
    sec["memcpy_256MiB"] = {k: summary(v) for k, v in mem.items()}
    sec["memcpy_GBps"] = {k: MEMCPY_BYTES / percentile(v, 50) / 1e9 for k, v in mem.items() if v}


# =============================================================================== report
def _have(mod):
    import importlib.util

    return importlib.util.find_spec(mod) is not None


def _fmt(x, ms=False):
    if x is None:
        return "-"
    if ms or x < 1.0:
        return f"{x * 1e3:.3g} ms" if x * 1e3 < 100 else f"{x * 1e3:.0f} ms"
    return f"{x:.2f} s"


def _last(rows, key):
    return _fmt(rows[-1][key]) if rows else "-"


def _ms(s):
    if not s or not s.get("n"):
        return "-"
    return (f"{s['median'] * 1e3:.3g} [{s['p10'] * 1e3:.3g}-{s['p90'] * 1e3:.3g}] ms (n={s['n']})")


def _ratio(a, b):
    try:
        return a["median"] / b["median"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def build_ratios(res):
    out = {}
    st = res.get("startup", {}).get("summary", {})
    for n, s in st.items():
        out[f"startup_n{n}"] = {
            "spawn_ready / nbdist_first_ready": _ratio(s["spawn_ready"], s["nbdist_first_ready"]),
            "accelerate_ready / nbdist_first_ready": _ratio(s["accelerate_ready"],
                                                           s["nbdist_first_ready"]),
            "spawn_ready / nbdist_later_ready": _ratio(s["spawn_ready"], s["nbdist_later_ready"]),
            "accelerate_total / nbdist_restart_ready": _ratio(s["accelerate_total"],
                                                             s["nbdist_restart_ready"]),
        }
    dp = res.get("dispatch", {}).get("summary", {})
    for n, s in dp.items():
        out[f"dispatch_n{n}"] = {
            "ipyparallel / nbdist_run": _ratio(s.get("ipyparallel"), s["nbdist_run"]),
            "nbdist_run / pipe_pool": _ratio(s["nbdist_run"], s["pipe_pool"]),
            "nbdist_exec / pipe_pool": _ratio(s["nbdist_exec"], s["pipe_pool"]),
        }
    tn = res.get("tensor", {})
    if tn.get("summary"):
        s = tn["summary"]
        memcpy_100 = tn["memcpy_256MiB"]["torch_copy"]["median"] * BIG_BYTES / MEMCPY_BYTES
        r = {"memcpy_100MiB_equiv_s": memcpy_100}
        for k, v in s.items():
            r[f"{k} / memcpy(100 MiB)"] = v["returned"]["median"] / memcpy_100
        for n in tn["sizes"]:
            nb = s[f"nbdist_exec_n{n}"]["touched"]
            r[f"torch_queue_private / nbdist_exec_n{n} (touched)"] = _ratio(
                s["torch_queue_private"]["touched"], nb)
            r[f"mp_queue_pickle / nbdist_exec_n{n} (touched)"] = _ratio(
                s["mp_queue_pickle"]["touched"], nb)
        out["tensor"] = r
    return out


def print_table(res):
    print("\n=== nbdist core benchmarks: median [p10-p90] (n samples) ===")
    st = res.get("startup", {}).get("summary", {})
    if st:
        print("\n-- time to a ready group (torch.distributed up, trivial fn returned on all ranks)")
        for n, s in st.items():
            print(f" N={n}")
            rows = [("nbdist, first start in a fresh process", s["nbdist_first_ready"]),
                    ("nbdist, later start in the same process", s["nbdist_later_ready"]),
                    ("nbdist, restart() + run", s["nbdist_restart_ready"]),
                    ("nbdist, stop()", s["nbdist_stop"]),
                    ("torch.multiprocessing spawn: ready", s["spawn_ready"]),
                    ("torch.multiprocessing spawn: incl. join", s["spawn_total"]),
                    ("accelerate notebook_launcher: ready", s["accelerate_ready"]),
                    ("accelerate notebook_launcher: returned", s["accelerate_total"])]
            for label, v in rows:
                print(f"   {label:<44} {_ms(v)}")
            if s["accelerate_launches"]:
                print(f"   {'accelerate hangs (no return in ' + str(ACC_LAUNCH_TIMEOUT) + ' s)':<44} "
                      f"{s['accelerate_hangs']} of {s['accelerate_launches']} launches")
            if s["nbdist_first_hangs"] or s["spawn_hangs"] or s["errors"]:
                print(f"   !! hangs: nbdist first {s['nbdist_first_hangs']}, spawn "
                      f"{s['spawn_hangs']}; {s['errors']} error(s) -- see startup.raw in the JSON")
    dp = res.get("dispatch", {}).get("summary", {})
    if dp:
        print("\n-- dispatch of a trivial call on a warm group, per call")
        for n, s in dp.items():
            print(f" N={n}")
            for k, label in (("nbdist_run", "nbdist g.run(lambda: None)"),
                             ("nbdist_exec", "nbdist g.exec('1')"),
                             ("pipe_pool", "fork + Pipe + cloudpickle pool"),
                             ("ipyparallel", "ipyparallel apply_sync(lambda: 1)")):
                if s.get(k, {}).get("n"):
                    print(f"   {label:<44} {_ms(s[k])}")
    tn = res.get("tensor", {})
    if tn.get("summary"):
        print("\n-- a 100 MiB float32 tensor from rank 0 / a child to the caller (returned; "
              "+ every page read)")
        for k, v in tn["summary"].items():
            print(f"   {k:<44} {_ms(v['returned'])}; touched {_ms(v['touched'])}")
        for k, v in tn["memcpy_256MiB"].items():
            print(f"   memcpy 256 MiB, 1 thread: {k:<18} {_ms(v)} = "
                  f"{MEMCPY_BYTES / v['median'] / 1e9:.1f} GB/s")
    print("\n-- ratios (medians)")
    for sec, r in res.get("ratios", {}).items():
        items = ", ".join(f"{k} = {v:.3g}" for k, v in r.items() if v is not None)
        print(f" {sec}: {items}")
    if res.get("leftover_processes"):
        print(f"\n!! leftover processes killed at the end: {res['leftover_processes']}")


# =============================================================================== main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (~2 minutes)")
    ap.add_argument("--out", default="bench_core_results.json", help="JSON file for all raw numbers")
    ap.add_argument("--sections", default="startup,dispatch,tensor",
                    help="comma-separated subset of startup,dispatch,tensor")
    ap.add_argument("--sizes", default="2,4", help="world sizes (default 2,4)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        {"nbdist-first": lambda: child_nbdist_first(args.n),
         "spawn": lambda: child_spawn(args.n, args.reps),
         "accelerate": lambda: child_accelerate(args.n, args.reps)}[args.child]()
        sys.stdout.flush()
        os._exit(0)

    global RUN_TMP
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    RUN_TMP = tempfile.mkdtemp(prefix="bench-core-")
    cfg = dict(QUICK if args.quick else FULL)
    sizes = [int(x) for x in args.sizes.split(",")]
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    os.environ.update({k: v for k, v in loopback_env().items() if k == "GLOO_SOCKET_IFNAME"})
    IppCluster.ipython_dir = tempfile.mkdtemp(prefix="bench-ipython-")
    os.environ["IPYTHONDIR"] = IppCluster.ipython_dir

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    import torch  # noqa: F401 -- the parent of every comparison has torch imported

    res = {"meta": {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                    "host": platform.node(), "platform": platform.platform(),
                    "cpus": os.cpu_count(), "versions": versions(), "quick": args.quick,
                    "config": cfg, "sections": sections, "units": "seconds",
                    "nbdist_source": nbdist_source_info(),
                    "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}}
    log(f"bench_core: {'quick' if args.quick else 'full'} run, sizes {sizes}, sections {sections}; "
        f"nbdist from {res['meta']['nbdist_source']}")
    try:
        if "startup" in sections:
            log("startup ...")
            bench_startup(cfg, sizes, res, log)
        if "dispatch" in sections:
            log("dispatch ...")
            bench_dispatch(cfg, sizes, res, log)
        if "tensor" in sections:
            log("tensor ...")
            bench_tensor(cfg, sizes, res, log)
    except BaseException:
        res["error"] = traceback.format_exc()
        log(res["error"])
    finally:
        import nbdist
        import psutil

        nbdist.stop_all()
        leftovers = sweep_ipyparallel()
        for p in _descendants(os.getpid()):
            try:
                name = " ".join(p.cmdline())[:160]
            except psutil.Error:
                continue
            # multiprocessing's own helpers exit with us; everything else is a leak
            if "forkserver" in name or "resource_tracker" in name:
                continue
            leftovers.append(name)
            with contextlib.suppress(psutil.Error):
                p.kill()
        res["leftover_processes"] = leftovers
        shutil.rmtree(IppCluster.ipython_dir, ignore_errors=True)
        shutil.rmtree(RUN_TMP, ignore_errors=True)
        res["ratios"] = build_ratios(res)
        end_hash = nbdist_source_info()["sources_sha256"]
        if end_hash != res["meta"]["nbdist_source"]["sources_sha256"]:
            res["meta"]["nbdist_sources_changed_during_run"] = True
            log("!! nbdist's sources changed during the run: the figures mix versions. Run against "
                "a snapshot (see docs/benchmarks.md) or on a quiet checkout.")
        res["meta"]["wall_s"] = time.perf_counter() - t_start
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print_table(res)
        print(f"\nwall time {res['meta']['wall_s']:.0f} s; raw numbers in {args.out}")
    return 1 if "error" in res else 0


if __name__ == "__main__":
    sys.exit(main())
