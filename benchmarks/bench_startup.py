#!/usr/bin/env python
"""nbdist start-up against torch.multiprocessing spawn and accelerate.notebook_launcher.

    python benchmarks/bench_startup.py [--quick] [--out results.json] [--sizes 2,4]
    (also section ``startup`` of bench_core.py)

Time to a ready group (torch.distributed initialised, a trivial function returned on every rank),
world sizes 2 and 4, gloo on CPU, each alternative interleaved round by round with nbdist so that
machine noise hits all of them alike:

* nbdist, the first ``nbdist.start`` in a fresh Python process (a subprocess per sample, so the
  forkserver is cold), later ``nbdist.start`` calls in this process, and ``Group.restart()``;
* ``torch.multiprocessing.start_processes(..., start_method="spawn")`` (what ``mp.spawn`` does),
  each rank ``init_process_group("gloo", init_method="file://...")``, from a subprocess that has
  torch imported;
* ``accelerate.notebook_launcher`` (fork + torch elastic agent), same work, same kind of
  subprocess. Each launch is bounded by a timeout; launches that do not return are counted as
  hangs and their processes killed.

Raw samples (seconds) and summaries go to the JSON file; a compact table is printed at the end.
Everything the script starts is stopped at the end (a final sweep kills and reports leftovers).
"""
from __future__ import annotations

import contextlib
import gc
import os
import shutil
import socket
import sys
import tempfile
import time

import harness
from harness import emit, fmt, fmt_summary, noop, ratio, summary

NAME = "startup"
FULL = dict(startup_rounds=10, acc_per_round=6, later_per_round=2)
QUICK = dict(startup_rounds=2, acc_per_round=4, later_per_round=1)
ACC_LAUNCH_TIMEOUT = 10.0   # a notebook_launcher launch normally returns in ~0.2 s
SCRIPT = os.path.abspath(__file__)  # the children run this file with --child MODE


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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


CHILDREN = {"nbdist-first": lambda args: child_nbdist_first(args.n),
            "spawn": lambda args: child_spawn(args.n, args.reps),
            "accelerate": lambda args: child_accelerate(args.n, args.reps)}


# =============================================================================== the section
def _last(rows, key):
    return fmt(rows[-1][key]) if rows else "-"


def run(cfg, sizes, res, log):
    import nbdist

    have_acc = harness.have("accelerate", "accelerate.notebook_launcher")
    sec = res["startup"] = {"sizes": sizes, "accelerate_launch_timeout_s": ACC_LAUNCH_TIMEOUT}
    if not have_acc:
        sec["skipped"] = ["accelerate (not installed)"]
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
            got, hangs, errs = harness.run_child(SCRIPT, "nbdist-first", n, 1, 60.0)
            r["nbdist_first"] += got
            r["nbdist_first_hangs"] += hangs
            r["errors"] += [f"nbdist-first: {e}" for e in errs]
            got, hangs, errs = harness.run_child(SCRIPT, "spawn", n, 1, 60.0)
            r["spawn"] += got
            r["spawn_hangs"] += hangs
            r["errors"] += [f"spawn: {e}" for e in errs]
            if have_acc:
                got, hangs, errs = harness.run_child(SCRIPT, "accelerate", n, cfg["acc_per_round"],
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
                f"later start {fmt(r['nbdist_later'][-1])}, restart {fmt(r['nbdist_restart_ready'][-1])}")
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


def ratios(res):
    out = {}
    for n, s in res.get("startup", {}).get("summary", {}).items():
        out[f"startup_n{n}"] = {
            "spawn_ready / nbdist_first_ready": ratio(s["spawn_ready"], s["nbdist_first_ready"]),
            "accelerate_ready / nbdist_first_ready": ratio(s["accelerate_ready"],
                                                          s["nbdist_first_ready"]),
            "spawn_ready / nbdist_later_ready": ratio(s["spawn_ready"], s["nbdist_later_ready"]),
            "accelerate_total / nbdist_restart_ready": ratio(s["accelerate_total"],
                                                            s["nbdist_restart_ready"]),
        }
    return out


def print_table(res):
    st = res.get("startup", {}).get("summary", {})
    if not st:
        return
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
            print(f"   {label:<44} {fmt_summary(v)}")
        if s["accelerate_launches"]:
            print(f"   {'accelerate hangs (no return in ' + str(ACC_LAUNCH_TIMEOUT) + ' s)':<44} "
                  f"{s['accelerate_hangs']} of {s['accelerate_launches']} launches")
        if s["nbdist_first_hangs"] or s["spawn_hangs"] or s["errors"]:
            print(f"   !! hangs: nbdist first {s['nbdist_first_hangs']}, spawn "
                  f"{s['spawn_hangs']}; {s['errors']} error(s) -- see startup.raw in the JSON")


def main(argv=None):
    import argparse

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--child" not in argv:
        return harness.run_alone(sys.modules[__name__], argv)
    ap = argparse.ArgumentParser(description="a child process of bench_startup.py (ChildRun)")
    ap.add_argument("--child", choices=sorted(CHILDREN), required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args(argv)
    CHILDREN[args.child](args)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
