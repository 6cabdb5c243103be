"""What the benchmark scripts here share: statistics, timing, child processes with deadlines, the
final sweep, JSON output with the machine, the compact table and the common options.

A topic module (bench_startup, bench_dispatch, bench_tensor) has ``NAME``, ``FULL`` / ``QUICK``,
``run(cfg, sizes, res, log)`` filling ``res[NAME]``, ``ratios(res)``, ``print_table(res)``, and may
have ``setup()`` (returns temp dirs to remove at the end) and ``sweep()`` (kills what it left,
returns their names). Nothing heavy (torch, nbdist, psutil) is imported at import time: a child
that times its own ``import torch`` / ``import nbdist`` has imported this module first.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

RESULT_TAG = "BENCH-RESULT "
CHILD_IMPORT_TIMEOUT = 90.0  # allowance for a child's imports before its first result
RUN_TMP = None  # a private temp dir for the child processes, removed at the end


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# =============================================================================== statistics
def percentile(xs, q):
    """Linear-interpolation percentile (numpy's default), q in [0, 100] (nbdist.bench.units')."""
    from nbdist.bench.units import percentile as _percentile
    return _percentile(xs, q)


def summary(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "median": percentile(xs, 50), "p10": percentile(xs, 10),
            "p90": percentile(xs, 90), "min": min(xs), "max": max(xs),
            "mean": sum(xs) / len(xs)}


def ratio(a, b):
    """Ratio of two summaries' medians; None where either is missing."""
    try:
        return a["median"] / b["median"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def fmt(x, ms=False):
    if x is None:
        return "-"
    if ms or x < 1.0:
        return f"{x * 1e3:.3g} ms" if x * 1e3 < 100 else f"{x * 1e3:.0f} ms"
    return f"{x:.2f} s"


def fmt_summary(s):
    """``median [p10-p90] ms (n=...)`` of a :func:`summary`."""
    if not s or not s.get("n"):
        return "-"
    return (f"{s['median'] * 1e3:.3g} [{s['p10'] * 1e3:.3g}-{s['p90'] * 1e3:.3g}] ms (n={s['n']})")


# =============================================================================== timing
def timed_block(fn, count, out):
    pc = time.perf_counter
    for _ in range(count):
        t0 = pc()
        fn()
        out.append(pc() - t0)


def as_main(fn):
    """Mark a function sent to workers as ``__main__``'s, whichever script imported it: cloudpickle
    and ipyparallel send it by value and nbdist's ranks treat it as a notebook function."""
    fn.__module__ = "__main__"
    return fn


@as_main
def noop():
    return None


def have(module, what):
    """Whether ``module`` can be imported; if not, says that ``what`` is skipped."""
    import importlib.util

    found = importlib.util.find_spec(module) is not None
    if not found:
        log(f"  {module} is not installed: {what} is skipped (see benchmarks/requirements.txt)")
    return found


# =============================================================================== child processes
def emit(obj):
    """Child processes report one JSON object per line, tagged, on stdout."""
    sys.stdout.write(RESULT_TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


def loopback_env():
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if RUN_TMP:
        env["TMPDIR"] = RUN_TMP  # what a killed (hung) child leaves behind goes away with it
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        names = []
    # nbdist binds gloo to the loopback interface itself; give the alternatives the same setting,
    # so that nobody pays for hostname resolution.
    if "lo" in names and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def descendants(pid):
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def kill_tree(proc):
    """SIGKILL a child started with start_new_session=True, its process group and descendants."""
    import psutil

    kids = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for k in kids:
        with contextlib.suppress(psutil.Error):
            k.kill()
    with contextlib.suppress(Exception):
        proc.kill()
    with contextlib.suppress(Exception):
        proc.wait(10)


class ChildRun:
    """Run ``SCRIPT --child MODE`` and read its tagged result lines with deadlines."""

    def __init__(self, script, mode, n, reps):
        self.errfile = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(script), "--child", mode, "--n", str(n),
             "--reps", str(reps)], stdout=subprocess.PIPE, stderr=self.errfile,
            env=loopback_env(), start_new_session=True)
        self.buf = b""
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)

    def next_result(self, timeout):
        """The next result dict; None on EOF; raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(RESULT_TAG):
                    return json.loads(text[len(RESULT_TAG):])
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if not self.sel.select(remaining):
                continue
            data = os.read(self.proc.stdout.fileno(), 65536)
            if not data:
                return None
            self.buf += data

    def stderr_tail(self, n=1500):
        self.errfile.seek(0)
        return self.errfile.read().decode(errors="replace")[-n:]

    def close(self):
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
        kill_tree(self.proc)  # also reaps anything left in its process group
        self.sel.close()
        self.proc.stdout.close()
        self.errfile.close()


def run_child(script, mode, n, reps, item_timeout):
    """Collect ``reps`` results from child processes; a result missing after ``item_timeout`` is a
    hang: the child and everything it started are killed and a fresh child does the rest."""
    results, hangs, errors = [], 0, []
    hang_tails = []
    attempts = 0
    while len(results) + hangs < reps and attempts < reps + 3:
        attempts += 1
        child = ChildRun(script, mode, n, reps - len(results) - hangs)
        try:
            try:
                hello = child.next_result(CHILD_IMPORT_TIMEOUT)
            except TimeoutError:
                hello = None
            if not hello:
                kill_tree(child.proc)
                errors.append(f"no start-up report within {CHILD_IMPORT_TIMEOUT:g} s: "
                              f"{child.stderr_tail()}")
                continue
            while len(results) + hangs < reps:
                try:
                    res = child.next_result(item_timeout)
                except TimeoutError:
                    hangs += 1
                    kill_tree(child.proc)
                    hang_tails.append(child.stderr_tail(600))
                    break
                if res is None:
                    child.proc.wait(15)
                    errors.append(f"exit {child.proc.returncode}: {child.stderr_tail()}")
                    break
                results.append(res)
        finally:
            child.close()
        if errors and len(errors) >= 3:
            break
    errors += [f"hang (killed after {item_timeout:g} s), stderr tail: {t}" for t in hang_tails]
    return results, hangs, errors


# =============================================================================== the machine
def versions():
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "nbdist", "cloudpickle", "numpy", "accelerate", "ipyparallel", "pyzmq"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    import torch

    out["torch_runtime"] = torch.__version__
    return out


def machine_info(**extra):
    """Python, torch, cores and platform, for the scripts that record only these."""
    import torch

    return dict({"python": platform.python_version(), "torch": torch.__version__,
                 "cpus": os.cpu_count(), "platform": platform.platform()}, **extra)


def nbdist_source_info():
    """Where nbdist comes from and a hash of its sources (to see whether they changed mid-run)."""
    import hashlib
    import importlib.util

    spec = importlib.util.find_spec("nbdist")
    root = os.path.dirname(spec.origin)
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    h.update(name.encode() + b"\0" + f.read())
    info = {"path": root, "sources_sha256": h.hexdigest()[:16]}

    def git(*cmd):
        return subprocess.run(["git", "-C", root, *cmd], capture_output=True, text=True, timeout=10)
    try:
        if git("rev-parse", "--show-toplevel").returncode == 0:
            info.update({"git_head": git("rev-parse", "--short", "HEAD").stdout.strip(),
                         "git_dirty": bool(git("status", "--porcelain", "--", ".").stdout.strip())})
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# =============================================================================== running sections
def arg_parser(doc, out, sections=None, sizes=False, quick="fewer repetitions (~2 minutes)"):
    """The common options: --quick, --out, --sections (given section names), --sizes (if asked)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--out", default=out, help="JSON file for all raw numbers")
    if sections:
        ap.add_argument("--sections", default=",".join(sections),
                        help=f"comma-separated subset of {','.join(sections)}")
    if sizes:
        ap.add_argument("--sizes", default="2,4", help="world sizes (default 2,4)")
    return ap


