#!/usr/bin/env python
"""nbdist core benchmarks, side by side with the alternatives, in one run.

    python benchmarks/bench_core.py [--quick] [--out results.json] [--sections startup,dispatch,tensor]
        [--sizes 2,4]

What it measures (world sizes 2 and 4, gloo on CPU), each alternative interleaved round by round
with nbdist so that machine noise hits all of them alike; each section is a script of its own that
also runs alone, over the shared ``harness.py`` (statistics, child processes with deadlines, the
final sweep, JSON and table):

1. startup (``bench_startup.py``) -- time to a ready group (torch.distributed initialised, a trivial
   function returned on every rank): nbdist's first start in a fresh process, later starts and
   ``Group.restart()``, against ``torch.multiprocessing`` spawn and ``accelerate.notebook_launcher``
   (launches bounded by a timeout; hangs counted and killed).
2. dispatch (``bench_dispatch.py``) -- per-call latency of ``g.run(lambda: None)`` and
   ``g.exec("1")`` on a warm group, against ipyparallel ``DirectView.apply_sync(lambda: 1)`` on a
   running cluster of the same size, and against the lower bound: a pool of forked workers fed
   through ``multiprocessing.Pipe`` with cloudpickle.
3. tensor (``bench_tensor.py``) -- a 100 MiB float32 CPU tensor that already lives on rank 0,
   returned to the caller: nbdist ``g.exec("big", ranks=[0])`` and ``g.pull("big", ranks=[0])``,
   against a ``torch.multiprocessing`` queue (tensor private to the producer, and already in shared
   memory) and against pickling through ``multiprocessing.Queue`` (a numpy array: bytes through the
   pipe); next to single-core memcpy of 256 MiB measured in the same rounds.

A missing comparison package (accelerate, ipyparallel) is reported and its alternative skipped.
Raw samples (seconds) and summaries go to the JSON file; a compact table is printed at the end.
Everything the script starts is stopped at the end (a final sweep kills and reports leftovers).
"""
from __future__ import annotations

import sys

import bench_dispatch
import bench_startup
import bench_tensor
import harness

TOPICS = [bench_startup, bench_dispatch, bench_tensor]  # run in this order


def main(argv=None):
    ap = harness.arg_parser(__doc__, "bench_core_results.json", [m.NAME for m in TOPICS],
                            sizes=True)
    return harness.main(TOPICS, ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
