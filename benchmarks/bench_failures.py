"""How fast failures reach the caller, and what 50 start/stop cycles leave behind (issue 3).

Run: python benchmarks/bench_failures.py [--reps 10] [--out failures.json]

* death -> RankDiedError: rank 1 records time.time() and calls os._exit(1) while rank 0 is inside an
  all_reduce; the caller notes when RankDiedError arrives. Side by side: torch.multiprocessing.spawn
  (join raises ProcessExitedException) doing the same.
* interrupt -> control back: rank 0 blocked in an all_reduce, rank 1 sleeping; a real SIGINT is sent
  to this process; the caller notes when GroupInterrupted arrives (ranks that don't react within
  the grace period are killed).
* 50 start/stop cycles: child processes, open fds, listening sockets, /dev/shm segments left, and the
  caller's RSS growth.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import tempfile
import threading
import time

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

import nbdist
from harness import summary as _stats  # median, p10, p90, min, max, mean, n


def death_nbdist(reps: int, stamp: str):
    out = []
    g = nbdist.start(2, timeout=30)
    for _ in range(reps):
        try:
            g.exec("import os, time\n"
                   f"if rank == 1:\n    time.sleep(0.3); open({stamp!r}, 'w').write(repr(time.time()))\n"
                   "    os._exit(1)\n"
                   "t = torch.ones(1000); dist.all_reduce(t)")
        except nbdist.RankDiedError:
            out.append(time.time() - float(open(stamp).read()))
        g.restart()
    g.stop()
    return out


def _spawn_worker(rank, store_path, stamp):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    if rank == 1:
        time.sleep(0.3)
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
        os._exit(1)
    t = torch.ones(1000)
    try:
        dist.all_reduce(t)
    except RuntimeError:
        pass


def death_spawn(reps: int, stamp: str):
    out = []
    for i in range(reps):
        store = tempfile.mktemp(prefix="bench-store-")
        try:
            tmp.spawn(_spawn_worker, args=(store, stamp), nprocs=2, join=True)
        except tmp.ProcessExitedException:
            out.append(time.time() - float(open(stamp).read()))
        except Exception:  # noqa: BLE001 -- the other rank's error surfaces first sometimes
            out.append(time.time() - float(open(stamp).read()))
    return out


def interrupt_nbdist(reps: int):
    out = []
    g = nbdist.start(2, timeout=30)
    for _ in range(reps):
        sent = []

        def fire():
            sent.append(time.time())
            os.kill(os.getpid(), signal.SIGINT)

        timer = threading.Timer(0.5, fire)
        timer.start()
        try:
            g.exec("import time\nif rank == 1: time.sleep(60)\nt = torch.ones(1); dist.all_reduce(t)")
        except nbdist.GroupInterrupted:
            out.append(time.time() - sent[0])
        timer.join()
        g.restart()
    g.stop()
    return out


def cycles(n: int):
    with nbdist.start(2) as warm:
        warm.run(int)
    me = psutil.Process()
    fds0, rss0 = me.num_fds(), me.memory_info().rss
    children0 = len(me.children(recursive=True))
    t0 = time.perf_counter()
    for _ in range(n):
        nbdist.start(2).stop()
    elapsed = time.perf_counter() - t0
    time.sleep(0.5)
    return {"cycles": n, "seconds_per_cycle": elapsed / n,
            "leaked_processes": len(me.children(recursive=True)) - children0,
            "leaked_fds": me.num_fds() - fds0,
            "listening_sockets": sum(c.status == "LISTEN" for c in me.net_connections()),
            "shm_segments_left": len(glob.glob("/dev/shm/nbdist-*")),
            "rss_growth_mib": (me.memory_info().rss - rss0) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    stamp = tempfile.mktemp(prefix="bench-death-")
    res = {
        "death_to_error_nbdist_s": _stats(death_nbdist(args.reps, stamp)),
        "death_to_error_mp_spawn_s": _stats(death_spawn(max(3, args.reps // 3), stamp)),
        "interrupt_to_control_nbdist_s": _stats(interrupt_nbdist(args.reps)),
        "start_stop_cycles": cycles(50),
    }
    os.path.exists(stamp) and os.unlink(stamp)
    print(json.dumps(res, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
