"""Time from a stop, a rank death or a dead kernel to every torchrun agent gone (issue 20).

Run: python benchmarks/bench_attach_teardown.py [--reps 3] [--out teardown.json]

Two torchrun "nodes" of two ranks each (static rendezvous, this machine) attached to one group, as
in tests/integration/attach_helpers.py. Per repetition, one fresh cluster per scenario:

* stop -> agents gone: ``g.stop()`` on a healthy group until both agents exited (0, 0 expected);
* death -> agents gone: rank 3 calls ``os._exit(3)`` while ranks 0-2 enter an all_reduce; from the
  moment ``RankDiedError`` reaches the caller until both agents exited (nbdist tells the other
  ranks to exit by itself; no ``stop()`` involved);
* kernel killed -> agents gone: the controller runs in its own process with the ranks inside a call
  (rank 0 in an all_reduce, the others sleeping); SIGKILL it, time until both agents exited;
* death -> generation 2 (``--max-restarts=1``): from ``RankDiedError`` reaching the caller until the
  next call (an all_reduce on every rank) returned on the ranks torchrun restarted.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "integration"))

import nbdist  # noqa: E402
from attach_helpers import (Cluster, controller, free_port, kill_tree, torchrun,  # noqa: E402
                            wait_all, wait_attached)


def stop_case(tmp):
    c = Cluster(tmp, nnodes=2, nproc=2)
    try:
        t0 = time.monotonic()
        c.group.stop()
        took = wait_all(c.nodes, 60)
        return took if took is None else time.monotonic() - t0, [p.returncode for p in c.nodes]
    finally:
        c.close(wait=5)


def _kill_rank3_in_all_reduce(group):
    """Rank 3 exits while the others enter an all_reduce; the RankDiedError is expected."""
    try:
        group.exec("import os\nif rank == 3:\n    os._exit(3)\nt = torch.ones(10)\n"
                   "dist.all_reduce(t)")
    except nbdist.RankDiedError:
        pass


def death_case(tmp):
    c = Cluster(tmp, nnodes=2, nproc=2)
    try:
        _kill_rank3_in_all_reduce(c.group)
        t0 = time.monotonic()
        took = wait_all(c.nodes, 60)
        return took if took is None else time.monotonic() - t0, [p.returncode for p in c.nodes]
    finally:
        c.close(wait=5)


def kernel_case(tmp):
    ctl, port, key_file = controller(tmp, 4, "import time\nt = torch.ones(1)\nif rank == 0:\n"
                                             "    dist.all_reduce(t)\nelse:\n    time.sleep(600)")
    rdzv = free_port()
    nodes = [torchrun(n, rdzv, port, key_file, nproc=2, nnodes=2) for n in range(2)]
    try:
        wait_attached(ctl)
        time.sleep(1.0)
        t0 = time.monotonic()
        ctl.kill()
        took = wait_all(nodes, 60)
        return took if took is None else time.monotonic() - t0, [p.returncode for p in nodes]
    finally:
        for p in nodes + [ctl]:
            kill_tree(p)


def regen_case(tmp):
    c = Cluster(tmp, nnodes=2, nproc=2, max_restarts=1)
    try:
        _kill_rank3_in_all_reduce(c.group)
        t0 = time.monotonic()
        c.group.exec("t = torch.ones(10); dist.all_reduce(t)")
        took = time.monotonic() - t0
        assert "generation 2" in repr(c.group)
        return took, c.close(wait=30)
    finally:
        c.close(wait=5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results = {}
    for name, case in (("stop -> agents gone", stop_case), ("death -> agents gone", death_case),
                       ("kernel killed -> agents gone", kernel_case),
                       ("death -> generation 2 usable", regen_case)):
        samples = []
        for i in range(args.reps):
            took, codes = case(pathlib.Path(tempfile.mkdtemp(prefix="nbdist-bench-")))
            samples.append({"seconds": took, "agent_exit_codes": codes})
            print(f"{name} #{i}: {took if took is None else round(took, 2)} s, agents {codes}",
                  flush=True)
        secs = [s["seconds"] for s in samples if s["seconds"] is not None]
        results[name] = {"samples": samples,
                         "median_s": statistics.median(secs) if secs else None,
                         "max_s": max(secs) if secs else None}
        print(f"{name}: median {results[name]['median_s']:.2f} s, "
              f"max {results[name]['max_s']:.2f} s ({len(secs)}/{args.reps} ended)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"results": results, "cpus": os.cpu_count()}, f, indent=1)


if __name__ == "__main__":
    main()
