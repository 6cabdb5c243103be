#!/usr/bin/env python
"""Every test, in two pytest processes side by side (issue 39: the suite mostly waits -- for ranks
to start, for the timeouts the tests are about, for kernels and browsers -- and used about 0.75 of
the 2 cores here when run in one process).

    python scripts/test_streams.py [--serial]
    python scripts/test_streams.py --windows PYTHON [PYTEST_OPTION...]

* ``kernels``: everything outside ``tests/integration`` (docs, notebooks and kernels, the browser,
  unit, windows, gpu), plus the integration modules listed in :data:`WITH_KERNELS` -- the ones
  that start a cluster (SLURM, Ray), so that every cluster of the suite lives in one process, as
  the tutorial tests that start the same clusters do (the Kubernetes fakes share nothing and
  listen on free ports: they run in ``ranks``);
* ``ranks``: the rest of ``tests/integration``.

With ``--windows``, the Windows suite instead (``scripts/test-windows.sh``, which passes the Windows
``python.exe`` under Wine as ``PYTHON``, one shell word per argument of the command): ``unit``
(``tests/unit``) and ``windows`` (``tests/windows``) side by side, each ``PYTHON -m pytest`` with the
options given, from the current directory. Under Wine one pytest keeps about one core busy: most of
the suite is interpreters importing torch one after the other.

Split so that a new test folder or module runs in one of them, never in none: ``kernels`` takes
every entry of ``tests/`` that pytest would collect but the integration folder, ``ranks`` the
integration folder less the listed modules (a name in the list that does not exist stops the run).
A new integration module that starts a cluster belongs in :data:`WITH_KERNELS`: add it there.
Each stream prints its lines prefixed with its name; the exit status is the first non-zero one.
With ``--serial``, or where this process may use only one core, it runs one pytest instead (no
other argument is taken: ``bash scripts/test.sh ARGS`` runs one pytest with ``ARGS``).

Each stream runs in a process group of its own: a Ctrl-C, SIGTERM or SIGHUP to this script reaches
each stream once, as SIGINT (pytest then tears its fixtures down); a stream still running
:data:`STOP_S` s later is killed with its whole group. Nothing is shared between the two streams
but the machine: tests pick free ports at random and check only their own children and segments.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTEGRATION = "tests/integration"
#: integration modules run in the ``kernels`` stream: every one that starts a cluster (wall times
#: of each stream: docs/benchmarks.md; test_lifecycle.py, here until the ranks' backend tests and
#: DeepSpeed cycles got cheaper, went back to ``ranks`` to keep the two even, and so did the
#: Kubernetes fakes' modules once forked ranks got cheaper to start)
WITH_KERNELS = [
    "test_engine_slurm.py", "test_engine_slurm_reattach.py", "test_attach_slurm.py",
    "test_engine_ray.py",
]
STOP_S = 60.0  #: s a stream gets to end after the SIGINT it was sent
USAGE = ("scripts/test_streams.py takes only --serial, or --windows PYTHON and pytest options; to "
         "run some tests, pass them to one pytest: bash scripts/test.sh ARGS (bash "
         "scripts/test-windows.sh ARGS for the Windows suite)")
#: the Windows suite's two streams (``--windows``): they take about as long as each other
WINDOWS_STREAMS = [("unit", ["tests/unit"]), ("windows", ["tests/windows"])]


def _collected(entry: os.DirEntry) -> bool:
    """Whether pytest collects ``tests/<entry>`` (a folder, or a test module by its default
    ``test_*.py`` / ``*_test.py`` names); hidden entries and caches are not."""
    if entry.name.startswith((".", "__")):
        return False
    if entry.is_dir():
        return True
    return entry.name.endswith(".py") and (entry.name.startswith("test_")
                                            or entry.name.endswith("_test.py"))


def streams():
    """``[(name, pytest arguments)]`` of the two streams."""
    moved = [f"{INTEGRATION}/{name}" for name in WITH_KERNELS]
    missing = [path for path in moved if not os.path.exists(os.path.join(ROOT, path))]
    if missing:
        raise SystemExit(f"scripts/test_streams.py: WITH_KERNELS names {missing}, which do not "
                         "exist; update the list.")
    others = sorted(f"tests/{entry.name}" for entry in os.scandir(os.path.join(ROOT, "tests"))
                    if f"tests/{entry.name}" != INTEGRATION and _collected(entry))
    return [("kernels", [*others, *moved]),
            ("ranks", [INTEGRATION, *(f"--ignore={path}" for path in moved)])]


def _relay(name: str, proc: subprocess.Popen) -> None:
    """Copy a stream's lines to this script's stdout, prefixed; keep reading (so the stream never
    blocks on a full pipe) even once this stdout is gone."""
    for line in proc.stdout:
        try:
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()
        except (OSError, ValueError):
            pass


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs) -> None:
    """SIGINT once to each stream still running, then SIGKILL to any group left after STOP_S."""
    for _, proc, _ in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGINT)
    deadline = time.monotonic() + STOP_S
    for _, proc, _ in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
    for _, _, relay in procs:  # what the streams said as they stopped
        relay.join(5)


def _as_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(split=None, python=None, cwd=ROOT) -> int:
    """The streams at once (``split``: ``[(name, pytest arguments)]``, :func:`streams` by
    default; ``python``: the interpreter's command, this one by default; ``cwd``: where the
    streams run); the first non-zero exit status (a stream killed by a signal: 1)."""
    started = time.monotonic()
    procs = []
    for name in ("SIGTERM", "SIGHUP"):  # as Ctrl-C: the streams are stopped, not left running
        signal.signal(getattr(signal, name), _as_interrupt)
    try:
        for name, args in (streams() if split is None else split):
            # -u: the stream's lines come as pytest writes them, not in blocks of a pipe's buffer
            # (for pytest's own process only: what the tests start is not changed)
            proc = subprocess.Popen([*(python or [sys.executable]), "-u", "-m", "pytest", "-q",
                                     *args], cwd=cwd,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True,
                                    errors="backslashreplace", start_new_session=True)
            relay = threading.Thread(target=_relay, args=(name, proc), daemon=True)
            relay.start()
            procs.append((name, proc, relay))
        status, left = 0, list(procs)
        while left:
            for item in list(left):
                name, proc, relay = item
                code = proc.poll()
                if code is None:
                    continue
                left.remove(item)
                relay.join(10)  # a leftover grandchild holding the pipe: do not wait for it
                print(f"[{name}] exit status {code} after {time.monotonic() - started:.0f} s",
                      flush=True)
                if code:  # the first failure's status (a stream killed by a signal: 1)
                    status = status or (code if code > 0 else 1)
            time.sleep(0.2)
        return status
    except KeyboardInterrupt:
        print("test_streams: interrupted; stopping both streams", file=sys.stderr, flush=True)
        return 130
    finally:  # interrupted (or failed to start one): no stream outlives this script
        _stop(procs)


def _cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def main(argv) -> int:
    # --windows PYTHON: the Windows suite's interpreter command (empty otherwise)
    python = shlex.split(argv[1]) if argv[:1] == ["--windows"] and len(argv) >= 2 else []
    if argv not in ([], ["--serial"]) and not python:
        raise SystemExit(USAGE)
    # SIGINT as Python sets it, whoever started this script: a shell that ran it in the background
    # left it ignored, and pytest would inherit that (the interrupt tests need it).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    serial = _cores() < 2 or not hasattr(os, "killpg")
    if python:
        options = argv[2:]
        split = [(name, [*options, *paths]) for name, paths in WINDOWS_STREAMS]
        if serial:  # one stream, still through a pipe: Wine's python.exe needs one for stdout
            split = [("suite", [*options, *(p for _, paths in WINDOWS_STREAMS for p in paths)])]
        return run(split, python, os.getcwd())
    if argv or serial:
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-m", "pytest", "-q"])
    return run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
