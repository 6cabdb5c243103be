#!/usr/bin/env python
"""Ray groups (``nbdist.start(on="ray")``) against Ray Train's ``TorchTrainer``, on one cluster.

    python benchmarks/bench_ray.py [--quick] [--out bench_ray_results.json]

Starts a ``ray.cluster_utils.Cluster`` on this machine (a head and a second node, 2 CPUs each,
small object stores) and measures, side by side:

1. start to first result: ``nbdist.start(2, on="ray", num_cpus=0.5)`` called -> the first training
   step's loss (DDP on a small MLP, gloo), against ``TorchTrainer(...).fit()`` of the same step
   (2 workers, 0.5 CPU each) called -> its result (goal: nbdist >= 10x sooner); and, as the floor
   any launcher pays on this machine, the same on a local ``nbdist.start(2)`` (no Ray at all: the
   ranks' own start, torch, gloo and DDP's first wrap);
2. re-running the training cell: ``g.run(step)`` on the persistent ranks, against a second
   ``fit()`` (Ray Train rebuilds its workers for every fit) (goal: >= 1000x);
3. a trivial call, ``g.run(noop)``, on the Ray group and on a local ``nbdist.start(2)`` group alive
   at the same time, in interleaved blocks (ratio of the medians);
4. memory per rank after the step: the rank's worker (and its actor, which nbdist adds), against a
   Ray Train worker (its RSS reported from inside the training function).

Needs ``ray[default,train]`` (the dev extra has it).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

FULL = dict(reps=3, steps=20, rounds=8, block=200)
QUICK = dict(reps=1, steps=8, rounds=4, block=60)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: see tests/integration/ray_quick_imports: jsonschema's IRI parser built lazily in Ray's processes
QUICK_IMPORTS = os.path.join(ROOT, "tests", "integration", "ray_quick_imports")
CPU = 0.5  #: CPUs per rank / per Ray Train worker


def make_net():
    """The model of the training cell: a small MLP (the same seed on every rank)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))


def one_step(model, opt):
    import torch

    x = torch.randn(32, 64)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def train_loop(config):
    """Ray Train's side: the same setup and step, the worker's RSS reported."""
    import ray.train
    import ray.train.torch
    import torch

    model = ray.train.torch.prepare_model(make_net())  # DDP
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    one_step(model, opt)
    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(config["dir"], f"rss-{rank}"), "w") as f:  # this machine's cluster
        f.write(str(rss()))


def nbdist_step():
    import __main__

    if not hasattr(__main__, "_bench_model"):  # the setup cell, once per group
        import torch

        model = torch.nn.parallel.DistributedDataParallel(make_net())
        __main__._bench_model = model, torch.optim.SGD(model.parameters(), lr=0.01)
    return one_step(*__main__._bench_model)


def fit_once(tmp):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    scaling = ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": CPU})
    trainer = TorchTrainer(train_loop, train_loop_config={"dir": tmp}, scaling_config=scaling,
                           run_config=RunConfig(storage_path=tmp, name=f"fit-{time.time_ns()}"))
    trainer.fit()
    return [int(open(os.path.join(tmp, f"rss-{r}")).read()) for r in range(2)]


