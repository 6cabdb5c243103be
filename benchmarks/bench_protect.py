#!/usr/bin/env python
"""What signing every message costs (issue 20): an attached group over loopback, unprotected
(``protect=False``) against protected (``protect=True``), in the same run.

    python benchmarks/bench_protect.py [--quick] [--out results.json]

Two attached groups of world size 2 (plain ``python -m nbdist.worker`` ranks, gloo on CPU) live side
by side; rounds alternate between them (the first one rotates) so machine noise hits both alike:
``g.pull("big", ranks=[0])`` of a 100 MiB float32 tensor already on rank 0 (median of a few), and a
trivial ``g.run(lambda: None)`` (median of many). Also HMAC-SHA256 over 100 MiB on one core, the
floor of what protection adds to a pull. Everything started is stopped at the end.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

MIB = 1 << 20


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_group(protect, tmp, procs):
    """An attached group of 2 ranks on loopback; its worker processes are appended to ``procs``."""
    import nbdist

    port, key_file = _free_port(), os.path.join(tmp, f"key-{protect}.hex")
    box = {}

    def attach():
        try:
            box["g"] = nbdist.attach(2, listen=f"127.0.0.1:{port}", key_file=key_file,
                                     join_timeout=120, progress=False, timeout=120,
                                     protect=protect, backend="gloo", device="cpu")
        except BaseException as err:  # noqa: BLE001 -- re-raised below
            box["err"] = err

    t = threading.Thread(target=attach)
    t.start()
    while not os.path.exists(key_file) and t.is_alive():
        time.sleep(0.05)
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "nbdist.worker", "--connect", f"127.0.0.1:{port}",
             "--key-file", key_file], env=env, stdout=subprocess.DEVNULL,
            start_new_session=True))
    t.join(180)
    if "err" in box:
        raise box["err"]
    return box["g"]


def hmac_floor(rounds):
    data = os.urandom(100 * MIB)
    key = os.urandom(32)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        hmac.new(key, data, hashlib.sha256).digest()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    pull_rounds, run_rounds = (3, 50) if args.quick else (7, 300)
    res = {"load_before": os.getloadavg(), "pull_rounds": pull_rounds, "run_rounds": run_rounds,
           "pull_s": {False: [], True: []}, "run_s": {False: [], True: []}}
    procs, groups = [], {}
    tmp = tempfile.mkdtemp(prefix="nbdist-bench-protect-")
    try:
        for protect in (False, True):
            groups[protect] = start_group(protect, tmp, procs)
            groups[protect].exec("big = torch.ones(100 * 1024 * 1024 // 4) if rank == 0 else None")
            groups[protect].pull("big", ranks=[0])  # warm
        order = [False, True]
        for i in range(pull_rounds):
            for protect in order:
                t0 = time.perf_counter()
                groups[protect].pull("big", ranks=[0])
                res["pull_s"][protect].append(time.perf_counter() - t0)
            order.reverse()
        for i in range(run_rounds):
            for protect in order:
                t0 = time.perf_counter()
                groups[protect].run(lambda: None)
                res["run_s"][protect].append(time.perf_counter() - t0)
            order.reverse()
        res["hmac_100mib_s"] = hmac_floor(pull_rounds)
        res["load_after"] = os.getloadavg()
    finally:
        for g in groups.values():
            try:
                g.stop()
            except Exception:  # noqa: BLE001 -- stop the others regardless
                pass
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: {p: statistics.median(v[p]) for p in (False, True)} for k, v in
           (("pull", res["pull_s"]), ("run", res["run_s"]))}
    spread = {k: {p: (min(v[p]), max(v[p])) for p in (False, True)} for k, v in
              (("pull", res["pull_s"]), ("run", res["run_s"]))}
    print(f"load average before {res['load_before'][0]:.2f}, after {res['load_after'][0]:.2f} "
          f"(1 min); {os.cpu_count()} cores")
    print(f"{'':28s}{'unprotected':>14s}{'protected':>14s}{'ratio':>8s}")
    print(f"{'pull 100 MiB (median of %d)' % pull_rounds:28s}{med['pull'][False]:13.3f}s"
          f"{med['pull'][True]:13.3f}s{med['pull'][True] / med['pull'][False]:8.2f}")
    print(f"{'run(lambda: None) (of %d)' % run_rounds:28s}{med['run'][False] * 1e3:12.2f}ms"
          f"{med['run'][True] * 1e3:12.2f}ms{med['run'][True] / med['run'][False]:8.2f}")
    pulls = ", ".join(f"{a:.3f}-{b:.3f} s" for a, b in spread["pull"].values())
    runs = ", ".join(f"{a * 1e3:.2f}-{b * 1e3:.2f} ms" for a, b in spread["run"].values())
    print(f"ranges (min-max, unprotected then protected): pull {pulls}; run {runs}")
    print(f"HMAC-SHA256 of 100 MiB on one core: {res['hmac_100mib_s']:.3f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({k: ({str(p): v for p, v in val.items()} if isinstance(val, dict) else val)
                       for k, val in res.items()}, f, indent=1)


if __name__ == "__main__":
    main()
