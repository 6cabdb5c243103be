"""What the collective recorder costs (issue 27): per collective, and on a DDP step loop, next to
no recording and to torch's own ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks, in one run.

    python benchmarks/bench_recorder.py [--calls 20000] [--steps 200] [--rounds 3]

1. Per collective: in this process, a 1-rank gloo group; ``dist.all_reduce`` of one float, called
   ``--calls`` times through the recorder's wrapper and as torch's own function, in alternating
   blocks; the difference per call is the recorder's cost.
2. A data-parallel step loop on a 2-rank nbdist group (Linear 256x256 x2, batch 32, SGD; each
   gradient all_reduced by hand, and the loss for logging: 5 collectives a step): median step
   time with the recorder (the default), with ``NBDIST_RECORD=0``, and with
   ``start(debug="detail")`` (DETAIL), the modes rotating per round. Not DDP: its gradient all_reduces are issued from C++,
   which the recorder does not see, and DDP under DETAIL is killed by SIGSEGV on torch 2.13 (gloo,
   CPU; plain ``mp.spawn`` too).

A third figure isolates the wrapper: the same calls of a function that does nothing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import log  # noqa: E402

LOOP = """
import time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 256)
times = []
for step in range({steps}):
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    logged = loss.detach().clone()
    dist.all_reduce(logged)
    times.append(time.perf_counter() - t0)
sorted(times)[len(times) // 2]
"""


def per_call(calls: int):
    import torch
    import torch.distributed as dist

    from nbdist.runtime import recorder

    path = tempfile.mktemp(prefix="nbdist-bench-recorder-")
    dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
    raw = dist.all_reduce
    wrapped = recorder._wrap("all_reduce", raw, torch.Tensor, dist.ProcessGroup)
    nothing = recorder._wrap("all_reduce", lambda *a, **k: None, torch.Tensor, dist.ProcessGroup)
    t = torch.ones(1)
    best = {"raw": [], "recorded": [], "wrapper": []}
    for _ in range(7):
        for name, fn in (("raw", raw), ("recorded", wrapped), ("wrapper", nothing)):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(t)
            best[name].append((time.perf_counter() - t0) / calls)
    dist.destroy_process_group()
    if os.path.exists(path):  # FileStore removes its file when the last user goes
        os.unlink(path)
    return {k: min(v) for k, v in best.items()}


def step_loop(steps: int, rounds: int):
    import nbdist

    modes = {"recorder (default)": ({}, "off"), "NBDIST_RECORD=0": ({"NBDIST_RECORD": "0"}, "off"),
             "DETAIL": ({}, "detail")}
    out = {m: [] for m in modes}
    names = list(modes)
    for rnd in range(rounds):
        for mode in names[rnd % 3:] + names[:rnd % 3]:
            env, detail = modes[mode]
            with nbdist.start(2, env=env, debug=detail, timeout=120) as g:
                median = max(g.exec(LOOP.format(steps=steps)))
            out[mode].append(median)
            log(f"round {rnd} {mode}: median step {1e3 * median:.3f} ms")
    return {m: statistics.median(v) for m, v in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    calls = per_call(args.calls)
    print(f"per all_reduce (1 rank, 1 float, best of 5 x {args.calls}): torch "
          f"{1e6 * calls['raw']:.2f} us, recorded {1e6 * calls['recorded']:.2f} us, "
          f"the wrapper around a function that does nothing {1e6 * calls['wrapper']:.2f} us")
    loop = step_loop(args.steps, args.rounds)
    base = loop["NBDIST_RECORD=0"]
    print(f"DDP step loop, 2 ranks, {args.steps} steps, median of {args.rounds} rounds:")
    for mode, value in loop.items():
        print(f"  {mode:<20} {1e3 * value:8.3f} ms/step  ({100 * (value / base - 1):+.1f} %)")


if __name__ == "__main__":
    main()
