#!/usr/bin/env python
"""SLURM groups (``nbdist.start(on="slurm")``): sbatch to first result, a call against a local
group, stop to an empty queue, the reattach time.

    python benchmarks/bench_slurm.py [--quick] [--out bench_slurm_results.json]

Needs SLURM's commands and a cluster (``SLURM_CONF``); without one it starts the test cluster of
``../shared/slurm/local-slurm.sh`` (two nodes on this machine, root) and stops it at the end.

1. sbatch to first result: from the ``nbdist.start(2, on="slurm", nodes=2)`` call to the first
   ``g.run`` result (submission, scheduling, two workers importing torch, the rendezvous), over
   ``reps`` jobs;
2. a trivial call, ``g.run(noop)``, on the SLURM group and on a local ``nbdist.start(2)`` group alive
   at the same time, in interleaved blocks; the ratio of the medians (goal: at most 1.5x);
3. ``g.stop()`` to ``squeue`` empty;
4. the reattach time: a subprocess (the first kernel) starts a group with ``keep_alive``, leaves a
   variable on its ranks and is SIGKILLed; then, in this process (the next kernel), from the
   ``nbdist.reattach()`` call to the first result (the variable read back), over ``reps`` jobs
   (goal: within 5 s). The handles go to a temporary Jupyter runtime directory.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

#: the first kernel of the reattach measure: a keep_alive group, a variable, then SIGKILLed
KERNEL = (
    "import os, sys\nimport nbdist\n"
    "g = nbdist.start(2, on='slurm', nodes=2, keep_alive='10m', timeout=60, progress=False, "
    "workdir=sys.argv[1])\n"
    "g.exec('kept = rank + 41')\nos.kill(os.getpid(), 9)\n")
FULL = dict(reps=3, rounds=8, block=200)
QUICK = dict(reps=2, rounds=4, block=60)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _queue():
    return subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True,
                          timeout=30).stdout.split()


def _cluster(tmp):
    """``None`` if a cluster answers already, else the directory of the one started here."""
    if os.environ.get("SLURM_CONF") and subprocess.run(["sinfo"], capture_output=True).returncode == 0:
        return None
    for up in (os.path.dirname(ROOT), os.path.dirname(os.path.dirname(ROOT))):
        script = os.path.join(up, "shared", "slurm", "local-slurm.sh")
        if os.path.isfile(script):
            directory = os.path.join(tmp, "slurm")
            subprocess.run(["bash", script, "start", directory, "2", "2"], check=True,
                           capture_output=True, timeout=300)
            os.environ["SLURM_CONF"] = os.path.join(directory, "slurm.conf")
            return script, directory
    sys.exit("no SLURM here (SLURM_CONF unset) and no ../shared/slurm/local-slurm.sh to start one")


def run(cfg, tmp):
    import nbdist

    out = {"first_result_s": [], "stop_to_empty_s": []}
    for i in range(cfg["reps"]):
        t0 = time.perf_counter()
        g = nbdist.start(2, on="slurm", nodes=2, timeout=60, progress=False, workdir=tmp)
        g.run(harness.noop)
        out["first_result_s"].append(time.perf_counter() - t0)
        harness.log(f"sbatch to first result: {out['first_result_s'][-1]:.2f} s")
        if i < cfg["reps"] - 1:
            t0 = time.perf_counter()
            g.stop()
            while _queue():
                time.sleep(0.05)
            out["stop_to_empty_s"].append(time.perf_counter() - t0)
    local = nbdist.start(2)
    calls = {"slurm": [], "local": []}
    for r in range(cfg["rounds"]):
        order = [("slurm", g), ("local", local)][:: 1 if r % 2 == 0 else -1]
        for name, group in order:
            harness.timed_block(lambda: group.run(harness.noop), cfg["block"], calls[name])
    local.stop()
    t0 = time.perf_counter()
    g.stop()
    while _queue():
        time.sleep(0.05)
    out["stop_to_empty_s"].append(time.perf_counter() - t0)
    out["reattach"] = harness.summary(reattach_times(cfg, tmp))
    out["call"] = {k: harness.summary(v) for k, v in calls.items()}
    out["call_ratio"] = harness.ratio(out["call"]["slurm"], out["call"]["local"])
    out["first_result"] = harness.summary(out.pop("first_result_s"))
    out["stop_to_empty"] = harness.summary(out.pop("stop_to_empty_s"))
    return out


def reattach_times(cfg, tmp):
    """Seconds from ``nbdist.reattach()`` to the first result, once per first kernel SIGKILLed."""
    import nbdist

    os.environ["JUPYTER_RUNTIME_DIR"] = os.path.join(tmp, "runtime")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    times = []
    for _ in range(cfg["reps"]):
        done = subprocess.run([sys.executable, "-c", KERNEL, tmp], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == -9, done.stderr[-2000:]
        t0 = time.perf_counter()
        g = nbdist.reattach(progress=False)
        assert g.exec("kept") == [41, 42]
        times.append(time.perf_counter() - t0)
        harness.log(f"reattach to first result: {times[-1]:.2f} s")
        g.stop()
        while _queue():
            time.sleep(0.05)
    return times


def main(argv=None):
    args = harness.arg_parser(__doc__, "bench_slurm_results.json").parse_args(argv)
    cfg = QUICK if args.quick else FULL
    tmp = tempfile.mkdtemp(prefix="nbdist-bench-slurm-")
    try:
        started = _cluster(tmp)
        try:
            res = run(cfg, tmp)
        finally:
            if started:
                subprocess.run(["bash", started[0], "stop", started[1]], capture_output=True)
    finally:  # the stopped slurmctld may still write its state as the folder goes
        shutil.rmtree(tmp, ignore_errors=True)
    res["machine"] = harness.machine_info(config=cfg)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"sbatch to first result: {harness.fmt(res['first_result']['median'])} (median of "
          f"{res['first_result']['n']})")
    print(f"trivial call: slurm {harness.fmt_summary(res['call']['slurm'])}, local "
          f"{harness.fmt_summary(res['call']['local'])}, ratio {res['call_ratio']:.2f}x "
          "(goal <= 1.5x)")
    print(f"stop to empty queue: {harness.fmt(res['stop_to_empty']['median'])}")
    print(f"reattach to first result: {harness.fmt(res['reattach']['median'])} (median of "
          f"{res['reattach']['n']}; goal <= 5 s)")


if __name__ == "__main__":
    main()
