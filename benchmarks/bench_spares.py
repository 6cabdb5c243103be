"""Start and restart where workers are spawned (Windows; ``start_method="spawn"`` elsewhere): warm
spares against today's spawn path and against ``torch.multiprocessing.spawn``, in one run.

    python benchmarks/bench_spares.py [--rounds 3] [--world-size 2] [--out bench_spares.json]

Each round times, world size 2, gloo on CPU, in an order that rotates every round:

* ``mp.spawn``: ``torch.multiprocessing.spawn`` of a function that initialises gloo, all_reduces
  one tensor and returns (start -> first result; its "restart" is the same call again);
* ``spawn, no spares`` (``NBDIST_SPARES=0``, nbdist before warm spares): ``nbdist.start`` until
  an all_reduce returned, then ``restart()`` until one returned again;
* ``spawn, warm spares``: the same with spares that had finished importing torch (what
  ``%load_ext nbdist`` and each start leave for the next one). The time the spares take to be ready
  again after a start (they import while the group works) is reported as ``refill``;
* ``forkserver`` (where there is one: the Linux default, for reference).

Runs under the Windows python.exe too (scripts/windows-stack.sh: ``wpy benchmarks/bench_spares.py``).
The JSON holds every sample.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import log, summary  # noqa: E402


def _mp_worker(rank, world_size, port):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == world_size
    dist.destroy_process_group()


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mp_spawn(ws):
    import torch.multiprocessing as tmp

    t0 = time.perf_counter()
    tmp.spawn(_mp_worker, args=(ws, _free_port()), nprocs=ws, join=True)
    return time.perf_counter() - t0


def _all_reduce(g, ws):
    out = g.exec("import torch, torch.distributed as dist\n"
                 "t = torch.ones(4)\ndist.all_reduce(t)\nt[0].item()")
    assert out == [float(ws)] * ws, out


def _nbdist(ws, method, warm):
    import nbdist
    from nbdist.runtime import spares

    if method == "spawn":
        os.environ[spares.ENV_VAR] = "2" if warm else "0"
        if warm:
            spares.top_up()
            spares.ready(timeout=600)
        else:
            spares.close()
    t0 = time.perf_counter()
    g = nbdist.start(ws, start_method=method, timeout=120, init_timeout=600)
    _all_reduce(g, ws)
    t1 = time.perf_counter()
    refill = None
    if warm:  # what a notebook's next cells give them: the time to import torch again
        spares.ready(timeout=600)
        refill = time.perf_counter() - t1
    t2 = time.perf_counter()
    g.restart()
    _all_reduce(g, ws)
    t3 = time.perf_counter()
    g.stop()
    return t1 - t0, t3 - t2, refill


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--out", default="bench_spares.json")
    args = ap.parse_args(argv)
    ws = args.world_size

    import multiprocessing as mp

    variants = ["mp.spawn", "spawn, no spares", "spawn, warm spares"]
    if "forkserver" in mp.get_all_start_methods():
        variants.append("forkserver")
        import nbdist

        with nbdist.start(ws, start_method="forkserver"):
            pass  # warm the forkserver: its one-off import is bench_startup.py's "first start"
    samples = {v: {"start": [], "restart": [], "refill": []} for v in variants}
    for rnd in range(args.rounds):
        order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
        for v in order:
            if v == "mp.spawn":
                start, restart, refill = _mp_spawn(ws), _mp_spawn(ws), None
            else:
                method = "forkserver" if v == "forkserver" else "spawn"
                start, restart, refill = _nbdist(ws, method, v == "spawn, warm spares")
            samples[v]["start"].append(start)
            samples[v]["restart"].append(restart)
            if refill is not None:
                samples[v]["refill"].append(refill)
            log(f"round {rnd} {v}: start -> first result {start:.2f} s, restart {restart:.2f} s"
                + (f", spares ready again {refill:.2f} s after the start" if refill else ""))
    print(f"world size {ws}, {args.rounds} rounds, {sys.platform}, os.cpu_count()={os.cpu_count()}")
    print(f"{'variant':<20} {'what':<8} {'median':>8} {'p10':>8} {'p90':>8}")
    for v, series in samples.items():
        for name, xs in series.items():
            if xs:
                s = summary(xs)
                print(f"{v:<20} {name:<8} {s['median']:8.2f} {s['p10']:8.2f} {s['p90']:8.2f}")
    base = summary(samples["spawn, no spares"]["restart"])["median"]
    warm = summary(samples["spawn, warm spares"]["restart"])["median"]
    mps = summary(samples["mp.spawn"]["start"])["median"]
    print(f"restart: warm spares {base / warm:.1f}x faster than no spares; "
          f"start -> first result: warm spares {mps / summary(samples['spawn, warm spares']['start'])['median']:.1f}x "
          f"faster than mp.spawn")
    with open(args.out, "w") as f:
        json.dump({"world_size": ws, "platform": sys.platform, "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
