#!/usr/bin/env python
"""From a fresh Python process to a first result on every rank: nbdist against Monarch.

    python benchmarks/bench_first_result.py [--quick] [--sizes 2,4] [--out results.json]

Each sample is a new interpreter (a subprocess, so every cache is cold) that starts N ranks with
torch.distributed initialised (gloo, CPU) and gets a trivial function's result back from every
rank; the time runs from just before the subprocess starts to the moment its result line reaches
this script (interpreter start-up included). Variants, interleaved round by round so that machine
noise hits all of them alike:

* ``nbdist``: ``import nbdist; nbdist.start(N).run(fn)``; the kernel never imports torch;
* ``nbdist, torch first``: the same after ``import torch`` in the kernel (a notebook that
  imported torch already; also what every start cost before the kernel stopped importing it);
* ``monarch``: Monarch 0.7 (``torchmonarch``), ``this_host().spawn_procs(per_host={"gpus": N})``,
  ``setup_torch_elastic_env``, an actor whose endpoint runs ``init_process_group("gloo")`` and
  returns the rank. Monarch is installed with pip into its own folder (``--monarch-site``; no
  torch of its own: it uses this interpreter's) unless it is there already; where that fails its
  rows say why.

Medians and the ratio monarch / nbdist (above 1: nbdist first) are printed and saved as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

NBDIST = r"""
import sys
TORCH_FIRST
import nbdist
def rank():
    import torch.distributed as dist
    return dist.get_rank()
g = nbdist.start(N)
out = g.run(rank)
print("RESULT", out, "torch" in sys.modules, flush=True)
g.stop()
"""

MONARCH = r"""
from monarch.actor import Actor, endpoint, this_host
from monarch.spmd import setup_torch_elastic_env

class Rank(Actor):
    @endpoint
    def init(self):
        import torch.distributed as dist
        dist.init_process_group("gloo")
        return dist.get_rank()

procs = this_host().spawn_procs(per_host={"gpus": N})
setup_torch_elastic_env(procs)
out = sorted(v for _, v in procs.spawn("ranks", Rank).init.call().get().items())
print("RESULT", out, flush=True)
procs.stop().get()
"""


def monarch_site(folder: str) -> str:
    """A folder holding torchmonarch (installed there with pip if missing); '' if it fails."""
    if os.path.isdir(os.path.join(folder, "monarch")):
        return folder
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--target", folder, "torchmonarch==0.7.0"]
    print("installing Monarch:", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        print("Monarch could not be installed:", done.stderr.strip().splitlines()[-1:], flush=True)
        return ""
    return folder


def sample(source: str, n: int, env: dict, timeout: float = 120.0) -> float:
    """Seconds from starting a fresh interpreter on ``source`` to its RESULT line."""
    code = source.replace("N)", f"{n})").replace("{\"gpus\": N}", f"{{\"gpus\": {n}}}")
    with tempfile.TemporaryDirectory(prefix="bench-first-") as tmp:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env, cwd=tmp,
                                start_new_session=True)
        took = None
        try:
            for line in proc.stdout:
                if line.startswith("RESULT"):
                    took = time.perf_counter() - t0
                    assert str(list(range(n))) in line, line
            proc.wait(timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        if took is None or proc.returncode != 0:
            raise RuntimeError(f"no result (exit code {proc.returncode})")
        return took


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 8")
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--out", default="bench_first_result_results.json")
    parser.add_argument("--monarch-site", default=os.path.join(tempfile.gettempdir(),
                                                                "nbdist-bench-monarch"))
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else 8
    env = dict(os.environ)
    variants = {"nbdist": (NBDIST.replace("TORCH_FIRST", ""), env),
                "nbdist, torch first": (NBDIST.replace("TORCH_FIRST", "import torch"), env)}
    site = monarch_site(args.monarch_site)
    if site:
        variants["monarch"] = (MONARCH, dict(env, PYTHONPATH=os.pathsep.join(
            p for p in (site, env.get("PYTHONPATH", "")) if p)))
    sizes = [int(s) for s in args.sizes.split(",")]
    raw = {f"{name} N={n}": [] for n in sizes for name in variants}
    for r in range(rounds):
        for n in sizes:
            for name, (source, venv) in variants.items():
                try:
                    raw[f"{name} N={n}"].append(sample(source, n, venv))
                except (RuntimeError, subprocess.TimeoutExpired) as err:
                    print(f"{name} N={n}: {err}", flush=True)
        print(f"round {r + 1}/{rounds} done", flush=True)
    med = {k: statistics.median(v) for k, v in raw.items() if v}
    print(f"\nfresh process -> first result on every rank (median of {rounds}; "
          f"load average {os.getloadavg()[0]:.1f})")
    for k, v in med.items():
        print(f"  {k:28s} {v * 1000:8.0f} ms")
    for n in sizes:
        ours = med.get(f"nbdist N={n}")
        theirs = med.get(f"monarch N={n}")
        if ours and theirs:
            print(f"  N={n}: Monarch / nbdist = {theirs / ours:.2f} (above 1: nbdist first)")
        first = med.get(f"nbdist, torch first N={n}")
        if ours and first:
            print(f"  N={n}: torch imported first / not = {first / ours:.2f}")
    with open(args.out, "w") as f:
        json.dump({"raw": raw, "median": med, "rounds": rounds}, f, indent=1)
    return med


if __name__ == "__main__":
    main()
