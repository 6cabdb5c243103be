#!/usr/bin/env python
"""DeepSpeed ZeRO 1-3 against torch's and fairscale's ZeRO: step time, and the first DeepSpeed call.

    python benchmarks/bench_deepspeed.py [--quick] [--sizes 2,4] [--model mlp:4x256]
                                         [--out bench_deepspeed_results.json]

The model is the one of the tutorial "ZeRO three ways" (``mlp:4x256``: 4 x Linear(256, 256),
Ψ = 263,168), fp32 Adam, 16 samples per rank, gloo on CPU. For each world size, in one run:

1. **Step time.** One group; every strategy is wrapped and trained once to warm up, then, round by
   round, each strategy is wrapped afresh and trains ``steps`` steps (``zero_grad``, forward, MSE
   loss, ``backward``, ``step``), the order of the strategies rotating from round to round. A
   step's time is the slowest rank's; the first two steps of each call are left out (the first
   step builds buffers). Medians over all rounds, and the ratio of each DeepSpeed stage to torch's
   and fairscale's strategy of the same stage: ``zero1`` / ``fairscale_oss`` (ZeRO-1),
   ``fsdp_grad_op`` / ``fairscale_sharded`` (ZeRO-2), ``fsdp`` (ZeRO-3; fairscale's FSDP needs
   CUDA).
2. **The first DeepSpeed call on a fresh group**: a new group (its start is not counted), then
   ``g.run`` of one ``wrap("deepspeed_zero1")`` + one step, timed in the caller. That is what a
   user waits for: it includes ``import deepspeed`` on every rank (and torch's first optimizer,
   which imports ``torch._dynamo``). For comparison, on another fresh group the same first call with
   torch's ``zero1``, then DeepSpeed's first call after it (the part DeepSpeed adds), then a warm
   DeepSpeed call.

Compare the ratios more than the absolute figures on a shared machine: the strategies are
interleaved so that load slows all of them alike. The JSON keeps every sample and the load average
at the start and the end.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

FULL = dict(rounds=7, steps=20, fresh=3)
QUICK = dict(rounds=2, steps=10, fresh=1)
STAGES = {1: ["zero1", "fairscale_oss", "deepspeed_zero1"],
          2: ["fsdp_grad_op", "fairscale_sharded", "deepspeed_zero2"],
          3: ["fsdp", "deepspeed_zero3"]}
BATCH = 16  # samples per rank


@harness.as_main
def _train(name, model_fn, steps, batch):
    """Wrap a fresh model with ``name`` and train ``steps`` steps; per-step seconds, this rank."""
    import functools
    import time as _t

    import torch

    from nbdist import strategies

    torch.manual_seed(0)
    model = model_fn()
    width = next(m for m in model.modules() if isinstance(m, torch.nn.Linear)).in_features
    gen = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(steps, batch, width, generator=gen), None
    t0 = _t.perf_counter()
    model, opt = strategies.wrap(name, model, functools.partial(torch.optim.Adam, lr=1e-3))
    wrap_s = _t.perf_counter() - t0
    times = []
    for x in xs:
        t0 = _t.perf_counter()
        opt.zero_grad()
        out = model(x)
        ys = torch.zeros_like(out) if ys is None else ys
        torch.nn.functional.mse_loss(out, ys).backward()
        opt.step()
        times.append(_t.perf_counter() - t0)
    return dict(times=times, wrap_s=wrap_s)


def _step_times(group, names, model_fn, cfg):
    """{name: [slowest rank's step time, ...]} over the rounds, strategies interleaved."""
    samples = {n: [] for n in names}
    wraps = {n: [] for n in names}
    for name in names:  # warm-up: imports, first optimizer, DeepSpeed's first engine
        group.run(_train, name, model_fn, 3, BATCH)
    for r in range(cfg["rounds"]):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            per_rank = group.run(_train, name, model_fn, cfg["steps"], BATCH)
            samples[name] += [max(steps) for steps in zip(*(x["times"] for x in per_rank))][2:]
            wraps[name].append(max(x["wrap_s"] for x in per_rank))
    return samples, wraps


def _first_calls(n, model_fn, cfg, log):
    """The first DeepSpeed call on fresh groups, and torch's for comparison (caller's seconds)."""
    import nbdist

    out = {"deepspeed_first": [], "torch_first": [], "deepspeed_after_torch": [],
           "deepspeed_warm": []}
    for _ in range(cfg["fresh"]):
        for plan in (["deepspeed_first"],
                     ["torch_first", "deepspeed_after_torch", "deepspeed_warm"]):
            with nbdist.start(n, backend="gloo", device="cpu", timeout=180) as group:
                for key in plan:
                    name = "zero1" if key == "torch_first" else "deepspeed_zero1"
                    t0 = time.perf_counter()
                    group.run(_train, name, model_fn, 1, BATCH)
                    out[key].append(time.perf_counter() - t0)
        log(f"  N={n} first calls: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in out.items()))
    return out


def run(cfg, sizes, model_spec, log):
    import nbdist
    from nbdist import memory

    model_fn = memory.model_spec(model_spec)
    names = [n for stage in STAGES.values() for n in stage]
    if not harness.have("fairscale", "the fairscale strategies"):
        names = [n for n in names if not n.startswith("fairscale")]
    res = {}
    for n in sizes:
        log(f"N={n}: step times ...")
        with nbdist.start(n, backend="gloo", device="cpu", timeout=180) as group:
            samples, wraps = _step_times(group, names, model_fn, cfg)
        firsts = _first_calls(n, model_fn, cfg, log)
        res[str(n)] = {"step_s": {k: harness.summary(v) for k, v in samples.items()},
                       "wrap_s": {k: harness.summary(v) for k, v in wraps.items()},
                       "first_call_s": {k: harness.summary(v) for k, v in firsts.items()},
                       "raw": {"step_s": samples, "wrap_s": wraps, "first_call_s": firsts}}
    return res


def ratios(res):
    """DeepSpeed's median step time over torch's and fairscale's at the same stage."""
    out = {}
    for n, r in res.items():
        steps = r["step_s"]
        for names in STAGES.values():
            ds = names[-1]
            for other in names[:-1]:
                value = harness.ratio(steps.get(ds), steps.get(other))
                if value is not None:
                    out[f"N={n} {ds} / {other}"] = value
    return out


def print_table(res, model_spec):
    print(f"\n=== step time, model {model_spec}, fp32 Adam, {BATCH} samples per rank, gloo: "
          "median [p10-p90] (n steps) ===")
    for n, r in res.items():
        print(f"\nN = {n}")
        for stage, names in STAGES.items():
            for name in names:
                if name in r["step_s"]:
                    print(f"  ZeRO-{stage} {name:18s} {harness.fmt_summary(r['step_s'][name]):34s}"
                          f" wrap {harness.fmt(r['wrap_s'][name].get('median'))}")
        print("  first call on a fresh group (g.run of wrap + one step, seen by the caller):")
        for key, s in r["first_call_s"].items():
            print(f"    {key:22s} {harness.fmt(s.get('median')):>8s}  (n={s.get('n', 0)})")
    print("\n-- ratios of the medians")
    for key, value in ratios(res).items():
        print(f"  {key:40s} {value:.2f}")


def main(argv=None) -> int:
    ap = harness.arg_parser(__doc__, "bench_deepspeed_results.json", sizes=True,
                            quick="2 rounds of 10 steps, one fresh group of each kind "
                                  "(~2.5 min on 2 vCPUs; the full run ~10 min)")
    ap.add_argument("--model", default="mlp:4x256", help="mlp:LAYERSxWIDTH (default: the "
                    "tutorial's model)")
    args = ap.parse_args(argv)
    if not harness.have("deepspeed", "this benchmark"):
        return 1
    cfg = QUICK if args.quick else FULL
    sizes = [int(x) for x in args.sizes.split(",")]
    os.environ.update({k: v for k, v in harness.loopback_env().items()
                       if k == "GLOO_SOCKET_IFNAME"})
    meta = harness.machine_info(config=cfg, model=args.model, sizes=sizes, quick=args.quick,
                                versions=harness.versions(), load_start=os.getloadavg(),
                                nbdist_source=harness.nbdist_source_info())
    for name in ("deepspeed", "fairscale"):
        try:
            meta["versions"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            meta["versions"][name] = None
    t0 = time.perf_counter()
    res = {"meta": meta}
    try:
        res["deepspeed"] = run(cfg, sizes, args.model, harness.log)
    finally:
        meta["leftover_processes"] = harness.final_sweep([])
        meta["load_end"] = os.getloadavg()
        meta["wall_s"] = time.perf_counter() - t0
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    res["ratios"] = ratios(res["deepspeed"])
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print_table(res["deepspeed"], args.model)
    print(f"\nload average {meta['load_start'][0]:.2f} at the start, {meta['load_end'][0]:.2f} at "
          f"the end; wall time {meta['wall_s']:.0f} s; raw numbers in {args.out}")
    if meta["leftover_processes"]:
        print(f"!! leftover processes killed at the end: {meta['leftover_processes']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
