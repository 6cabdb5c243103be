#!/usr/bin/env python
"""nbdist_shm against gloo, side by side in one run (CPU tensors, one host).

    python benchmarks/bench_shm.py [--quick] [--world-sizes 2,4] [--rounds 5]
        [--out bench_shm_results.json]

For each world size, one nbdist group is started with gloo as its default backend (nbdist
gives each rank its share of the cores: 1 torch thread per rank on a 2-core machine). Every
round, each rank creates an ``nbdist_shm`` group of the same ranks and times, point by point,
both backends back to back, in alternating order (gloo first in even rounds): warm up, gloo
barrier, ``iters`` calls as one block, mean per call; the slowest rank's time counts. Both
backends therefore see the same machine noise, and each round gives a paired ratio
(nbdist_shm / gloo). Reported: the median over rounds of each backend's bus bandwidth
(nccl-tests convention: all_reduce busbw = size / time x 2(N-1)/N), the median of the paired
ratios, and the fraction of single-core memcpy (``nbdist.bench.memcpy_bandwidth`` of 64 and 256 MiB
on rank 0, measured before and after, median: the fastest of memmove, torch ``copy_`` and
``numpy.copyto``). Small messages (4 KiB all_reduce, barrier) are compared by latency.

Targets from the issue: all_reduce busbw at 16-256 MiB >= 3x gloo with 2 ranks and >= 2x with
4; 4 KiB all_reduce and barrier latency no worse than gloo. The summary says which are met.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import harness
import nbdist
from nbdist import bench
from nbdist.bench.units import MiB, bandwidths, format_rate

KiB = 1024
# (op, bytes, iters, warmup): iters sized so that a block takes ~0.05-1 s with gloo
POINTS = [("barrier", 0, 200, 20), ("all_reduce", 4 * KiB, 200, 20),
          ("all_reduce", 64 * KiB, 100, 10), ("all_reduce", 1 * MiB, 30, 3),
          ("all_reduce", 16 * MiB, 5, 1), ("all_reduce", 64 * MiB, 3, 1),
          ("all_reduce", 256 * MiB, 2, 1), ("broadcast", 64 * MiB, 3, 1),
          ("all_gather", 64 * MiB, 3, 1), ("reduce_scatter", 64 * MiB, 3, 1)]
QUICK_POINTS = [p for p in POINTS if p[1] <= 64 * MiB]
BACKENDS = ("gloo", "nbdist_shm")


# ---- runs on the ranks (shipped by value) -------------------------------------------------------
def one_round(points, shm_first):
    """Time every point on gloo (the default group) and on a fresh nbdist_shm group."""
    import time

    import torch
    import torch.distributed as dist

    import nbdist.backends.shm

    shm_group = dist.new_group(backend=nbdist.backends.shm.register())
    # torch 2.13's names (the older ones warn); fall back on older torch
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    n = dist.get_world_size()
    order = ("nbdist_shm", "gloo") if shm_first else ("gloo", "nbdist_shm")
    out = []
    for op, nbytes, iters, warmup in points:
        count = nbytes // 4
        if op == "barrier":
            def call(group):
                dist.barrier(group=group)
        elif op == "all_reduce":
            x = torch.zeros(count)

            def call(group):
                dist.all_reduce(x, group=group)
        elif op == "broadcast":
            x = torch.zeros(count)

            def call(group):
                dist.broadcast(x, src=0, group=group)
        elif op == "all_gather":  # nbytes: the size of the output
            inp, outp = torch.zeros(count // n), torch.zeros(count // n * n)

            def call(group):
                all_gather(outp, inp, group=group)
        else:  # reduce_scatter, nbytes: the size of the input
            inp, outp = torch.zeros(count // n * n), torch.zeros(count // n)

            def call(group):
                reduce_scatter(outp, inp, group=group)
        times = {}
        for who in order:
            group = shm_group if who == "nbdist_shm" else None
            for _ in range(warmup):
                call(group)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                call(group)
            times[who] = (time.perf_counter() - start) / iters
        out.append(times)
    dist.destroy_process_group(shm_group)
    return out


# ---- the caller's side --------------------------------------------------------------------------
def _label(op, nbytes):
    return op if op == "barrier" else f"{op} {bench.format_bytes(nbytes)}"


def _bus(op, nbytes, seconds, n):
    kind = {"all_gather": "all_gather", "reduce_scatter": "reduce_scatter"}.get(op, op)
    return bandwidths(kind, nbytes, seconds, n)[1]


def run_world(n, rounds, points, raw):
    g = nbdist.start(n, backend="gloo", device="cpu", timeout=300)
    try:
        ways = [bench.memcpy_bandwidth(g, nbytes=s, each=True) for s in (64 * MiB, 256 * MiB)]
        samples = {_label(op, b): {k: [] for k in BACKENDS} for op, b, _, _ in points}
        for r in range(rounds):
            per_rank = g.run(one_round, points, r % 2 == 1)
            for i, (op, nbytes, _, _) in enumerate(points):
                for who in BACKENDS:  # the slowest rank's time
                    samples[_label(op, nbytes)][who].append(max(p[i][who] for p in per_rank))
            print(f"  world size {n}: round {r + 1}/{rounds} done", file=sys.stderr)
        ways += [bench.memcpy_bandwidth(g, nbytes=s, each=True) for s in (64 * MiB, 256 * MiB)]
        memcpy = [max(w.values()) for w in ways]
        threads = g.exec("torch.get_num_threads()")[0]
    finally:
        g.stop()
    raw[str(n)] = {"memcpy_GBps": memcpy, "memcpy_ways_GBps": ways, "threads_per_rank": threads,
                   "seconds": samples}
    print("memcpy, one core, each way (median of 4): " + ", ".join(
        f"{k} {format_rate(statistics.median(w[k] for w in ways))}" for k in ways[0]))
    fastest = max(statistics.median(w[k] for w in ways) for k in ways[0])  # by its median
    return report(n, points, samples, fastest, threads)


def report(n, points, samples, memcpy, threads):
    print(f"\nworld size {n} ({threads} torch thread(s) per rank), medians of "
          f"{len(next(iter(samples.values()))['gloo'])} interleaved rounds; memcpy (one core, "
          f"the fastest way) "
          f"{format_rate(memcpy)}")
    print(f"{'point':24s} {'gloo':>11s} {'nbdist_shm':>11s} {'ratio':>7s} {'shm/memcpy':>10s}")
    verdicts = []
    for op, nbytes, _, _ in points:
        s = samples[_label(op, nbytes)]
        ratios = [g_ / s_ for g_, s_ in zip(s["gloo"], s["nbdist_shm"])]  # time ratio = bw ratio
        ratio = statistics.median(ratios)
        tg, ts = statistics.median(s["gloo"]), statistics.median(s["nbdist_shm"])
        if op == "barrier" or nbytes <= 64 * KiB:
            cells = (bench.format_time(tg), bench.format_time(ts), "")
        else:
            bg, bs = _bus(op, nbytes, tg, n), _bus(op, nbytes, ts, n)
            cells = (format_rate(bg), format_rate(bs), f"{bs / memcpy:10.0%}")
        print(f"{_label(op, nbytes):24s} {cells[0]:>11s} {cells[1]:>11s} {ratio:6.2f}x "
              f"{cells[2]:>10s}")
        if op == "barrier" or (op == "all_reduce" and nbytes == 4 * KiB):
            verdicts.append((f"{_label(op, nbytes)} latency <= gloo", ratio >= 1.0, ratio))
        elif op == "all_reduce" and nbytes >= 16 * MiB:
            want = 3.0 if n == 2 else 2.0
            verdicts.append((f"{_label(op, nbytes)} busbw >= {want:g}x gloo", ratio >= want, ratio))
    print("ratio: median over rounds of gloo time / nbdist_shm time in the same round "
          "(> 1: nbdist_shm faster)")
    for text, ok, ratio in verdicts:
        print(f"  target {text}: {'met' if ok else 'NOT met'} ({ratio:.2f}x)")
    return verdicts


def main(argv=None):
    parser = harness.arg_parser(__doc__, "bench_shm_results.json", quick="3 rounds, up to 64 MiB")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 5, quick 3)")
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated, default 2,4")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 5)
    points = QUICK_POINTS if args.quick else POINTS
    raw = {"machine": harness.machine_info(started=time.strftime("%Y-%m-%d %H:%M:%S")),
           "points": points}
    verdicts = {}
    for n in (int(w) for w in args.world_sizes.split(",")):
        verdicts[n] = run_world(n, rounds, points, raw)
    with open(args.out, "w") as f:
        json.dump(raw, f, indent=1)
    print(f"\nraw samples (seconds per call, slowest rank) in {args.out}")
    return 0 if all(ok for v in verdicts.values() for _, ok, _ in v) else 1


if __name__ == "__main__":
    sys.exit(main())
