"""Fresh ranks that run a DeepSpeed stage-3 step: ``NBDIST_PRELOAD`` against nbdist's default and
against ``torch.multiprocessing.spawn``, in one run.

    python benchmarks/bench_preload.py [--rounds 3] [--cycles 4] [--out bench_preload.json]

Each round runs three child processes, in an order that rotates every round; each child imports
torch and nbdist, then times ``--cycles`` cycles of: start 2 ranks (gloo, CPU), wrap a
``Linear(8, 8)`` in ``deepspeed_zero3`` with Adam and take two steps on every rank, stop.

* ``nbdist``: the default forkserver, which has imported torch;
* ``nbdist + NBDIST_PRELOAD``: the same, its forkserver also importing what the step imports
  (:data:`PRELOAD`);
* ``mp.spawn``: ``torch.multiprocessing.spawn`` of a function that initialises gloo and does the
  same.

The first cycle of a child includes starting the forkserver (and its imports); the later ones are
what a restart costs. For nbdist, each rank also reports its own CPU time at the end of its step
(a forked rank's clock starts at its fork). The JSON holds every sample.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import log, summary  # noqa: E402

PRELOAD = ("deepspeed,torch._dynamo,torch._inductor.compile_fx,torch._dynamo.testing,"
           "torch._dynamo.repro.after_aot")
MODES = ["nbdist", "nbdist + NBDIST_PRELOAD", "mp.spawn"]


def _step():
    """Two stage-3 steps on this rank; its CPU time so far."""
    import functools
    import time

    import torch

    from nbdist import strategies

    engine, opt = strategies.wrap("deepspeed_zero3", torch.nn.Linear(8, 8),
                                  functools.partial(torch.optim.Adam, lr=1e-2))
    for _ in range(2):
        opt.zero_grad()
        engine(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    return time.process_time()


def _mp_worker(rank, world_size, port):
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))  # DeepSpeed

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    _step()
    dist.destroy_process_group()


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(mode, cycles):
    """In a child process: ``cycles`` timed cycles; prints one JSON line."""
    import torch  # noqa: F401 -- imported before timing, as a notebook would have

    import nbdist

    walls, cpus = [], []
    for _ in range(cycles):
        t0 = time.perf_counter()
        if mode == "mp.spawn":
            import torch.multiprocessing as tmp

            tmp.spawn(_mp_worker, args=(2, _free_port()), nprocs=2, join=True)
        else:
            with nbdist.start(2, backend="gloo", device="cpu", start_method="forkserver") as g:
                cpus.append(sum(g.run(_step)))
        walls.append(time.perf_counter() - t0)
    print("BENCH " + json.dumps({"walls": walls, "rank_cpu": cpus}), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--out", default="bench_preload.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.cycles)
        return 0
    samples = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % 3:] + MODES[:r % 3]:
            env = dict(os.environ)
            env.pop("NBDIST_PRELOAD", None)
            if mode == "nbdist + NBDIST_PRELOAD":
                env["NBDIST_PRELOAD"] = PRELOAD
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode,
                                  "--cycles", str(args.cycles)], env=env, capture_output=True,
                                 text=True, timeout=600)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("BENCH ")]
            if not lines:
                log(f"{mode}: no result\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
                return 1
            samples[mode].append(json.loads(lines[0][6:]))
            log(f"round {r + 1} {mode}: {[round(w, 2) for w in samples[mode][-1]['walls']]}")
    res = {}
    for mode, runs in samples.items():
        res[mode] = {"first": summary([s["walls"][0] for s in runs]),
                     "restart": summary([w for s in runs for w in s["walls"][1:]]),
                     "rank_cpu_first": summary([s["rank_cpu"][0] for s in runs if s["rank_cpu"]]),
                     "rank_cpu_restart": summary([c for s in runs for c in s["rank_cpu"][1:]])}
    print(f"{'':26} {'first cycle (s)':>16} {'next cycles (s)':>16} {'ranks CPU, next (s)':>20}")
    for mode, r in res.items():
        cpu = r["rank_cpu_restart"].get("median")
        print(f"{mode:26} {r['first']['median']:16.2f} {r['restart']['median']:16.2f} "
              f"{'' if cpu is None else f'{cpu:.2f}':>20}")
    base, pre, spawn = (res[m]["restart"]["median"] for m in MODES)
    print(f"next cycles: NBDIST_PRELOAD {base / pre:.1f}x faster than the default, "
          f"{spawn / pre:.1f}x than mp.spawn")
    with open(args.out, "w") as f:
        json.dump({"samples": samples, "summary": res, "preload": PRELOAD}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
