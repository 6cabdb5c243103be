"""SLURM's side of ``on="slurm"``: the batch script nbdist submits, and SLURM's own commands
(``sbatch``, ``squeue``, ``scontrol``, ``scancel``) run as subprocesses -- SLURM's client is its
command line, so nothing is imported and nothing is needed beyond those commands on ``PATH``.

The job: ``sbatch`` gets a script whose one ``srun`` step starts every task as
``python -m nbdist.worker --connect HOST:PORT --key-file FILE``, with torchrun's variables set from
srun's (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``).
``--kill-on-bad-exit`` ends every task when one fails, so the job ends with its group.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import NbdistError

COMMANDS = ("sbatch", "squeue", "scontrol", "scancel")
WAITING = ("PENDING", "CONFIGURING", "REQUEUED", "RESIZING", "SUSPENDED")  #: before RUNNING
#: squeue states in which the job's tasks may run
LIVE = WAITING + ("RUNNING", "COMPLETING")


def missing_command() -> Optional[str]:
    """``"no sbatch on PATH"``, or ``None`` when SLURM's commands are all here."""
    for name in COMMANDS:
        if shutil.which(name) is None:
            return f"no {name} on PATH"
    return None


def batch_script(directives: Sequence[str], env: Dict[str, str], python: str, address: str,
                 key_file: str, tasks_per_node: int) -> str:
    """The script ``sbatch`` runs on the job's first node: ``#SBATCH`` lines, the environment,
    then the ``srun`` step of the ranks."""
    lines = ["#!/bin/bash"] + [f"#SBATCH {d}" for d in directives]
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(env.items())]
    task = ("export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID "
            f"LOCAL_WORLD_SIZE={tasks_per_node} GROUP_RANK=$SLURM_NODEID; "
            f"exec \"$0\" -m nbdist.worker --connect {address} --key-file {shlex.quote(key_file)}")
    lines.append(f"exec srun --kill-on-bad-exit=1 --unbuffered bash -c {shlex.quote(task)} "
                 f"{shlex.quote(python)}")
    return "\n".join(lines) + "\n"


def _run(args: List[str], timeout: float = 15.0) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def submit(script: str) -> str:
    """Submit the script (``sbatch --parsable``); the job id, or :class:`NbdistError` with
    SLURM's own message when it refuses the job (unknown partition, time over the limit...)."""
    done = _run(["sbatch", "--parsable", script])
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
        raise NbdistError(f"SLURM refused the job: {said}\n(sbatch {script}; nothing was "
                          "queued.) Fix the option SLURM names, or ask `sinfo` what the cluster "
                          "offers.")
    return done.stdout.strip().split(";")[0]


def job_state(job_id: str) -> Tuple[str, str, str]:
    """``(state, reason, nodelist)`` of the job: squeue while it is queued or runs, else
    scontrol (which remembers an ended job for a few minutes); ``("", "", "")`` if neither
    knows it."""
    done = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%r|%N"])
    line = done.stdout.strip().splitlines()
    if done.returncode == 0 and line:
        state, reason, nodes = (line[0].split("|") + ["", ""])[:3]
        return state, "" if reason == "None" else reason, nodes
    fields = show("job", job_id)
    return fields.get("JobState", ""), fields.get("Reason", "").replace("None", ""), \
        fields.get("NodeList", "").replace("(null)", "")


def show(kind: str, name: str) -> Dict[str, str]:
    """``scontrol show KIND NAME`` as ``{field: value}`` (empty if SLURM does not know it)."""
    done = _run(["scontrol", "-o", "show", kind, name])
    if done.returncode != 0:
        return {}
    fields: Dict[str, str] = {}
    key = None
    for word in done.stdout.strip().split(" "):
        k, sep, v = word.partition("=")
        if sep and k and k[0].isupper():
            fields[k], key = v, k
        elif key:  # a value with spaces (a node's Reason)
            fields[key] += " " + word
    return fields


def node_states(names: Sequence[str]) -> Dict[str, Tuple[str, str]]:
    """``{node: (state, reason)}`` as sinfo says (``("down", "Not responding")``...)."""
    if not names:
        return {}
    args = ["sinfo", "-h", "-N", "-n", ",".join(names), "-o", "%N|%T|%E"]
    done = _run(args)
    for _ in range(2):  # a busy slurmctld times a query out now and then: ask again
        if done.returncode == 0:
            break
        time.sleep(0.5)
        done = _run(args)
    out = {}
    for line in done.stdout.strip().splitlines() if done.returncode == 0 else []:
        name, state, reason = (line.split("|", 2) + ["", ""])[:3]
        out[name] = (state, "" if reason == "none" else reason)
    return out


def unhealthy(state: str) -> bool:
    """True for a node state in which its tasks cannot run (down, drained, not responding)."""
    return state.startswith(("down", "drain", "fail")) or "*" in state


def hostnames(nodelist: str) -> List[str]:
    """``"n[1-2]"`` -> ``["n1", "n2"]`` (the order of SLURM_NODEID)."""
    if not nodelist:
        return []
    done = _run(["scontrol", "show", "hostnames", nodelist])
    return done.stdout.split() if done.returncode == 0 else []


def cancel(job_id: str) -> None:
    """``scancel`` the job (nothing if it already ended)."""
    try:
        _run(["scancel", job_id])
    except (OSError, subprocess.TimeoutExpired) as err:
        print(f"nbdist: could not cancel SLURM job {job_id} ({err}); run `scancel {job_id}`.",
              file=sys.stderr)


def owner_link(job_id: str, stop_file: str) -> subprocess.Popen:
    """A small process in a session of its own that cancels the job once this process is gone
    (a SIGKILLed kernel) -- unless ``stop_file`` exists (the group let the job go)."""
    code = ("import os, subprocess, sys, time\n"
            "owner, job, stop = int(sys.argv[1]), sys.argv[2], sys.argv[3]\n"
            "while os.getppid() == owner and not os.path.exists(stop):\n"
            "    time.sleep(0.5)\n"
            "if not os.path.exists(stop):\n"
            "    subprocess.run(['scancel', job], timeout=60)\n")
    return subprocess.Popen([sys.executable, "-S", "-c", code, str(os.getpid()), job_id,
                             stop_file], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
