#!/usr/bin/env python
"""Per-rank memory of every data-parallel strategy, measured on real ranks, vs the ZeRO formulas.

    python benchmarks/bench_memory.py [--model mlp:4x2236] [--world-sizes 2,4] [--profile]
                                      [--strategies ddp,zero1,...] [--out bench_memory_results.json]

For each world size a fresh gloo/CPU group trains ``--steps`` Adam steps of the model under each
strategy (``nbdist.memory.measure``). The table shows, per strategy, rank 0's exact bytes of params,
grads and optimizer state (unique storages), their sum against the fp32 estimate
(``nbdist.memory.estimate``), the other Python-visible tensors after the step and between forward
and backward ("in flight"), the peak (only with ``--profile``: torch profiler, approximate), and
the notes that explain any difference. A strategy whose ranks disagree is flagged. Every record
(all ranks) goes to the JSON file, with the versions and the machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

DEFAULT = ["ddp", "zero1", "fsdp_grad_op", "fsdp", "fsdp2", "fairscale_oss", "fairscale_sharded"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp:4x2236")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--strategies", default=",".join(DEFAULT))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="also measure the peak (slower)")
    parser.add_argument("--out", default="bench_memory_results.json")
    args = parser.parse_args(argv)

    import torch

    import nbdist
    from nbdist import memory

    model_fn = memory.model_spec(args.model)
    names = [n for n in args.strategies.split(",") if n]
    sizes = [int(n) for n in args.world_sizes.split(",")]
    try:
        import fairscale
        fairscale_version = fairscale.__version__
    except ImportError:
        fairscale_version = None
        names = [n for n in names if not n.startswith("fairscale")]
        print("fairscale is not installed: its strategies are skipped", file=sys.stderr)
    results = dict(model=args.model, steps=args.steps, batch=args.batch, profile=args.profile,
                   torch=torch.__version__, fairscale=fairscale_version, nbdist=nbdist.__version__,
                   python=platform.python_version(), cores=os.cpu_count(),
                   date=datetime.datetime.now().isoformat(timespec="seconds"), runs=[])
    lines = []
    for n in sizes:
        with nbdist.start(n, backend="gloo", device="cpu", timeout=120) as group:
            for name in names:
                t0 = time.perf_counter()
                report = memory.measure(group, model_fn, [name], steps=args.steps,
                                        batch=args.batch, profile=args.profile)
                seconds = time.perf_counter() - t0
                results["runs"].append(dict(world_size=n, strategy=name, seconds=seconds,
                                            records=report.to_dicts()))
                lines.append(_row(report, seconds))
                print(lines[-1], flush=True)
    header = (f"{'strategy':18s} {'N':>2s} {'params':>8s} {'grads':>8s} {'optim':>8s} "
              f"{'state':>8s} {'estimate':>8s} {'diff':>7s} {'other':>7s} {'flight':>7s} "
              f"{'peak':>7s}  (MB = 1e6 bytes, rank 0; model {args.model}, fp32 Adam)")
    print("\n" + header + "\n" + "-" * len(header))
    print("\n".join(line.split("\n")[0] for line in lines))
    print("\nnotes (rank 0):")
    for line in lines:
        for note in line.split("\n")[1:]:
            print(note)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nall ranks' records: {args.out}")
    return 0


def _row(report, seconds: float) -> str:
    r = report[0]
    same = all((x.params, x.grads, x.optimizer) == (r.params, r.grads, r.optimizer)
               for x in report)
    mb = (lambda v: "-" if v is None else f"{v / 1e6:.2f}")
    row = (f"{r.strategy:18s} {r.world_size:2d} {mb(r.params):>8s} {mb(r.grads):>8s} "
           f"{mb(r.optimizer):>8s} {mb(r.model_state):>8s} {mb(r.estimate):>8s} "
           f"{r.diff:+7.1%} {mb(r.other):>7s} {mb(r.in_flight):>7s} {mb(r.peak):>7s}"
           f"{'' if same else '  (ranks differ: see JSON)'}  [{seconds:.1f} s]")
    return "\n".join([row] + [f"  {r.strategy} N={r.world_size}: {note}" for note in r.notes])


if __name__ == "__main__":
    sys.exit(main())
