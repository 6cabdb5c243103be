#!/usr/bin/env python
"""What a rank's output path costs (issue 26): fds 1 and 2 as the sockets themselves (``socket``,
POSIX's default) against pipes forwarded by a thread (``pipe``, Windows' only way,
``NBDIST_STREAMS=pipe`` here) and pipes with sealed frames (``protect=True``), in the same run.

    python benchmarks/bench_streams.py [--quick] [--out results.json]

One local group of world size 2 (gloo on CPU) per path lives side by side; rounds alternate between
them (the first one rotates) so machine noise hits all alike:

* ``run(lambda: None)``: a call's round trip, whose end drains the streams (median of many);
* ``run(print one line)``: the same with a line of output to send before the reply;
* output latency: a background job on rank 0 prints a line stamped with ``time.monotonic()``
  (one clock for every process of a Linux machine) every 20 ms; the user's ``output=`` sink
  stamps its arrival (lines shown as written: ``dedupe_output=False``);
* ``pull`` of a 100 MiB float32 tensor already on rank 0.

Everything started is stopped at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

PATHS = {"socket": {}, "pipe": {"env": {"NBDIST_STREAMS": "pipe"}}, "protect": {"protect": True}}
MIB = 1 << 20


class Stamps:
    """An ``output=`` sink that keeps, per path, how long each stamped line took to arrive."""

    def __init__(self):
        self.delays = {name: [] for name in PATHS}
        self.lock = threading.Lock()

    def sink_for(self, name):
        def sink(rank, stream, text):
            now = time.monotonic()
            for line in text.splitlines():
                if line.startswith("STAMP "):
                    with self.lock:
                        self.delays[name].append(now - float(line.split()[1]))
        return sink


def timed(fn, count):
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def say_line():
    print("a line of output from the rank")


def main(argv=None):
    import nbdist

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rounds, block, pulls, stamps = (4, 50, 3, 100) if args.quick else (10, 100, 7, 300)
    res = {"load_before": os.getloadavg(), "cores": os.cpu_count(), "rounds": rounds,
           "block": block, "pull_rounds": pulls,
           "run": {n: [] for n in PATHS}, "run_print": {n: [] for n in PATHS},
           "pull": {n: [] for n in PATHS}}
    sinks = Stamps()
    groups = {}
    try:
        for name, kwargs in PATHS.items():
            groups[name] = nbdist.start(2, backend="gloo", device="cpu", dedupe_output=False,
                                        output=sinks.sink_for(name), **kwargs)
            groups[name].exec("big = torch.ones(100 * 1024 * 1024 // 4) if rank == 0 else None")
            groups[name].pull("big", ranks=[0])  # warm
            groups[name].run(lambda: None)
        order = list(PATHS)
        for _ in range(rounds):
            for name in order:
                res["run"][name] += timed(lambda: groups[name].run(lambda: None), block)
                res["run_print"][name] += timed(lambda: groups[name].run(say_line), block)
            order = order[1:] + order[:1]
        for _ in range(pulls):
            for name in order:
                res["pull"][name] += timed(lambda: groups[name].pull("big", ranks=[0]), 1)
            order = order[1:] + order[:1]
        stamper = (f"import time\nfor _ in range({stamps}):\n"
                   "    print('STAMP', repr(time.monotonic()), flush=True)\n    time.sleep(0.02)")
        for name in order:  # one at a time: the others idle meanwhile
            groups[name].submit_exec(stamper, ranks=[0]).result(timeout=120)
            groups[name].run(lambda: None)
        res["latency"] = sinks.delays
        res["load_after"] = os.getloadavg()
    finally:
        for g in groups.values():
            g.stop()
    med = {k: {n: statistics.median(res[k][n]) for n in PATHS} for k in ("run", "run_print",
                                                                          "pull", "latency")}
    p90 = {n: sorted(res["latency"][n])[int(0.9 * len(res["latency"][n]))] for n in PATHS}
    print(f"load average before {res['load_before'][0]:.2f}, after {res['load_after'][0]:.2f} "
          f"(1 min); {res['cores']} cores")
    print(f"{'median':34s}" + "".join(f"{n:>12s}" for n in PATHS) + f"{'pipe/socket':>13s}")
    rows = (("run(lambda: None) (of %d)" % (rounds * block), "run", 1e3, "ms"),
            ("run(print a line) (of %d)" % (rounds * block), "run_print", 1e3, "ms"),
            ("output latency (of %d)" % stamps, "latency", 1e3, "ms"),
            ("pull 100 MiB (of %d)" % pulls, "pull", 1.0, "s"))
    for label, key, scale, unit in rows:
        print(f"{label:34s}" + "".join(f"{med[key][n] * scale:10.3f}{unit:>2s}" for n in PATHS)
              + f"{med[key]['pipe'] / med[key]['socket']:13.2f}")
    print("output latency p90: " + ", ".join(f"{n} {p90[n] * 1e3:.3f} ms" for n in PATHS))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
