"""The launch of a SLURM group: listen, submit the job, show its wait, admit its ranks.

:class:`SlurmLauncher` is an :class:`~nbdist.runtime.attach.AttachLauncher` that starts the ranks
itself: once the listener and the key file are ready it submits the batch job
(:mod:`.slurm_cli`), starts an owner link (a tiny process that cancels the job if this kernel is
SIGKILLed) and a ``nbdist-slurm-wait`` thread that shows the job's state while it waits (PENDING
with SLURM's reason, the time waited, the job id). A job that ends before its ranks joined wakes the
admission at once with SLURM's reason; Ctrl-C cancels the job. A rank lost later is a
:class:`~nbdist.RankDiedError` naming its SLURM node and what SLURM says about it.
"""
from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from typing import List, Optional

from ..errors import NbdistError, ranks_phrase
from ..runtime.attach import AttachLauncher
from ..runtime.ready import AdmissionStopped
from . import slurm_cli
from .admission import EngineAdmission, EngineProcess

REFUSAL = ("the ranks of a SLURM group run in its job; nbdist does not restart them. Call stop() "
           "and nbdist.start(..., on='slurm') again (a new job).")


class SlurmLauncher(AttachLauncher):
    """Submits one job whose srun step runs every rank, then admits them as attached ranks."""

    broken_advice = "stop() it and start a new one with nbdist.start(..., on='slurm') (a new job)."

    def __init__(self, directives: List[str], env, python: str, tasks_per_node: int,
                 address, workdir: Optional[str], join_timeout: float, progress: bool,
                 protect: Optional[bool]):
        super().__init__(address, None, join_timeout, tasks_per_node, progress, protect)
        self.directives, self.env, self.python = directives, dict(env), python
        self.workdir_parent = workdir
        self.workdir: Optional[str] = None
        self.job_id: Optional[str] = None
        self.nodes: List[str] = []  #: the job's nodes, in SLURM_NODEID order
        self._wait: Optional[_Wait] = None
        self._link = None

    @property
    def restart_refusal(self) -> Optional[str]:
        """Always: a SLURM group's ranks are not restarted (start a new job instead)."""
        return REFUSAL

    def can_relaunch(self, auto_restart: bool) -> bool:
        """Never: a new job is a new group."""
        return False

    def launch(self, group_id, choice, opts, threads, tmp, relay):
        """Listen, submit, wait with the job's state shown; ranks ready, or raise with the job
        cancelled."""
        if self.regen is None and self.workdir is None:
            parent = self.workdir_parent or os.path.join(os.path.expanduser("~"), ".nbdist",
                                                         "slurm")
            os.makedirs(parent, mode=0o700, exist_ok=True)
            self.workdir = tempfile.mkdtemp(prefix=f"job-{group_id}-", dir=parent)
            self.key_file = os.path.join(self.workdir, "key.hex")
        try:
            ready, store = super().launch(group_id, choice, opts, threads, tmp, relay)
        except AdmissionStopped:
            state, reason = self._wait.ended
            said, job = self.job_output(), self.job_id
            self.close()
            raise NbdistError(
                f"SLURM job {job} ended before its ranks joined: {state}"
                + (f" ({reason})" if reason else "") + "."
                + (f"\n--- the job's output (last lines) ---\n{said}" if said else "")
                + "\nCheck that the nodes have the same Python, torch and nbdist "
                f"({self.python}) and reach this notebook at {self.address[0]}: "
                "docs/multinode.md.") from None
        except BaseException as err:
            if self.job_id is not None and self.progress:
                why = "Ctrl-C" if isinstance(err, KeyboardInterrupt) else type(err).__name__
                print(f"nbdist: cancelled SLURM job {self.job_id} ({why} while its ranks were "
                      "joining).", file=sys.stderr)
            self.close()
            raise
        finally:
            if self._wait is not None:
                self._wait.close()
        if self._wait is not None:
            self.nodes = slurm_cli.hostnames(self._wait.state[2])
            self._wait = None
        elif not self.nodes:  # reattached
            self.nodes = slurm_cli.hostnames(slurm_cli.job_state(self.job_id)[2])
        if self.keep_alive and self._link is not None:  # the ranks outlive this kernel now
            open(os.path.join(self.workdir, "released"), "w").close()
        return ready, store

    def listening(self, host, port, world_size):
        """Submit the job (SLURM's refusal comes back here, before anything waits); when
        reattaching, say which job's ranks are awaited."""
        if self.reattach_key:
            if self.progress:
                print(f"nbdist: reattaching to SLURM job {self.job_id}: its {world_size} ranks "
                      f"connect to {host}:{port}.")
            return
        path = os.path.join(self.workdir, "job.sh")
        with open(path, "w", encoding="utf-8") as f:
            f.write(slurm_cli.batch_script(
                self.directives + [f"--output={os.path.join(self.workdir, 'job-%j.out')}"],
                self.env, self.python, f"{host}:{port}", self.key_file, self.nproc_per_node))
        self.job_id = slurm_cli.submit(path)
        self._link = slurm_cli.owner_link(self.job_id, os.path.join(self.workdir, "released"))
        if self.progress:
            print(f"nbdist: submitted SLURM job {self.job_id} for {world_size} ranks; they "
                  f"connect to {host}:{port}. Ctrl-C cancels it.")
        self._wait = _Wait(self.job_id, world_size, self.progress)

    def _admission(self, ws, config, relay, progress):
        admission = _SlurmAdmission(ws, config, relay, False)
        admission.protect, admission.launcher = self.protect, self
        if self._wait is not None:
            admission.wake, admission.waiting = self._wait.wake, self._wait
        return admission

    def handle_fields(self):
        """The job, its files and its layout, saved for ``nbdist.reattach()``."""
        return {"job": self.job_id, "workdir": self.workdir,
                "tasks_per_node": self.nproc_per_node}

    def job_output(self, lines: int = 12) -> str:
        """The last lines the job's batch script and srun wrote (``""`` if none)."""
        if not self.workdir or not self.job_id:
            return ""
        try:
            with open(os.path.join(self.workdir, f"job-{self.job_id}.out"),
                      encoding="utf-8", errors="replace") as f:
                return "\n".join(f.read().strip().splitlines()[-lines:])
        except OSError:
            return ""

    def death_note(self) -> str:
        """What SLURM says about the job's nodes that are down (with the ranks on them) and about
        the job, when a rank was lost (``""``: nothing unusual)."""
        parts = []
        for name, (state, reason) in slurm_cli.node_states(self.nodes).items():
            # a reason is set when a node is taken down (by SLURM or an admin), even while sinfo
            # shows it as completing its jobs
            if (reason or slurm_cli.unhealthy(state)) and name in self.nodes:
                index = str(self.nodes.index(name))
                on = [r.rank for r in self._current if getattr(r.process, "node", "") == index]
                parts.append(f"SLURM says node {name} ({ranks_phrase(on) if on else 'no rank'}) "
                             f"is {state}" + (f": {reason}" if reason else ""))
        if self.job_id:
            state, reason, _ = slurm_cli.job_state(self.job_id)
            if state and state not in ("RUNNING", "COMPLETING"):
                parts.append(f"job {self.job_id} is {state}" + (f" ({reason})" if reason else ""))
        return "; ".join(parts)

    def node_name(self, node: str) -> str:
        """SLURM's name of node number ``node`` of the job (``""`` if unknown)."""
        try:
            return self.nodes[int(node)]
        except (ValueError, IndexError):
            return ""

    def close(self, deadline=None) -> None:
        """Cancel the job, end the owner link, remove the job's files (once; to the end); a
        generation still joining is ended by ``deadline`` (see :meth:`AttachLauncher.close`)."""
        letting_go = self.letting_go  # a reattach that failed: the job's ranks wait on
        super().close(deadline)
        job, self.job_id = self.job_id, None
        if job is not None and not letting_go:
            slurm_cli.cancel(job)
        link, self._link = self._link, None
        if link is not None:
            link.kill()
            link.wait()
        if self.workdir and not letting_go:
            shutil.rmtree(self.workdir, ignore_errors=True)


