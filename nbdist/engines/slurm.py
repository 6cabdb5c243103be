"""``on="slurm"``: a group whose ranks run in one SLURM job, submitted from the notebook.

``nbdist.slurm.start(4, nodes=2, partition="gpu", time="1:00:00")`` (or
``nbdist.start(4, on="slurm", ...)``, or ``%dist_start -n 4 --on slurm --nodes 2 ...``) submits one
``sbatch`` job; its ``srun`` step runs ``python -m nbdist.worker --connect`` on every task, and the
ranks join the notebook as an attached group's do. Why sbatch and not salloc: a batch job needs
no terminal and no process of the notebook's to hold the allocation -- the job lives in SLURM's
queue, where ``squeue`` shows it and ``scancel`` (or the group's ``stop()``) ends it, and it ends by
itself when its ranks exit; an ``salloc`` would be one more process to keep alive beside the kernel
and to clean up when the kernel is killed. See docs/multinode.md.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional, Sequence

from ..runtime.attach import parse_listen
from . import slurm_cli
from .base import Engine
from .slurm_cli import missing_command
from .slurm_launcher import SlurmLauncher

__all__ = ["SlurmEngine", "start"]

#: ``#SBATCH`` options nbdist writes from keyword options (the rest go in ``sbatch_args``)
DIRECTIVES = ("partition", "time", "account", "qos", "gres", "constraint")


class SlurmEngine(Engine):
    """The SLURM engine: one ``sbatch`` job per group (see :func:`start` for the options)."""

    name = "slurm"
    options = ("nodes", "ntasks_per_node") + DIRECTIVES + (
        "sbatch_args", "env", "job_name", "python", "listen", "workdir", "join_timeout",
        "progress", "protect")

    @classmethod
    def unusable(cls) -> Optional[str]:
        """``"no sbatch on PATH"`` (or another of SLURM's commands) where SLURM is not here."""
        return missing_command()

    @classmethod
    def ended(cls, handle) -> str:
        """``""`` while SLURM runs (or queues) the handle's job, else what SLURM says."""
        why = missing_command()
        if why:
            return f"SLURM is not reachable here: {why}"
        state, reason, _ = slurm_cli.job_state(str(handle["job"]))
        if state in slurm_cli.LIVE and state != "COMPLETING":
            return ""
        return (f"SLURM job {handle['job']} is {state}" + (f" ({reason})" if reason else "")
                if state else f"SLURM no longer knows job {handle['job']}")

    def reattach(self, handle, join_timeout: float, progress: bool) -> SlurmLauncher:
        """A :class:`SlurmLauncher` that reconnects to the running job of ``handle``."""
        launcher = SlurmLauncher([], {}, sys.executable, int(handle.get("tasks_per_node") or 1),
                                 tuple(handle["address"]), None, join_timeout, progress,
                                 bool(handle.get("protect")))
        launcher.job_id, launcher.workdir = str(handle["job"]), handle.get("workdir")
        return launcher

    def launcher(self, world_size: int, nodes: Optional[int] = None,
                 ntasks_per_node: Optional[int] = None, partition: Optional[str] = None,
                 time: Optional[str] = None, account: Optional[str] = None,
                 qos: Optional[str] = None, gres: Optional[str] = None,
                 constraint: Optional[str] = None, sbatch_args: Sequence[str] = (),
                 env: Optional[Dict[str, str]] = None, job_name: Optional[str] = None,
                 python: Optional[str] = None, listen: Optional[str] = None,
                 workdir: Optional[str] = None, join_timeout: float = 24 * 3600.0,
                 progress: bool = True, protect: Optional[bool] = None) -> SlurmLauncher:
        """A :class:`SlurmLauncher` for these options, checked before anything is submitted."""
        nodes, per_node = layout(world_size, nodes, ntasks_per_node)
        if isinstance(sbatch_args, str):
            raise TypeError("sbatch_args must be a list of arguments, e.g. ['--mem=8G', "
                            f"'--exclusive'], got the string {sbatch_args!r}")
        # --no-requeue: after a node failure SLURM would run the job again later, with nobody
        # listening for its ranks
        directives: List[str] = [f"--job-name={job_name or 'nbdist'}", f"--nodes={nodes}",
                                 f"--ntasks-per-node={per_node}", "--no-requeue"]
        given = dict(partition=partition, time=time, account=account, qos=qos, gres=gres,
                     constraint=constraint)
        directives += [f"--{k}={v}" for k, v in given.items() if v is not None]
        directives += [str(a) for a in sbatch_args]
        job_env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
        job_env.update({str(k): str(v) for k, v in (env or {}).items()})
        address = parse_listen(listen) if listen else (default_host(), 0)
        return SlurmLauncher(directives, job_env, python or sys.executable, per_node, address,
                             workdir, join_timeout, progress, protect)


def layout(world_size: int, nodes: Optional[int], ntasks_per_node: Optional[int]):
    """``(nodes, tasks per node)`` for ``world_size`` ranks; ``ValueError`` when they do not
    fit together."""
    for name, v in (("nodes", nodes), ("ntasks_per_node", ntasks_per_node)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    given = ntasks_per_node
    if nodes is None and ntasks_per_node is None:
        nodes = 1
    if nodes is None:
        nodes = -(-world_size // ntasks_per_node)
    if ntasks_per_node is None:
        ntasks_per_node = max(1, world_size // nodes)
    if nodes * ntasks_per_node != world_size:
        raise ValueError(f"world_size={world_size} does not divide into nodes={nodes}"
                         + (f" x ntasks_per_node={given}" if given else "")
                         + ": every node runs the same number of ranks. Pass a world_size that "
                         f"is a multiple of nodes (e.g. {nodes * max(1, world_size // nodes)} or "
                         f"{nodes * (world_size // nodes + 1)}), or another number of nodes.")
    return nodes, ntasks_per_node


def default_host() -> str:
    """The address the compute nodes reach this notebook at, by default: this host name's."""
    import socket

    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def start(world_size: int, backend: Optional[str] = "auto", device: Optional[str] = "auto",
          timeout: float = 60.0, **options):
    """Submit one SLURM job that runs ``world_size`` ranks; return the :class:`~nbdist.Group`
    once they all joined.

    ``keep_alive`` (``"30m"``, or seconds) keeps the job's ranks, their variables and their
    process group alive that long after this kernel dies or restarts: ``nbdist.reattach()`` in
    a new kernel reconnects to them; with no kernel for that long they exit and the job ends.

    The job (``sbatch``) asks for ``nodes`` nodes (default 1) and ``ntasks_per_node`` tasks on each
    (default ``world_size // nodes``; they must multiply to ``world_size``), plus ``partition``,
    ``time``, ``account``, ``qos``, ``gres``, ``constraint`` as given, and any other ``sbatch``
    argument in ``sbatch_args`` (a list). Its ``srun`` step runs
    ``python -m nbdist.worker --connect HOST:PORT`` on every task with ``python`` (default: this
    kernel's interpreter, which must exist on the nodes), the job's environment plus ``env``
    (``PYTHONPATH`` is passed on), and torchrun's variables. The ranks connect to ``listen``
    (``"HOST:PORT"``; default this host's address, port chosen by the system); the group key and
    the job's files are in ``workdir`` (default ``~/.nbdist/slurm``: it must be visible on the
    nodes, as a shared home is), removed when the group stops.

    While the job waits the cell shows its state (PENDING and SLURM's reason, the time waited,
    the job id); Ctrl-C cancels it, and so do ``stop()``, the kernel's exit and a killed kernel.
    Options SLURM refuses raise its own message before anything waits. Other options are the
    group's (:class:`~nbdist.Group`); ``restart()`` is refused (start a new job).
    """
    from ..runtime.engines import start_on

    return start_on("slurm", world_size, backend, device, timeout, options)
