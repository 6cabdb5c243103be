"""Time to a ready group under each start method: forkserver (the default on Linux and macOS) and
spawn (Windows' only method; ``start_method="spawn"`` elsewhere), world size 2, gloo on CPU.

    python benchmarks/bench_start_methods.py [--rounds 5] [--out results.json]

Each round starts a group with each method (alternating, so machine load hits both alike), times
``nbdist.start`` until ready, one ``restart()``, and ``stop()``. The forkserver is warmed first (its
one-off torch import is bench_startup.py's "first start"); spawn has nothing to warm: every rank
imports torch on every start. The JSON holds every sample.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import log, summary  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--out", default="bench_start_methods.json")
    args = ap.parse_args(argv)

    import nbdist

    with nbdist.start(args.world_size, start_method="forkserver"):
        pass  # warm the forkserver
    samples = {m: {"start": [], "restart": [], "stop": []} for m in ("forkserver", "spawn")}
    for rnd in range(args.rounds):
        for method in ("forkserver", "spawn") if rnd % 2 == 0 else ("spawn", "forkserver"):
            t0 = time.perf_counter()
            g = nbdist.start(args.world_size, start_method=method)
            t1 = time.perf_counter()
            g.restart()
            t2 = time.perf_counter()
            g.stop()
            t3 = time.perf_counter()
            for name, value in (("start", t1 - t0), ("restart", t2 - t1), ("stop", t3 - t2)):
                samples[method][name].append(value)
            log(f"round {rnd} {method}: start {t1 - t0:.2f} s, restart {t2 - t1:.2f} s")
    print(f"world size {args.world_size}, {args.rounds} rounds, os.cpu_count()={os.cpu_count()}")
    print(f"{'method':<11} {'what':<8} {'median':>8} {'p10':>8} {'p90':>8}")
    for method, series in samples.items():
        for name, xs in series.items():
            s = summary(xs)
            print(f"{method:<11} {name:<8} {s['median']:8.2f} {s['p10']:8.2f} {s['p90']:8.2f}")
    with open(args.out, "w") as f:
        json.dump({"world_size": args.world_size, "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
