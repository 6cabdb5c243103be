#!/usr/bin/env python
"""Step time of the mesh strategies and the 1F1B pipeline against DDP, on the tutorial's model.

    python benchmarks/bench_parallel.py [--quick] [--sizes 2,4] [--out bench_parallel_results.json]

The model is the one of the tutorial "Beyond data parallel" (``notebooks/10_beyond_data_parallel``):
4 x ``TransformerBlock(16, 4, 32)``, a LayerNorm and a Linear head, Ψ = 8,996; SGD with momentum,
fp32, gloo on CPU. Every strategy trains the same **whole batch** of 8 sequences of 8 tokens per
step, shared out the way the strategy needs it:

* ``ddp``, ``hsdp``: each rank a 1/N share;
* ``tp``: the whole batch on every rank (tensor parallel over the whole world); ``tp+sp``: the
  same with sequence parallel (``sequence_parallel=True``, the tutorial's tp + sp);
* ``fsdp2+tp`` (``tp=2``): a 1/dp share per tp group;
* ``1f1b``: :func:`nbdist.parallel.pipeline`, 4 microbatches, one stage per rank (2 ranks: blocks
  0-2 | block 3, norm, head; 4 ranks: one block each, the last stage with the norm and the head).

``fsdp2+tp`` and ``hsdp`` run at 4 ranks only (2 x 2 meshes; at 2 ranks one of their dimensions
would be 1). For each world size, one group; every strategy is wrapped (or its pipeline built) and
trained once to warm up, then, round by round, each is built afresh and trains ``steps`` steps, the
order of the strategies rotating from round to round. A step's time is the slowest rank's (a
pipeline step is ``pipe.step(x, y)``: forward and backward of all microbatches and the optimizer
step); the first two steps of each call are left out. Medians over all rounds, with p10-p90, and
the ratio of each median to ``ddp``'s at the same world size.

The model is tiny on purpose (it is the tutorial's): the figures are dominated by per-collective
latency and Python overhead, not arithmetic -- they say what each strategy costs in messages, not
how it would scale on a large model. On a shared machine compare the ratios: the strategies are
interleaved so that load slows all of them alike. The JSON keeps every sample and the load average
at the start and the end.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

FULL = dict(rounds=7, steps=20)
QUICK = dict(rounds=2, steps=8)
STRATEGIES = {2: ["ddp", "tp", "tp+sp", "1f1b"],
              4: ["ddp", "tp", "tp+sp", "fsdp2+tp", "hsdp", "1f1b"]}
BATCH, SEQ, DIM, HEADS, HIDDEN, BLOCKS = 8, 8, 16, 4, 32, 4  # the tutorial's model and batch


@harness.as_main
def _train(name, steps):
    """Build ``name`` on a fresh model and train ``steps`` steps; per-step seconds, this rank."""
    import functools
    import logging
    import time as _t
    import warnings

    import torch
    import torch.distributed as dist

    from nbdist import parallel, strategies

    # torch's per-rank notes on FSDP2 x TP views and 2-D redistributes: nothing to act on here
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[parallel.TransformerBlock(DIM, HEADS, HIDDEN)
                                  for _ in range(BLOCKS)],
                                torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, 4))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, SEQ, DIM, generator=gen), torch.randn(BATCH, SEQ, 4, generator=gen)
    make_opt = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, foreach=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    times = []
    if name == "1f1b":
        split = [1, 2, 3] if world == 4 else None
        pipe = parallel.pipeline(model, "1f1b", microbatches=4, split=split, optimizer_fn=make_opt,
                                 loss_fn=torch.nn.functional.mse_loss)
        for _ in range(steps):
            t0 = _t.perf_counter()
            pipe.step(x, y)
            times.append(_t.perf_counter() - t0)
        return times
    if name in ("ddp", "hsdp"):
        dp, index = world, rank
    elif name == "fsdp2+tp":
        dp, index = world // 2, parallel.MeshLayout(world, dp=-1, tp=2).coords(rank)["dp"]
    else:  # tp, tp+sp
        dp, index = 1, 0
    x, y = x.chunk(dp)[index], y.chunk(dp)[index]
    if name == "tp+sp":
        wrapped, opt = strategies.wrap("tp", model, make_opt, sequence_parallel=True)
    else:
        wrapped, opt = strategies.wrap(name, model, make_opt)
    for _ in range(steps):
        t0 = _t.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()
        times.append(_t.perf_counter() - t0)
    return times


def run(cfg, sizes, log):
    import nbdist

    res = {}
    for n in sizes:
        names = STRATEGIES.get(n, ["ddp", "tp", "1f1b"])
        log(f"N={n}: {', '.join(names)} ...")
        samples = {name: [] for name in names}
        with nbdist.start(n, backend="gloo", device="cpu", timeout=180) as group:
            for name in names:  # warm-up: imports, the first optimizer, DTensor dispatch caches
                group.run(_train, name, 3)
            for r in range(cfg["rounds"]):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    per_rank = group.run(_train, name, cfg["steps"])
                    samples[name] += [max(step) for step in zip(*per_rank)][2:]
                log(f"  round {r + 1}/{cfg['rounds']}: " + ", ".join(
                    f"{k} {harness.summary(v)['median'] * 1e3:.1f} ms" for k, v in samples.items()))
        res[str(n)] = {"step_s": {k: harness.summary(v) for k, v in samples.items()},
                       "raw": {"step_s": samples}}
    return res


def ratios(res):
    """Each strategy's median step time over ddp's at the same world size."""
    return {f"N={n} {name} / ddp": harness.ratio(s, r["step_s"]["ddp"])
            for n, r in res.items() for name, s in r["step_s"].items() if name != "ddp"}


def print_table(res):
    print(f"\n=== step time, tutorial model (Ψ = 8,996), whole batch {BATCH} x {SEQ} tokens, SGD, "
          "gloo: median [p10-p90] (n steps), ratio to ddp ===")
    for n, r in res.items():
        print(f"\nN = {n}")
        base = r["step_s"]["ddp"]
        for name, s in r["step_s"].items():
            ratio = harness.ratio(s, base)
            print(f"  {name:10s} {harness.fmt_summary(s):34s} "
                  f"{'-' if ratio is None else f'{ratio:.2f}x':>6s}")


def main(argv=None) -> int:
    ap = harness.arg_parser(__doc__, "bench_parallel_results.json", sizes=True,
                            quick="2 rounds of 8 steps (~1 min on 2 loaded vCPUs; the "
                                  "full run ~4 min)")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    sizes = [int(x) for x in args.sizes.split(",")]
    os.environ.update({k: v for k, v in harness.loopback_env().items()
                       if k == "GLOO_SOCKET_IFNAME"})
    meta = harness.machine_info(config=cfg, sizes=sizes, quick=args.quick,
                                versions=harness.versions(), load_start=os.getloadavg(),
                                nbdist_source=harness.nbdist_source_info())
    t0 = time.perf_counter()
    res = {"meta": meta}
    try:
        res["parallel"] = run(cfg, sizes, harness.log)
        res["ratios"] = ratios(res["parallel"])
    finally:
        meta["leftover_processes"] = harness.final_sweep([])
        meta["load_end"] = os.getloadavg()
        meta["wall_s"] = time.perf_counter() - t0
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print_table(res["parallel"])
    print(f"\nload average {meta['load_start'][0]:.2f} at the start, {meta['load_end'][0]:.2f} at "
          f"the end; wall time {meta['wall_s']:.0f} s; raw numbers in {args.out}")
    if meta["leftover_processes"]:
        print(f"!! leftover processes killed at the end: {meta['leftover_processes']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