class SlurmProcess(EngineProcess):
    """A rank in the SLURM job: placed by its SLURM node, and lost with what SLURM says."""

    launcher: SlurmLauncher
    #: what a lost rank's error tells to do (instead of an attached group's "re-run the launcher")
    lost_advice = ("nbdist does not restart the ranks of a SLURM job: call stop(), then "
                   "nbdist.start(..., on='slurm') again (a new job)")

    @property
    def where(self) -> str:
        """``"node 1: n2, host gpu7"``."""
        name = self.launcher.node_name(self.node)
        return f"node {self.node}: {name}, host {self.host}" if name else super().where

    def engine_note(self) -> str:
        """SLURM's word on the job's nodes that are down and on the job."""
        try:
            return self.launcher.death_note()
        except (OSError, ValueError, slurm_cli.subprocess.TimeoutExpired):
            return ""


class _SlurmAdmission(EngineAdmission):
    """Ranks of the job: counted on the wait's display; their processes know their SLURM node."""

    process_class = SlurmProcess
    launcher: SlurmLauncher
    waiting: Optional["_Wait"] = None

    def timed_out(self, missing, ranks, timeout):
        return (super().timed_out(missing, ranks, timeout) + f" (SLURM job "
                f"{self.launcher.job_id}: {' '.join(self.waiting.state[:2]) if self.waiting else '?'})")


class _Wait:
    """The job's state while its ranks are not all there, read once a second on
    ``nbdist-slurm-wait`` and shown; :attr:`wake` turns readable if the job ends first."""

    PERIOD = 1.0

    def __init__(self, job_id: str, world_size: int, progress: bool):
        self.job_id, self.t0 = job_id, time.monotonic()
        self.state = ("PENDING", "", "")
        self.ended: Optional[tuple] = None
        self.wake, self._poke = socket.socketpair()
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=world_size, desc=self._describe(), unit="rank")
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nbdist-slurm-wait", daemon=True)
        self._thread.start()

    def _describe(self) -> str:
        state, reason, nodes = self.state
        if state == "RUNNING":
            return f"SLURM job {self.job_id} RUNNING on {nodes}: ranks joined"
        return (f"SLURM job {self.job_id} {state}" + (f" ({reason})" if reason else "")
                + f", waited {time.monotonic() - self.t0:.0f} s")

    def _run(self) -> None:
        while True:
            try:
                self.state = slurm_cli.job_state(self.job_id)
            except (OSError, slurm_cli.subprocess.TimeoutExpired):
                pass  # slurmctld busy: try again
            else:
                if self.state[0] not in slurm_cli.LIVE:
                    self.ended = (self.state[0] or "no longer known to SLURM", self.state[1])
                    self._poke.send(b"!")
                    return
            if self.bar is not None:
                self.bar.set_description(self._describe())
            if self._done.wait(self.PERIOD):
                return

    def joined(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        self._done.set()
        self._thread.join(20.0)
        if self.bar is not None:
            self.bar.set_description(self._describe())
            self.bar.close()
        self.wake.close()
        self._poke.close()
