"""Measured pipeline bubble against the schedules' theory (issue 19), gloo on CPU.

For each world size, schedule and number of microbatches: an nn.Sequential of ``--layers``
blocks (Linear(width, width) + Tanh) split evenly over the ranks, ``--repeats`` timed steps
(after one warm-up), and the median measured bubble (mean idle share of the ranks over the step's
makespan, :meth:`nbdist.parallel.Timeline.bubble`) next to (p-1)/(m+p-1)::

    python benchmarks/bench_pipeline.py                    # p = 2, m = 4 and 8, GPipe and 1F1B
    python benchmarks/bench_pipeline.py --ranks 2 4 --width 1024

The theory assumes equal stages and free communication; on CPU the gloo send/recv of each
activation and gradient shows as idle time, so the measured figure sits above the theory by
about the share of communication in the step (smaller with wider layers).
"""
from __future__ import annotations

import argparse
import statistics
import time

import nbdist
from nbdist.parallel import Timeline


def measure(schedule, microbatches, layers, width, batch, repeats):
    import torch

    from nbdist.parallel import pipeline

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width),
                                                      torch.nn.Tanh()) for _ in range(layers)])
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    pipe = pipeline(model, schedule, microbatches, loss_fn=torch.nn.functional.mse_loss)
    return [pipe.timeline(x, y) for _ in range(repeats)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"{'p':>2} {'schedule':>16} {'m':>3} {'theory':>7} {'measured':>9} {'p10-p90':>13} "
          f"{'step (ms)':>9}")
    for p in args.ranks:
        with nbdist.start(p, backend="gloo", device="cpu", timeout=60) as g:
            for schedule in args.schedules:
                for m in args.microbatches:
                    t0 = time.perf_counter()
                    per_rank = g.run(measure, schedule, m, args.layers, args.width, args.batch,
                                     args.repeats)
                    runs = [Timeline.merge(ts) for ts in zip(*per_rank)]
                    bubbles = sorted(t.bubble()["measured"] for t in runs)
                    theory = runs[0].bubble()["theory"]
                    q = statistics.quantiles(bubbles, n=10) if len(bubbles) > 1 else bubbles * 9
                    span = statistics.median(t.bubble()["makespan_s"] for t in runs) * 1e3
                    print(f"{p:>2} {schedule:>16} {m:>3} {theory:>7.1%} "
                          f"{statistics.median(bubbles):>9.1%} {q[0]:>6.1%}-{q[-1]:<6.1%} "
                          f"{span:>9.1f}   ({time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
