#!/usr/bin/env python
"""nbdist per-call dispatch latency against ipyparallel and a fork + Pipe + cloudpickle pool.

    python benchmarks/bench_dispatch.py [--quick] [--out results.json] [--sizes 2,4]
    (also section ``dispatch`` of bench_core.py)

Per-call latency of ``g.run(lambda: None)`` and ``g.exec("1")`` on a warm group (world sizes 2 and
4, gloo on CPU), against ipyparallel ``DirectView.apply_sync(lambda: 1)`` on a running cluster of
the same size, and against the lower bound: a pool of forked workers fed through
``multiprocessing.Pipe`` with cloudpickle (written below), and the bare round trip through the
same pipes (an empty message and reply, nothing pickled or run); the ratios to the bound use the
faster of the two. The methods are timed in blocks of calls,
interleaved round by round (the first method rotates) so that machine noise hits all of them alike.

Raw samples (seconds) and summaries go to the JSON file; a compact table is printed at the end.
Everything the script starts is stopped at the end (the ipyparallel controller and engines run with
a private IPYTHONDIR, so that the final sweep finds and kills whatever is left).
"""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import tempfile
import time

import harness
from harness import fmt, fmt_summary, noop, percentile, ratio, summary, timed_block

NAME = "dispatch"
FULL = dict(dispatch_rounds=10, dispatch_block=300, ipp_block=80)
QUICK = dict(dispatch_rounds=4, dispatch_block=100, ipp_block=20)


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
            if not data:  # a ping: the bare round trip, nothing to unpickle or run
                conn.send_bytes(b"")
                continue
            fn = loads(data)
            if fn is None:
                return
            conn.send_bytes(dumps(fn()))

    def run(self, fn):
        data = self.cloudpickle.dumps(fn)
        for c in self.conns:
            c.send_bytes(data)
        return [self.cloudpickle.loads(c.recv_bytes()) for c in self.conns]

    def ping(self):
        """An empty message to every worker and its empty reply: what the pipes alone cost."""
        for c in self.conns:
            c.send_bytes(b"")
        return [c.recv_bytes() for c in self.conns]

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
            assert self.view.apply_sync(_one) == [1] * n
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
        sweep()
        return time.perf_counter() - t0


@harness.as_main
def _one():
    return 1


def setup():
    """A private IPYTHONDIR for the ipyparallel cluster (removed at the end by the harness)."""
    IppCluster.ipython_dir = tempfile.mkdtemp(prefix="bench-ipython-")
    os.environ["IPYTHONDIR"] = IppCluster.ipython_dir
    return [IppCluster.ipython_dir]


def sweep():
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


# =============================================================================== the section
def run(cfg, sizes, res, log):
    import nbdist

    have_ipp = harness.have("ipyparallel", "ipyparallel apply_sync")
    sec = res["dispatch"] = {"sizes": sizes, "raw": {}, "summary": {}, "ipyparallel": {}}
    if not have_ipp:
        sec["skipped"] = ["ipyparallel (not installed)"]
    pools = {n: PipePool(n) for n in sizes}  # forked now: this process has no extra threads yet
    try:
        for n in sizes:
            raw = {"nbdist_run": [], "nbdist_exec": [], "pipe_pool": [], "pipe_ping": [],
                   "ipyparallel": []}
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
                        sweep()
                pool = pools[n]
                assert g.run(noop) == [None] * n and g.exec("1") == [1] * n
                assert pool.run(noop) == [None] * n and pool.ping() == [b""] * n
                methods = [("nbdist_run", lambda: g.run(noop), cfg["dispatch_block"]),
                           ("nbdist_exec", lambda: g.exec("1"), cfg["dispatch_block"]),
                           ("pipe_pool", lambda: pool.run(noop), cfg["dispatch_block"]),
                           ("pipe_ping", pool.ping, cfg["dispatch_block"])]
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
                    f"{k} {fmt(percentile(v, 50), ms=True)}" for k, v in raw.items() if v))
            finally:
                g.stop()
                if ipp is not None:
                    sec["ipyparallel"][str(n)]["stop_s"] = ipp.stop()
            sec["raw"][str(n)] = raw
            sec["summary"][str(n)] = {k: summary(v) for k, v in raw.items()}
    finally:
        for p in pools.values():
            p.close()


def ratios(res):
    out = {}
    for n, s in res.get("dispatch", {}).get("summary", {}).items():
        # The bound is the fastest way measured to reach every worker and hear back: the pool's
        # call, or the bare round trip through its pipes (ping), whichever was faster.
        bounds = {k: s[k] for k in ("pipe_pool", "pipe_ping") if s.get(k, {}).get("n")}
        fastest = min(bounds, key=lambda k: bounds[k]["median"])
        out[f"dispatch_n{n}"] = {
            "ipyparallel / nbdist_run": ratio(s.get("ipyparallel"), s["nbdist_run"]),
            "bound": fastest,
            "nbdist_run / bound": ratio(s["nbdist_run"], bounds[fastest]),
            "nbdist_exec / bound": ratio(s["nbdist_exec"], bounds[fastest]),
            "nbdist_run / pipe_pool": ratio(s["nbdist_run"], s["pipe_pool"]),
        }
    return out


def print_table(res):
    dp = res.get("dispatch", {}).get("summary", {})
    if not dp:
        return
    print("\n-- dispatch of a trivial call on a warm group, per call")
    for n, s in dp.items():
        print(f" N={n}")
        for k, label in (("nbdist_run", "nbdist g.run(lambda: None)"),
                         ("nbdist_exec", "nbdist g.exec('1')"),
                         ("pipe_pool", "fork + Pipe + cloudpickle pool"),
                         ("pipe_ping", "the same pipes, an empty message and reply"),
                         ("ipyparallel", "ipyparallel apply_sync(lambda: 1)")):
            if s.get(k, {}).get("n"):
                print(f"   {label:<44} {fmt_summary(s[k])}")


if __name__ == "__main__":
    sys.exit(harness.run_alone(sys.modules[__name__]))
