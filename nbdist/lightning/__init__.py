"""Lightning inside nbdist's ranks: a plain ``Trainer`` in ``%%dist`` cells, or :func:`fit`.

Lightning's notebook path (``ddp_notebook``) forks the kernel; nbdist runs the ``Trainer`` in its
ranks, where torch.distributed is initialised and ``LOCAL_RANK`` & co. are set, so Lightning reuses
the group and starts no process. :func:`install_hooks` (run on the ranks by :func:`fit` and
:func:`prepare`) patches Lightning as soon as it is imported there, so that a plain ``Trainer``:

* uses :class:`NbdistEnvironment` unless given a cluster environment: ranks and world size come
  from torch.distributed, ``WORLD_SIZE`` survives ``fit``, and ``devices x num_nodes`` other than
  the group's world size is an error at ``Trainer(...)``, not a silent partial split of the data;
* refuses spawning strategies (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``) and child scripts;
* refuses a ``process_group_backend`` other than the group's, which Lightning would silently
  ignore; :func:`fit` honours it instead, re-forming the process group for the fit;
* trains DeepSpeed ZeRO 1-3 on CPU groups too: ``strategy="deepspeed_stage_3"`` and Lightning's
  ``DeepSpeedStrategy`` objects become :class:`NbdistDeepSpeedStrategy` (see
  :mod:`nbdist.lightning.deepspeed`); :func:`load_zero_checkpoint` reads the checkpoint back.

``import nbdist`` never imports Lightning; this module imports it only when used. Once the
kernel has imported Lightning, the ranks import it too, between calls (:func:`warm`; in a notebook
after each cell, by itself), so the first fit doesn't wait for it.
"""
from __future__ import annotations

from .deepspeed import load_zero_checkpoint, strategy_class
from .fit import FitResult, fit
from .guards import _FABRIC_OF, _environment_class, _installed_namespace, install_hooks
from .warmup import warm

__all__ = ["FitResult", "NbdistDeepSpeedStrategy", "NbdistEnvironment", "fit", "install_hooks",
           "load_zero_checkpoint", "prepare", "warm"]


def __getattr__(name: str):
    # They subclass Lightning's classes, so they are built on first use.
    if name == "NbdistEnvironment":
        return _environment_class(_FABRIC_OF[_installed_namespace()])
    if name == "NbdistDeepSpeedStrategy":
        return strategy_class(_installed_namespace())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def prepare(group) -> None:
    """Install nbdist's Lightning guards on every rank of ``group`` (:func:`fit` does it itself).

    Run it once per group before a plain ``Trainer`` in ``%%dist`` cells / ``group.exec``.
    """
    group.run(install_hooks)
