#!/usr/bin/env python
"""Every test, in two pytest processes side by side (issue 39: the suite mostly waits -- for ranks
to start, for the timeouts the tests are about, for kernels and browsers -- and used about 0.75 of
the 2 cores here when run in one process).

    python scripts/test_streams.py [--serial]

* ``kernels``: everything outside ``tests/integration`` (docs, notebooks and kernels, the browser,
  unit, windows, gpu), plus the integration modules listed in :data:`WITH_KERNELS` -- the ones
  that start a cluster (SLURM, Ray, the Kubernetes fakes), so that every cluster of the suite
  lives in one process, as the tutorial tests that start the same clusters do;
* ``ranks``: the rest of ``tests/integration``.

Split so that a new test folder or module runs in one of them, never in none: ``kernels`` takes
every entry of ``tests/`` but the integration folder, ``ranks`` the integration folder less the
listed modules (a name in the list that does not exist stops the run).
Each stream prints its lines prefixed with its name; the exit status is the first non-zero one.
With ``--serial``, or on a machine with one core, it runs one pytest over everything instead.
Each test already runs alone in its process, so nothing is shared between the two but the
machine: tests pick free ports at random and check only their own children and segments.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTEGRATION = "tests/integration"
#: integration modules run in the ``kernels`` stream: every one that starts a cluster, and one
#: more to even the two out (wall times of each stream: docs/benchmarks.md)
WITH_KERNELS = [
    "test_engine_slurm.py", "test_engine_slurm_reattach.py", "test_attach_slurm.py",
    "test_engine_ray.py", "test_engine_k8s.py", "test_k8s_api.py", "test_lifecycle.py",
]


def streams():
    """``[(name, pytest arguments)]`` of the two streams."""
    moved = [f"{INTEGRATION}/{name}" for name in WITH_KERNELS]
    missing = [path for path in moved if not os.path.exists(os.path.join(ROOT, path))]
    if missing:
        raise SystemExit(f"scripts/test_streams.py: WITH_KERNELS names {missing}, which do not "
                         "exist; update the list.")
    others = sorted(f"tests/{entry.name}" for entry in os.scandir(os.path.join(ROOT, "tests"))
                    if f"tests/{entry.name}" != INTEGRATION and (
                        (entry.is_dir() and entry.name != "__pycache__")
                        or (entry.name.startswith("test_") and entry.name.endswith(".py"))))
    return [("kernels", [*others, *moved]),
            ("ranks", [INTEGRATION, *(f"--ignore={path}" for path in moved)])]


def _relay(name: str, proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()


def run(extra) -> int:
    started = time.monotonic()
    procs = []
    # SIGINT as Python sets it, whoever started this script: a shell that ran it in the background
    # left it ignored, and the children would inherit that (the interrupt tests need it).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for name, args in streams():
            proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", *args, *extra],
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="backslashreplace")
            relay = threading.Thread(target=_relay, args=(name, proc), daemon=True)
            relay.start()
            procs.append((name, proc, relay))
        status = 0
        for name, proc, relay in procs:
            code = proc.wait()
            relay.join()
            print(f"[{name}] exit status {code} after {time.monotonic() - started:.0f} s",
                  flush=True)
            status = status or code
        return status
    finally:  # interrupted (or failed to start one): no stream outlives this script
        for _, proc, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for _, proc, _ in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv) -> int:
    serial = "--serial" in argv
    extra = [a for a in argv if a != "--serial"]
    if serial or (os.cpu_count() or 1) < 2:
        return subprocess.call([sys.executable, "-m", "pytest", "-q", *extra], cwd=ROOT)
    return run(extra)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
