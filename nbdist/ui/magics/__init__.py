"""IPython magics: ``%load_ext nbdist``, then run cells on the ranks of a group.

=====================  =================================================================
``%dist_start``        start a group (``-n N``, ``--backend``, ``--device``, ``--timeout``;
                       ``--init-timeout``, ``--threads``, ``--max-world-size``)
``%%dist``             run the cell on the ranks (``--ranks 0,2``, ``--timeout S``, ``-q``)
``%dist statement``    the one-line form (end the options with ``--`` if needed)
``%autodist``          every cell runs on the ranks until ``%autodist`` again
``%dist_push a b``     copy kernel variables to the ranks; ``%dist_pull x [--rank R]`` back
``%dist_status``       per-rank table; ``%dist_restart``, ``%dist_stop``
``%%dist --bg NAME``   run the cell in the background; ``%dist_jobs``, ``%dist_wait NAME``,
                       ``%dist_watch NAME`` (the live view)
=====================  =================================================================

Each magic prints its help with ``%dist_start?``; wrong arguments raise ``UsageError``.

The current group
    The magics work on one *current group*: the one ``%dist_start`` started, or one started in
    code and attached with :func:`use_group`. Code gets the same object from
    :func:`current_group`, so ``g = current_group(); g.run(fn)`` and ``%%dist`` share the ranks.

Output
    What the ranks print arrives while the cell runs, in that cell, one ``[rank r]`` line each
    (the group relays it in the context of the call, which ipykernel >= 7 routes to the cell that
    made the call). The value of a cell's last expression is shown per rank, ``Out[rank r]:``,
    with the object's rich representation where it has one.

Adding magics (``%dist_bench``, ``%dist_mem``, ``%dist_ui``)
    Another module subclasses :class:`NbdistMagics` (``self.group``, ``self.parse``), decorates
    the class with IPython's ``@magics_class`` and with :func:`register_magics`. Registered classes
    are loaded by ``%load_ext nbdist`` (and added at once to a shell that has it loaded already),
    and removed by ``%unload_ext nbdist``.
"""
from __future__ import annotations

import sys

from ...runtime.api import stop_for_exit
from ...runtime.current import say_once
from ...runtime import spares
from ...runtime.forkserver import close_helpers
from ...runtime.group import current_group, use_group
from . import base
from .base import NbdistMagics, register_magics, usage
from .core import DistMagics  # registered first: the core magics
from . import debug, jobs, tools, widgets  # noqa: E402,F401,I001 -- the other magics

__all__ = ["DistMagics", "NbdistMagics", "current_group", "load_ipython_extension",
           "register_magics", "unload_ipython_extension", "usage", "use_group"]


def load_ipython_extension(shell) -> None:
    """Register the magics of every registered class; loading again changes nothing.

    Also gets workers ready in the background (the forkserver, or warm spares where workers are
    spawned: :func:`nbdist.runtime.launcher.prewarm`), so the first ``%dist_start`` is quick.
    """
    from ...runtime.launcher import prewarm
    from ..cells import install

    prewarm()
    install(shell)  # code from a cell shows on the ranks as "Cell In[5], line 4"
    kernel = getattr(shell, "kernel", None)  # ipykernel's; None in a terminal IPython
    if kernel is not None and not hasattr(kernel.do_shutdown, "nbdist_original"):
        kernel.do_shutdown = _stopping_first(kernel.do_shutdown)
    if kernel is not None:  # a job's output under its cell, in a saved notebook too
        from ...runtime import output
        from ..joboutput import job_display

        output.JOB_DISPLAY = job_display
    for cls in base._magic_classes:
        if cls.__name__ not in shell.magics_manager.registry:
            shell.register_magics(cls)
    for event, hook in (("pre_run_cell", _before_cell), ("post_run_cell", _after_cell)):
        if hook not in shell.events.callbacks[event]:
            shell.events.register(event, hook)


def _stopping_first(do_shutdown):
    """The kernel's shutdown (and restart) handler, after nbdist has stopped every group (but those
    with keep_alive, which wait for the next kernel) and ended its helper processes: ipykernel then finds no child to wait for, and nbdist's cleanup runs
    before Jupyter's deadline for the kernel to exit (:func:`~nbdist.runtime.forkserver.close_helpers`)."""
    def shutdown(restart):
        try:
            stop_for_exit()  # a keep_alive group waits for the next kernel
            close_helpers()
            spares.close()
        except Exception as err:  # noqa: BLE001 -- the kernel must still shut down
            print(f"nbdist: stopping the groups before the kernel's shutdown failed: {err!r}",
                  file=sys.__stderr__)
        return do_shutdown(restart)

    shutdown.nbdist_original = do_shutdown
    return shutdown


def _before_cell(info=None) -> None:
    """Before a cell that imports Lightning: the idle groups' ranks import it too, meanwhile."""
    _warm(getattr(info, "raw_cell", None) or "")


def _after_cell(result=None) -> None:
    """After each cell: once the kernel has imported Lightning, the idle groups' ranks import it
    too (:mod:`nbdist.lightning.warmup`), so the first fit doesn't wait for it."""
    _warm(None)


def _warm(source) -> None:
    from ...lightning.warmup import warm_groups

    try:
        warm_groups(source)
    except Exception as exc:  # noqa: BLE001 -- a hook must not break the user's cell
        say_once(f"nbdist: could not import Lightning on the ranks ahead of the first fit "
                 f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                 "fit() will import it when it runs.")


def unload_ipython_extension(shell) -> None:
    """Remove the magics, turn ``%autodist`` off and stop the groups the magics started."""
    for cls in base._magic_classes:
        magics = shell.magics_manager.registry.pop(cls.__name__, None)
        if magics is None:
            continue
        if isinstance(magics, DistMagics):
            magics.autodist_off()
        for kind in ("line", "cell"):
            for name in magics.magics[kind]:
                shell.magics_manager.magics[kind].pop(name, None)
    for event, hook in (("pre_run_cell", _before_cell), ("post_run_cell", _after_cell)):
        if hook in shell.events.callbacks[event]:
            shell.events.unregister(event, hook)
    from ...runtime import output

    output.JOB_DISPLAY = None
    for group in list(base._started):
        group.stop()
    if current_group() is not None and current_group().state == "stopped":
        use_group(None)
