"""Engines that place a group's ranks on machines nbdist does not own: ``nbdist.start(world_size,
on="slurm", ...)``.

One module per engine, each importing its engine's client lazily (SLURM's is its command-line
tools, called as subprocesses). The runtime finds an engine by name (:mod:`nbdist.runtime.engines`:
built-in names, then the entry-point group ``nbdist.engines``), so an engine that is not asked for
is never imported, and a third party adds one by subclassing :class:`Engine` and registering it::

    [project.entry-points."nbdist.engines"]
    myengine = "my_package.engine:MyEngine"

Every rank an engine places runs ``python -m nbdist.worker --connect ADDR --key-file FILE``: it joins
the group as an attached rank does (:class:`~nbdist.runtime.attach.AttachLauncher`), so the
handshake, signing, output, stacks, jobs and debugging are one code path for all.

* :mod:`.base` -- :class:`Engine`, the interface; :mod:`.admission` -- the admission every
  engine's launcher uses (each rank's process is the engine's own kind, joins shown on its wait).
* :mod:`.slurm` -- ``on="slurm"``: one ``sbatch`` job whose ``srun`` step runs the ranks
  (:mod:`.slurm_launcher`: the launch, the live wait, a lost node as a rank death;
  :mod:`.slurm_cli`: the batch script and SLURM's commands).
* :mod:`.ray` -- ``on="ray"``: one placement group, one Ray actor per rank running the worker
  (:mod:`.ray_launcher`: place, preflight, start, watch, tear down; :mod:`.ray_session`: this
  kernel's connection to Ray; :mod:`.ray_actor`: the actor's body and the ranks' order).
* :mod:`.k8s` -- ``on="k8s"``: an Indexed Job, its headless Service and the key as a Secret
  (:mod:`.k8s_launcher`, :mod:`.k8s_manifests`, :mod:`.k8s_api`).

Threads: a SLURM launch runs ``nbdist-slurm-wait`` while the job waits and the ranks join: it reads
the job's state once a second, shows it, and wakes the launch when the job ended before its ranks
joined. It takes no lock of the group's. A Ray launch runs ``nbdist-ray-watch`` while its ranks
join: it polls the actors twice a second and wakes the launch when a worker exits or an actor dies
first; it takes no lock either.

May import: :mod:`nbdist.runtime` and below; never strategies, memory, bench, Lightning or the
notebook layer.
"""
from ..runtime.engines import ENTRY_POINT_GROUP, engines_here as available_engines
from .base import Engine

__all__ = ["ENTRY_POINT_GROUP", "Engine", "available_engines"]
