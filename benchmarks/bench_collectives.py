#!/usr/bin/env python
"""nbdist.bench measured against the plain way, in one run (gloo on CPU).

    python benchmarks/bench_collectives.py [--quick] [--out results.json] [--figures DIR]
        [--sections fidelity,limit,trace] [--world-size 2]

1. fidelity -- nbdist's bus bandwidth for all_reduce and all_gather at 1-64 MiB against a bare
   ``torch.distributed`` timing loop (warm up, barrier, time ``iters`` calls as one block, mean per
   call, slowest rank) run on the same ranks in the same session, the two interleaved round by round
   (alternating which goes first). Ratio = median over rounds of nbdist busbw / bare busbw of the
   same round. The bare loop takes the mean per call (as nccl-tests); nbdist's busbw comes from
   the median per-iteration time (``time_s``), so the table shows both nbdist's median-based
   ratio and the ratio for a busbw taken from nbdist's mean (``mean_s``), the like-for-like one.
2. limit -- single-core memcpy bandwidth of this machine (``nbdist.bench.memcpy_bandwidth`` on rank
   0: the fastest of memmove, torch ``copy_`` and ``numpy.copyto``, each printed), and the full
   sweep of every op at 4 KiB-64 MiB: best busbw per op as a fraction of that fastest copy.
   With ``--figures`` the sweep is drawn with memcpy as the limit line.
3. trace -- cost of ``nbdist.bench.trace()`` on a DDP training step (MLP, SGD): per-step time with
   one trace around a block of steps vs. the same block untraced, interleaved; plus the time the
   trace takes on exit (the profiler's post-processing), per step of the block.

Raw samples go to the JSON file; a summary is printed. The group is stopped at the end.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import harness
import nbdist
from nbdist import bench
from nbdist.bench.units import MiB, bandwidths, format_rate

FULL = dict(rounds=9, iters=10, warmup=3, sweep_iters=20, trace_rounds=15, trace_steps=10)
QUICK = dict(rounds=3, iters=5, warmup=2, sweep_iters=5, trace_rounds=3, trace_steps=5)
FIDELITY_SIZES = [MiB << i for i in range(7)]  # 1..64 MiB


# ---- functions that run on the ranks (shipped by value from this script) ------------------------
def bare_loop(op, nbytes, iters, warmup):
    """The plain way: warm up, barrier, time ``iters`` calls as one block; mean seconds per call."""
    import time

    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    count = nbytes // 4
    if op == "all_reduce":
        x = torch.zeros(count)
        run = lambda: dist.all_reduce(x)  # noqa: E731
    else:
        inp, out = torch.zeros(count // n), torch.zeros(count)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        run = lambda: gather(out, inp)  # noqa: E731
    for _ in range(warmup):
        run()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    return (time.perf_counter() - start) / iters


def ddp_overhead(width, steps, rounds, shapes):
    """Per-step seconds of a DDP step, untraced and inside one trace() per block, interleaved."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import nbdist.bench

    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    model = DDP(torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(64, width)

    def block():
        for _ in range(steps):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()

    block()
    with nbdist.bench.trace():  # the first profile in a process starts the profiler up
        block()
    out = {"plain": [], "traced": [], "plain_cpu": [], "traced_cpu": [], "exit": [],
           "events": 0}
    for r in range(rounds):
        for kind in (("plain", "traced") if r % 2 == 0 else ("traced", "plain")):
            dist.barrier()
            if kind == "plain":
                start, cpu = time.perf_counter(), time.process_time()
                block()
                out["plain"].append((time.perf_counter() - start) / steps)
                out["plain_cpu"].append((time.process_time() - cpu) / steps)
                continue
            with nbdist.bench.trace(shapes=shapes) as tr:
                start, cpu = time.perf_counter(), time.process_time()
                block()
                inner, inner_cpu = time.perf_counter(), time.process_time()
            done = time.perf_counter()
            out["traced"].append((inner - start) / steps)
            out["traced_cpu"].append((inner_cpu - cpu) / steps)
            out["exit"].append((done - inner) / steps)
            out["events"] = len(tr)
    return out


# ---- sections -----------------------------------------------------------------------------------
def fidelity(g, cfg, raw):
    n = g.world_size
    samples = {}
    for rnd in range(cfg["rounds"]):
        for op in ("all_reduce", "all_gather"):
            for size in FIDELITY_SIZES:
                s = samples.setdefault(f"{op} {size // MiB} MiB",
                                       {"nbdist": [], "nbdist_mean": [], "bare": []})
                for who in (("nbdist", "bare") if rnd % 2 == 0 else ("bare", "nbdist")):
                    if who == "bare":
                        t = max(g.run(bare_loop, op, size, cfg["iters"], cfg["warmup"]))
                        s["bare"].append(bandwidths(op, size, t, n)[1])
                    else:
                        rec = bench.collectives(g, ops=[op], sizes=[size], iters=cfg["iters"],
                                                warmup=cfg["warmup"], progress=False)[0]
                        s["nbdist"].append(rec["busbw_GBps"])
                        s["nbdist_mean"].append(bandwidths(op, size, rec["mean_s"], n)[1])
        print(f"  fidelity round {rnd + 1}/{cfg['rounds']} done", file=sys.stderr)
    raw["fidelity"] = samples
    print(f"\nFidelity (world size {n}, gloo): busbw, median of {cfg['rounds']} interleaved rounds;"
          "\nratio = median over rounds of (nbdist / bare loop of the same round)")
    print(f"{'point':18s} {'bare loop':>10s} {'nbdist':>10s} {'ratio':>6s} {'mean-based':>12s}")
    ratios, median_ratios = [], []
    for point, s in samples.items():
        bare, nb = statistics.median(s["bare"]), statistics.median(s["nbdist"])
        r = statistics.median(a / b for a, b in zip(s["nbdist"], s["bare"]))
        rm = statistics.median(a / b for a, b in zip(s["nbdist_mean"], s["bare"]))
        ratios.append(r)
        median_ratios.append(rm)
        print(f"{point:18s} {format_rate(bare):>10s} {format_rate(nb):>10s} {r:6.3f} {rm:12.3f}")
    print(f"all points: ratio median {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}); mean-based: median "
          f"{statistics.median(median_ratios):.3f} (range {min(median_ratios):.3f}-"
          f"{max(median_ratios):.3f})")


def limit(g, cfg, raw, figures):
    ways = [bench.memcpy_bandwidth(g, each=True) for _ in range(5)]
    memcpy = [max(w.values()) for w in ways]  # per call: the fastest way
    records = bench.collectives(g, sizes="4K-64M", iters=cfg["sweep_iters"],
                                warmup=cfg["warmup"], progress=True)
    raw["memcpy_GBps"], raw["memcpy_ways_GBps"], raw["sweep"] = memcpy, ways, list(records)
    medians = {k: statistics.median(w[k] for w in ways) for k in ways[0]}
    mc = max(medians.values())  # the fastest way, by its median over the calls
    each = ", ".join(f"{k} {format_rate(v)}" for k, v in medians.items())
    print(f"\nmemcpy, one core (rank 0, median of 5): {each}; the limit, the fastest: "
          f"{format_rate(mc)}")
    print(f"{'op':15s} {'best busbw':>11s} {'at':>8s} {'of memcpy':>10s}")
    for op in bench.OPS:
        rows = [r for r in records if r["op"] == op and r["busbw_GBps"]]
        if rows:
            best = max(rows, key=lambda r: r["busbw_GBps"])
            print(f"{op:15s} {format_rate(best['busbw_GBps']):>11s} "
                  f"{bench.format_bytes(best['bytes']):>8s} {best['busbw_GBps'] / mc:10.0%}")
    if figures:
        import matplotlib
        matplotlib.use("Agg")
        axes = records.plot(limit=mc, limit_label="memcpy")
        path = os.path.join(figures, "bench_collectives.png")
        axes[0].figure.savefig(path, dpi=120, bbox_inches="tight")
        print(f"figure: {path}")


def trace_overhead(g, cfg, raw, figures):
    raw["trace"] = {}
    print(f"\nTracing a DDP step (world size {g.world_size}, 4x Linear(w, w) + ReLU, batch 64, "
          f"SGD), {cfg['trace_rounds']} rounds of {cfg['trace_steps']} steps")
    print("overhead = median over rounds of (traced / plain of the same round) - 1; wall clock "
          "and process CPU time")
    print(f"{'width':>6s} {'shapes':>6s} {'rank':>4s} {'plain':>9s} {'traced':>9s} {'wall':>7s} "
          f"{'cpu':>7s} {'exit/step':>10s} {'events':>7s}")
    for width, shapes in ((256, True), (256, False), (1024, True), (1024, False)):
        out = g.run(ddp_overhead, width, cfg["trace_steps"], cfg["trace_rounds"], shapes)
        raw["trace"][f"{width} shapes={shapes}"] = out
        for rank, o in enumerate(out):
            wall = statistics.median(t / p for t, p in zip(o["traced"], o["plain"])) - 1
            cpu = statistics.median(t / p for t, p in zip(o["traced_cpu"], o["plain_cpu"])) - 1
            print(f"{width:6d} {str(shapes):>6s} {rank:4d} "
                  f"{bench.format_time(statistics.median(o['plain'])):>9s} "
                  f"{bench.format_time(statistics.median(o['traced'])):>9s} {wall:7.1%} "
                  f"{cpu:7.1%} {bench.format_time(statistics.median(o['exit'])):>10s} "
                  f"{o['events']:7d}")
    if figures:
        import matplotlib
        matplotlib.use("Agg")
        from nbdist.bench import Trace

        tr = Trace.merge(g.run(_ddp_traced_step))
        ax = tr.plot()
        path = os.path.join(figures, "trace_ddp.png")
        ax.figure.savefig(path, dpi=120, bbox_inches="tight")
        print(f"figure: {path}\n{tr.summary()}")


def _ddp_traced_step():
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import nbdist.bench

    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(1024, 1024), torch.nn.ReLU())]
    model = DDP(torch.nn.Sequential(*layers, torch.nn.Linear(1024, 1)), bucket_cap_mb=4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(64, 1024)
    for _ in range(2):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    with nbdist.bench.trace() as tr:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return tr


def main(argv=None):
    p = harness.arg_parser(__doc__, "bench_collectives_results.json", ["fidelity", "limit", "trace"],
                           quick="fewer rounds and iterations")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--figures", default=None, help="directory for the PNG figures")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if args.figures:
        os.makedirs(args.figures, exist_ok=True)
    raw = {"config": dict(cfg, world_size=args.world_size), "machine": harness.machine_info(),
           "started": time.time(), "load_before": os.getloadavg()}
    with nbdist.start(args.world_size, backend="gloo", device="cpu") as g:
        if "fidelity" in sections:
            fidelity(g, cfg, raw)
        if "limit" in sections:
            limit(g, cfg, raw, args.figures)
        if "trace" in sections:
            trace_overhead(g, cfg, raw, args.figures)
    raw["seconds"] = time.time() - raw["started"]
    raw["load_after"] = os.getloadavg()
    print(f"\nload average (1 min) before {raw['load_before'][0]:.1f}, after "
          f"{raw['load_after'][0]:.1f} on {os.cpu_count()} CPUs")
    with open(args.out, "w") as f:
        json.dump(raw, f, indent=1)
    print(f"\nraw samples: {args.out} ({raw['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
