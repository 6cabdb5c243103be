#!/usr/bin/env python
"""Attached groups: attach time, dispatch against a local group, and how fast torchrun goes away.

    python benchmarks/bench_attach.py [--quick] [--out bench_attach_results.json]

Two torchrun "nodes" of two ranks each (``--nnodes=2 --nproc-per-node=2 --rdzv-backend=static``,
on this machine, loopback) run ``python -m nbdist.worker`` and join ``nbdist.attach(4)``:

1. attach time: from the ``nbdist.attach`` call to the group being ready (the agents are started as
   soon as the key file exists, as a user would paste the command), over ``attach_reps`` attaches;
2. dispatch of a trivial call, ``g.run(lambda: None)``, on the attached group and on a local
   ``nbdist.start(4)`` group alive at the same time, timed in interleaved blocks (the first method
   rotates each round); the ratio of the medians;
3. ``g.stop()`` to every torchrun agent gone (after each attach of 1), and the agents' exit codes;
4. a rank death: rank 3 calls ``os._exit(3)`` while the others enter an ``all_reduce``; time to the
   :class:`RankDiedError` and to every agent gone (waited for up to ``orphan_wait`` s without any
   further call, then ``g.stop()`` and the same wait again, then the agents are killed and the
   figure says so).

The agents are started in their own session and killed at the end whatever happens.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

FULL = dict(attach_reps=4, dispatch_rounds=8, dispatch_block=200, orphan_wait=60.0)
QUICK = dict(attach_reps=2, dispatch_rounds=4, dispatch_block=60, orphan_wait=30.0)
NNODES, NPROC = 2, 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(node, rdzv, port, key_file):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NNODES}",
           f"--nproc-per-node={NPROC}", "--rdzv-backend=static", f"--node-rank={node}",
           "--master-addr=127.0.0.1", f"--master-port={rdzv}", "--max-restarts=0",
           "-m", "nbdist.worker", "--connect", f"127.0.0.1:{port}", "--key-file", key_file]
    return subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


class _Cluster:
    """``nbdist.attach(4)`` and the two agents; ``seconds`` is the attach time."""

    def __init__(self, tmp):
        import nbdist

        port, rdzv = _free_port(), _free_port()
        key_file = os.path.join(tmp, f"key-{port}.hex")
        box = {}

        def attach():
            try:
                box["g"] = nbdist.attach(NNODES * NPROC, listen=f"127.0.0.1:{port}",
                                         key_file=key_file, join_timeout=180, progress=False,
                                         timeout=60)
            except BaseException as err:  # noqa: BLE001 -- re-raised below
                box["err"] = err

        t0 = time.perf_counter()
        thread = threading.Thread(target=attach)
        thread.start()
        while not os.path.exists(key_file) and thread.is_alive():
            time.sleep(0.005)
        self.agents = [_agent(n, rdzv, port, key_file) for n in range(NNODES)]
        thread.join(240)
        self.seconds = time.perf_counter() - t0
        if "err" in box or "g" not in box:
            self.kill()
            raise box.get("err") or TimeoutError("attach did not return")
        self.group = box["g"]

    def wait_gone(self, limit):
        """Seconds until every agent has exited (``None`` if not within ``limit``)."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < limit:
            if all(p.poll() is not None for p in self.agents):
                return time.perf_counter() - t0
            time.sleep(0.01)
        return None

    def codes(self):
        return [p.poll() for p in self.agents]

    def kill(self):
        for p in self.agents:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()


def _noop():  # defined in __main__: travels by value (the ranks cannot import this script)
    return None


def _dispatch(groups, rounds, block):
    samples = {name: [] for name in groups}
    names = list(groups)
    for _ in range(3):
        for g in groups.values():
            g.run(_noop)
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            g = groups[name]
            for _ in range(block):
                t0 = time.perf_counter()
                g.run(_noop)
                samples[name].append(time.perf_counter() - t0)
    return {name: harness.summary(xs) for name, xs in samples.items()}