def run_alone(module, argv=None):
    """A topic script run by itself: the common options, then :func:`main` on that topic alone."""
    ap = arg_parser(module.__doc__, f"bench_{module.NAME}_results.json", [module.NAME], sizes=True)
    return main([module], ap.parse_args(argv))


def final_sweep(modules):
    """Stop every group, let each topic kill what it started, then kill (and name) any descendant
    still running: multiprocessing's own helpers exit with us, everything else is a leak."""
    import psutil

    import nbdist
    nbdist.stop_all()
    leftovers = [name for m in modules if hasattr(m, "sweep") for name in m.sweep()]
    for p in descendants(os.getpid()):
        try:
            name = " ".join(p.cmdline())[:160]
        except psutil.Error:
            continue
        if "forkserver" in name or "resource_tracker" in name:
            continue
        leftovers.append(name)
        with contextlib.suppress(psutil.Error):
            p.kill()
    return leftovers


def print_table(res, modules, title):
    print(f"\n=== {title}: median [p10-p90] (n samples) ===")
    for m in modules:
        m.print_table(res)
        if res.get(m.NAME, {}).get("skipped"):
            print(f"   skipped: {', '.join(res[m.NAME]['skipped'])}")
    print("\n-- ratios (medians)")
    for sec, r in res.get("ratios", {}).items():
        items = ", ".join(f"{k} = {v:.3g}" if isinstance(v, (int, float)) else f"{k} = {v}"
                          for k, v in r.items() if v is not None)
        print(f" {sec}: {items}")
    if res.get("leftover_processes"):
        print(f"\n!! leftover processes killed at the end: {res['leftover_processes']}")