def run(cfg, tmp):
    import psutil

    import nbdist

    out = {"nbdist_first_s": [], "train_first_s": [], "train_rerun_s": [], "local_first_s": [],
           "nbdist_start_s": [], "local_start_s": []}
    for i in range(cfg["reps"]):  # the floor: no Ray at all, the same two ranks and step
        t0 = time.perf_counter()
        with nbdist.start(2) as local:
            out["local_start_s"].append(time.perf_counter() - t0)
            local.run(nbdist_step)
            out["local_first_s"].append(time.perf_counter() - t0)
        harness.log(f"local group: start to first step {out['local_first_s'][-1]:.2f} s")
    g = None
    for i in range(cfg["reps"]):
        t0 = time.perf_counter()
        g = nbdist.start(2, on="ray", num_cpus=CPU, timeout=60, progress=False)
        out["nbdist_start_s"].append(time.perf_counter() - t0)
        g.run(nbdist_step)
        out["nbdist_first_s"].append(time.perf_counter() - t0)
        harness.log(f"nbdist: start to first step {out['nbdist_first_s'][-1]:.2f} s")
        if i < cfg["reps"] - 1:
            g.stop()
    steps = []
    harness.timed_block(lambda: g.run(nbdist_step), cfg["steps"], steps)
    out["nbdist_rerun"] = harness.summary(steps)
    ranks = g.run(rss)
    actor_pids = [p["pid"] for p in sorted(g._launcher.places, key=lambda p: p["rank"])]
    actors = [psutil.Process(pid).memory_info().rss for pid in actor_pids]
    out["memory"] = {"nbdist_worker": ranks, "nbdist_actor": actors}
    local = nbdist.start(2)
    calls = {"ray": [], "local": []}
    for r in range(cfg["rounds"]):
        order = [("ray", g), ("local", local)][:: 1 if r % 2 == 0 else -1]
        for name, group in order:
            harness.timed_block(lambda: group.run(harness.noop), cfg["block"], calls[name])
    local.stop()
    g.stop()
    out["call"] = {k: harness.summary(v) for k, v in calls.items()}
    out["call_ratio"] = harness.ratio(out["call"]["ray"], out["call"]["local"])
    train_rss = []
    for i in range(cfg["reps"] + 1):  # the first fit is the start, the others re-runs
        t0 = time.perf_counter()
        sizes = fit_once(tmp)
        took = time.perf_counter() - t0
        (out["train_first_s"] if i == 0 else out["train_rerun_s"]).append(took)
        train_rss.append(sizes)
        harness.log(f"Ray Train fit {i}: {took:.2f} s")
    out["memory"]["ray_train_worker"] = train_rss
    for k in ("nbdist_first_s", "train_first_s", "train_rerun_s", "local_first_s",
              "nbdist_start_s", "local_start_s"):
        out[k[:-2]] = harness.summary(out.pop(k))
    out["first_ratio"] = harness.ratio(out["train_first"], out["nbdist_first"])
    out["floor_ratio"] = harness.ratio(out["train_first"], out["local_first"])
    out["rerun_ratio"] = harness.ratio(out["train_rerun"], out["nbdist_rerun"])
    return out


def main(argv=None):
    args = harness.arg_parser(__doc__, "bench_ray_results.json").parse_args(argv)
    cfg = QUICK if args.quick else FULL
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (QUICK_IMPORTS, ROOT, os.environ.get("PYTHONPATH", "")) if p)
    import ray
    from ray.cluster_utils import Cluster

    store = 80 * 1024 ** 2
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2,
                                                             "object_store_memory": store})
    cluster.add_node(num_cpus=2, object_store_memory=store)
    try:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        with tempfile.TemporaryDirectory(prefix="nbdist-bench-ray-") as tmp:
            res = run(cfg, tmp)
    finally:
        ray.shutdown()
        cluster.shutdown()
    res["machine"] = harness.machine_info(config=cfg)
    res["ray"] = ray.__version__
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    mib = 2 ** 20
    print(f"start to first step: nbdist {harness.fmt(res['nbdist_first']['median'])}, Ray "
          f"Train fit {harness.fmt(res['train_first']['median'])}: {res['first_ratio']:.1f}x "
          "(goal >= 10x)")
    print(f"  of which nbdist.start(on='ray') {harness.fmt(res['nbdist_start']['median'])}; the "
          f"same on a local group (no Ray): start {harness.fmt(res['local_start']['median'])}, "
          f"first step {harness.fmt(res['local_first']['median'])}, {res['floor_ratio']:.1f}x Ray "
          "Train's: nbdist's ratio with no Ray overhead at all")
    print(f"re-run the training cell: nbdist {harness.fmt_summary(res['nbdist_rerun'])}, Ray Train "
          f"fit {harness.fmt(res['train_rerun']['median'])}: {res['rerun_ratio']:.0f}x "
          "(goal >= 1000x)")
    print(f"trivial call: ray {harness.fmt_summary(res['call']['ray'])}, local "
          f"{harness.fmt_summary(res['call']['local'])}, ratio {res['call_ratio']:.2f}x")
    m = res["memory"]
    print(f"RSS per rank: nbdist worker {[round(x / mib) for x in m['nbdist_worker']]} MiB "
          f"+ its actor {[round(x / mib) for x in m['nbdist_actor']]} MiB; Ray Train worker "
          f"{[[round(x / mib) for x in fit] for fit in m['ray_train_worker']]} MiB (each fit)")


if __name__ == "__main__":
    main()