def run(cfg):
    import nbdist

    res = {"attach_s": [], "stop_to_agents_gone_s": [], "stop_agent_codes": []}
    tmp = tempfile.mkdtemp(prefix="nbdist-bench-attach-")
    live = []
    try:
        for rep in range(cfg["attach_reps"]):
            c = _Cluster(tmp)
            live.append(c)
            res["attach_s"].append(c.seconds)
            harness.log(f"attach {rep + 1}/{cfg['attach_reps']}: {c.seconds:.2f} s")
            if rep == 0:
                local = nbdist.start(NNODES * NPROC, backend="gloo", device="cpu", timeout=60)
                try:
                    res["dispatch"] = _dispatch({"attached": c.group, "local": local},
                                                cfg["dispatch_rounds"], cfg["dispatch_block"])
                finally:
                    local.stop()
            t0 = time.perf_counter()
            c.group.stop()
            gone = c.wait_gone(cfg["orphan_wait"])
            res["stop_to_agents_gone_s"].append(None if gone is None
                                                else time.perf_counter() - t0)
            res["stop_agent_codes"].append(c.codes())
            c.kill()
        c = _Cluster(tmp)
        live.append(c)
        t0 = time.perf_counter()
        try:
            c.group.exec("import os\nif rank == 3:\n    os._exit(3)\n"
                         "t = torch.ones(10); dist.all_reduce(t)")
        except nbdist.RankDiedError as err:
            res["death_reported_s"] = time.perf_counter() - t0
            res["death_error"] = str(err).splitlines()[0]
        gone = c.wait_gone(cfg["orphan_wait"])
        res["death_to_agents_gone_s"] = None if gone is None else time.perf_counter() - t0
        res["death_agent_codes_before_stop"] = c.codes()
        if gone is None:  # nbdist alone did not end them: what stop() does
            t1 = time.perf_counter()
            c.group.stop()
            again = c.wait_gone(cfg["orphan_wait"])
            res["death_then_stop_to_agents_gone_s"] = None if again is None \
                else time.perf_counter() - t1
        res["death_agent_codes"] = c.codes()
        res["death_agents_killed_by_bench"] = any(code is None for code in c.codes())
        c.group.stop()
    finally:
        for c in live:
            c.kill()
    res["attach"] = harness.summary(res["attach_s"])
    return res


def _s(x):
    return "not within the wait" if x is None else f"{x:.2f} s"


def main(argv=None) -> int:
    ap = harness.arg_parser(__doc__, "bench_attach_results.json")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    load = os.getloadavg()
    res = {"meta": harness.machine_info(config=cfg, loadavg_before=load), "attach": run(cfg)}
    res["meta"]["loadavg_after"] = os.getloadavg()
    a = res["attach"]
    d = a["dispatch"]
    print(f"load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
          f"after {res['meta']['loadavg_after'][0]:.2f}; {os.cpu_count()} cores")
    print(f"attach, 4 ranks on 2 torchrun nodes   median {a['attach']['median']:.2f} s "
          f"(min {a['attach']['min']:.2f}, max {a['attach']['max']:.2f}, n={a['attach']['n']})")
    print(f"g.run(lambda: None), attached          {harness.fmt_summary(d['attached'])}")
    print(f"g.run(lambda: None), local start(4)    {harness.fmt_summary(d['local'])}")
    print(f"attached / local                       "
          f"{harness.ratio(d['attached'], d['local']):.2f}x")
    print(f"g.stop() to every agent gone           "
          f"{', '.join(_s(x) for x in a['stop_to_agents_gone_s'])} "
          f"(agent exit codes {a['stop_agent_codes']})")
    print(f"rank death to RankDiedError            {_s(a.get('death_reported_s'))}")
    print(f"rank death to every agent gone         {_s(a['death_to_agents_gone_s'])} "
          f"(codes then {a['death_agent_codes_before_stop']})")
    if "death_then_stop_to_agents_gone_s" in a:
        print(f"  ... then g.stop() to agents gone     {_s(a['death_then_stop_to_agents_gone_s'])}"
              f" (codes {a['death_agent_codes']}; killed by the benchmark: "
              f"{a['death_agents_killed_by_bench']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