def main(modules, args, title="nbdist core benchmarks"):
    """Run the selected topics of ``modules`` (in this order), write the JSON, print the table."""
    global RUN_TMP
    names = [m.NAME for m in modules]
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if set(sections) - set(names):
        sys.exit(f"--sections {args.sections}: choose from {','.join(names)}")
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    RUN_TMP = tempfile.mkdtemp(prefix="bench-core-")
    cfg = {k: v for m in modules for k, v in (m.QUICK if args.quick else m.FULL).items()}
    sizes = [int(x) for x in args.sizes.split(",")]
    os.environ.update({k: v for k, v in loopback_env().items() if k == "GLOO_SOCKET_IFNAME"})
    tmp_dirs = [RUN_TMP] + [d for m in modules if hasattr(m, "setup") for d in m.setup()]

    t_start = time.perf_counter()
    import torch  # noqa: F401 -- the parent of every comparison has torch imported

    res = {"meta": {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                    "host": platform.node(), "platform": platform.platform(),
                    "cpus": os.cpu_count(), "versions": versions(), "quick": args.quick,
                    "config": cfg, "sections": sections, "units": "seconds",
                    "nbdist_source": nbdist_source_info(),
                    "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}}
    prog = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    log(f"{prog}: {'quick' if args.quick else 'full'} run, sizes {sizes}, sections {sections}; "
        f"nbdist from {res['meta']['nbdist_source']}")
    try:
        for m in modules:
            if m.NAME in sections:
                log(f"{m.NAME} ...")
                m.run(cfg, sizes, res, log)
    except BaseException:
        res["error"] = traceback.format_exc()
        log(res["error"])
    finally:
        res["leftover_processes"] = final_sweep(modules)
        for d in tmp_dirs:
            shutil.rmtree(d, ignore_errors=True)
        res["ratios"] = {k: v for m in modules for k, v in m.ratios(res).items()}
        end_hash = nbdist_source_info()["sources_sha256"]
        if end_hash != res["meta"]["nbdist_source"]["sources_sha256"]:
            res["meta"]["nbdist_sources_changed_during_run"] = True
            log("!! nbdist's sources changed during the run: the figures mix versions. Run against "
                "a snapshot (see docs/benchmarks.md) or on a quiet checkout.")
        res["meta"]["wall_s"] = time.perf_counter() - t_start
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print_table(res, modules, title)
        print(f"\nwall time {res['meta']['wall_s']:.0f} s; raw numbers in {args.out}")
    return 1 if "error" in res else 0
