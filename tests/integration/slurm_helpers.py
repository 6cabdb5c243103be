"""A real SLURM for the tests: one slurmctld and two slurmd "nodes" (n1, n2, two CPUs each: a group of one rank per node
and one more such job fit, a third waits) on this
machine, started by the shared script ``local-slurm.sh`` (CI has it at ``../shared/slurm/`` from
the repository root) -- or a skip that says why it could not start."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import List

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_TIME = "2:00:00"  #: the test partition's time limit


def script() -> Path:
    """The shared script, found beside the checkout (a worktree may sit one level deeper)."""
    for up in (ROOT.parent, ROOT.parent.parent):
        path = up / "shared" / "slurm" / "local-slurm.sh"
        if path.is_file():
            return path
    pytest.skip(f"no local-slurm.sh in ../shared/slurm from {ROOT}: cannot start a test SLURM")


class LocalSlurm:
    """The cluster of one test module: ``SLURM_CONF`` set while it runs, stopped at the end."""

    def __init__(self, directory: Path):
        if os.geteuid() != 0:
            pytest.skip("local-slurm.sh runs slurmctld and slurmd as root: the tests need root")
        if shutil.which("bash") is None:
            pytest.skip("no bash to run local-slurm.sh")
        self.dir, self.script = directory, script()
        self.before = os.environ.get("SLURM_CONF")
        try:
            done = subprocess.run(["bash", str(self.script), "start", str(directory), "2", "2"],
                                  capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.skip("the test SLURM did not come up within 300 s")
        if done.returncode != 0:
            self.stop()
            pytest.skip(f"the test SLURM could not start: {done.stderr.strip()[-500:]}")
        os.environ["SLURM_CONF"] = str(directory / "slurm.conf")
        # as most clusters: a node set down stays down (with its reason) until it is resumed;
        # the script's ReturnToService=2 would bring it back (reason cleared) within seconds
        conf = directory / "slurm.conf"
        # and a partition time limit that sbatch enforces (a longer --time is refused at once)
        conf.write_text(conf.read_text().replace("ReturnToService=2", "ReturnToService=1")
                        .replace("MaxTime=INFINITE", f"MaxTime={MAX_TIME}")
                        + "EnforcePartLimits=ALL\n")
        self.scontrol("reconfigure")

    def jobs(self) -> List[str]:
        """The ids of the jobs squeue shows (pending, running or completing)."""
        out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True,
                             timeout=30).stdout
        return out.split()

    def wait_empty(self, limit: float = 15.0, keep=()) -> float:
        """Seconds until squeue shows no job but ``keep``; fails after ``limit``."""
        t0 = time.monotonic()
        while [j for j in self.jobs() if j not in keep]:
            assert time.monotonic() - t0 < limit, f"squeue still shows {self.jobs()}"
            time.sleep(0.25)
        return time.monotonic() - t0

    def state(self, job: str, fields: str = "%T") -> str:
        """squeue's state of ``job`` (``""`` once it left the queue), or other ``fields``."""
        return subprocess.run(["squeue", "-h", "-j", job, "-o", fields], capture_output=True,
                              text=True, timeout=30).stdout.strip()

    def scontrol(self, *args: str) -> None:
        done = subprocess.run(["scontrol", *args], timeout=30, capture_output=True, text=True)
        assert done.returncode == 0, f"scontrol {' '.join(args)}: {done.stderr.strip()}"

    def wait_idle(self, node: str, limit: float = 60.0) -> None:
        """Until ``node`` is idle again (after a resume)."""
        deadline = time.monotonic() + limit
        while True:
            state = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True,
                                   text=True, timeout=30).stdout.strip()
            if state == "idle":
                return
            assert time.monotonic() < deadline, f"node {node} is {state!r}"
            time.sleep(0.5)

    def stop(self) -> None:
        """Cancel every job and wait for them to end *before* the daemons stop: a job step
        left behind would register with the next test cluster (same ports, same job ids)."""
        if os.environ.get("SLURM_CONF") == str(self.dir / "slurm.conf"):
            subprocess.run(["scancel", "--full", "-u", "root"], capture_output=True, timeout=30)
            deadline = time.monotonic() + 30
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.25)
        pids = []
        for pid_file in self.dir.glob("*.pid"):
            try:
                pids.append(int(pid_file.read_text().strip()))
            except (OSError, ValueError):
                pass
        subprocess.run(["bash", str(self.script), "stop", str(self.dir)], capture_output=True,
                       timeout=60)
        # a step whose node's slurmd was killed (a test does it) never hears its job end: its
        # slurmstepd, working in this cluster's log directory, outlives the daemons otherwise
        for proc in psutil.process_iter(["name"]):
            try:
                if (proc.info["name"] or "").startswith("slurmstepd") and \
                        proc.cwd().startswith(str(self.dir)):
                    proc.kill()
                    pids.append(proc.pid)
            except psutil.Error:
                pass
        deadline = time.monotonic() + 20  # the daemons save their state and free their ports
        while any(_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = self.before


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
