"""The cores this process may run on: what nbdist sizes its ranks' threads and chunks by."""
from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS has one (taskset,
    numactl, srun --cpu-bind, a cgroup cpuset), else every core."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)
