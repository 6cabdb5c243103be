#!/usr/bin/env python
"""What a forked rank costs to start, and the starts and restarts it makes: this checkout against
another one, interleaved round by round in one run.

    python benchmarks/bench_rank_start.py [--against PATH] [--rounds 6] [--cycles 10] [--sizes 2,4]

Each round runs one child process per checkout (``PYTHONPATH`` set to it; with no ``--against``,
this checkout alone), in turn, each going first every other round. A child starts a group once
(the forkserver warms up), then ``--cycles`` times for each world size: ``nbdist.start(N)`` + a
call that returns what the rank has cost since its fork (CPU, minor page faults, unique memory),
then ``restart()`` + the same call, then ``stop()``. Printed: medians over every sample of every
round, per checkout, and their ratio. Gloo on CPU; run it on a quiet machine where you can.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rank_cost():
    import resource

    import psutil

    use = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_ms": (use.ru_utime + use.ru_stime) * 1e3, "minflt": use.ru_minflt,
            "uss_mib": psutil.Process().memory_full_info().uss / 2**20}


def child(sizes, cycles) -> None:
    import nbdist

    nbdist.start(2).stop()  # the forkserver up, torch imported there
    out = {}
    for n in sizes:
        rec = {k: [] for k in ("start_ms", "restart_ms", "stop_ms", "cpu_ms", "minflt", "uss_mib")}
        for _ in range(cycles):
            t0 = time.perf_counter()
            g = nbdist.start(n, max_world_size=n)
            costs = g.run(_rank_cost)
            t1 = time.perf_counter()
            g.restart()
            g.run(_rank_cost)
            t2 = time.perf_counter()
            g.stop()
            t3 = time.perf_counter()
            rec["start_ms"].append((t1 - t0) * 1e3)
            rec["restart_ms"].append((t2 - t1) * 1e3)
            rec["stop_ms"].append((t3 - t2) * 1e3)
            for cost in costs:
                for key, value in cost.items():
                    rec[key].append(value)
        out[n] = rec
    print("RESULT " + json.dumps(out), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="another nbdist checkout to compare with (its root)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--sizes", default="2,4")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child:
        child(sizes, args.cycles)
        return 0
    trees = {"this checkout": ROOT}
    if args.against:
        trees["--against"] = os.path.abspath(args.against)
    samples = {name: {} for name in trees}
    for r in range(args.rounds):
        order = list(trees.items())
        for name, tree in order[::-1] if r % 2 else order:  # each goes first every other round
            env = dict(os.environ, PYTHONPATH=tree)
            try:
                done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                       "--sizes", args.sizes, "--cycles", str(args.cycles)],
                                      env=env, capture_output=True, text=True, timeout=600,
                                      cwd=tree)
            except subprocess.TimeoutExpired:
                sys.exit(f"{name} ({tree}): a round took more than 600 s")
            line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if done.returncode or not line:
                sys.exit(f"{name} ({tree}) failed:\n{done.stderr[-3000:]}")
            for n, rec in json.loads(line[0][7:]).items():
                for key, values in rec.items():
                    samples[name].setdefault(n, {}).setdefault(key, []).extend(values)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    keys = ["start_ms", "restart_ms", "stop_ms", "cpu_ms", "minflt", "uss_mib"]
    for n in map(str, sizes):
        print(f"\nN={n} (medians; start and restart include a call; per rank: CPU, minor faults "
              f"and unique memory from its fork to that call)")
        print(f"{'':24}" + "".join(f"{k:>12}" for k in keys))
        for name in trees:
            rec = samples[name][n]
            print(f"{name:24}" + "".join(f"{statistics.median(rec[k]):12.1f}" for k in keys))
        if len(trees) == 2:
            a, b = (samples[name][n] for name in trees)
            print(f"{'ratio --against / this':24}" + "".join(
                f"{statistics.median(b[k]) / statistics.median(a[k]):12.2f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
