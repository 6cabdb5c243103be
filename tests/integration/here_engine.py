"""A small engine for the tests: it places its ranks on this machine, as plain processes running
``python -m nbdist.worker --connect`` (what srun runs on a SLURM node), so ``keep_alive`` and
``nbdist.reattach()`` -- which live in the runtime's :class:`~nbdist.runtime.attach.AttachLauncher`,
not in any engine -- are tested without a cluster. Registered under the entry-point group
``nbdist.engines`` as ``here`` through real installation metadata (:func:`register`).

The ranks are started in their own session and do not die with the process that started them:
they outlive a SIGKILLed kernel, as a SLURM job does. Each writes to ``rank-N.log`` in the
engine's ``workdir`` (the job's output file). :func:`end` kills what is left of them."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from nbdist.engines import ENTRY_POINT_GROUP, Engine
from nbdist.runtime.attach import AttachLauncher

HERE = Path(__file__).resolve().parent


def register(folder: Path) -> Path:
    """Make ``folder`` hold the metadata of an installed package whose entry point names
    :class:`HereEngine`; put ``folder`` (and this directory) on ``sys.path``/``PYTHONPATH``."""
    info = folder / "here_engine-1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: here-engine\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n"
                                           "here = here_engine:HereEngine\n")
    return folder


def alive(pids) -> list:
    """The ranks of ``pids`` still running (not zombies)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


def wait_gone(pids, timeout: float) -> list:
    """Wait up to ``timeout`` s for the ranks of ``pids`` to exit; those still running."""
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


def end(pids) -> None:
    """Kill what is left of a test's ranks (they are no child of the test process)."""
    for pid in alive(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    wait_gone(pids, 10.0)


class HereLauncher(AttachLauncher):
    """Starts ``python -m nbdist.worker --connect`` once per rank, in its own session."""

    def __init__(self, workdir: str, progress: bool):
        os.makedirs(workdir, exist_ok=True)
        super().__init__(("127.0.0.1", 0), os.path.join(workdir, "key.hex"), 120.0, None,
                         progress, False)
        self.workdir, self.pids, self.job = workdir, [], f"here{os.getpid()}"

    def listening(self, host, port, world_size):
        if self.reattach_key:
            return  # the ranks run already: they connect to this address every 0.2 s
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size),
                       LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0",
                       OMP_NUM_THREADS="1")
            with open(os.path.join(self.workdir, f"rank-{rank}.log"), "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "nbdist.worker", "--connect", f"{host}:{port}",
                     "--key-file", self.key_file], env=env, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=log, start_new_session=True)
            self.pids.append(proc.pid)

    def handle_fields(self):
        return {"job": self.job, "workdir": self.workdir, "pids": self.pids}


class HereEngine(Engine):
    """``nbdist.start(2, on="here", workdir=DIR, keep_alive=...)``: ranks on this machine."""

    name = "here"
    options = ("workdir", "progress")

    @classmethod
    def ended(cls, handle):
        return "" if alive(handle["pids"]) else f"the ranks of {handle['job']} exited"

    def reattach(self, handle, join_timeout, progress):
        launcher = HereLauncher(handle["workdir"], progress)
        launcher.join_timeout, launcher.pids = join_timeout, list(handle["pids"])
        launcher.job = handle["job"]
        launcher.address, launcher.protect = tuple(handle["address"]), bool(handle["protect"])
        return launcher

    def launcher(self, world_size, workdir=None, progress=True):
        return HereLauncher(workdir, progress)
