"""The interface of an engine: what :func:`nbdist.start` needs to place ranks with it."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple


class Engine:
    """Places the ranks of a group (``nbdist.start(world_size, on=NAME, **options)``).

    A subclass sets :attr:`name` and :attr:`options`, says in :meth:`unusable` why it cannot run
    here, and returns from :meth:`launcher` a :class:`~nbdist.runtime.launcher.Launcher` -- usually
    an :class:`~nbdist.runtime.attach.AttachLauncher` whose :meth:`listening
    <nbdist.runtime.attach.AttachLauncher.listening>` starts ``python -m nbdist.worker --connect``
    on every rank. Register it under the entry-point group ``nbdist.engines``.
    """

    name: str = ""  #: what ``on=`` names
    options: Tuple[str, ...] = ()  #: the keyword options of the engine's own

    @classmethod
    def unusable(cls) -> Optional[str]:
        """``None`` where the engine can run here, else why not (``"no sbatch on PATH"``)."""
        return None

    @classmethod
    def ended(cls, handle: Dict[str, Any]) -> str:
        """``""`` while the job of a saved ``keep_alive`` handle (:mod:`nbdist.runtime.handles`)
        may still run its ranks, else what ended it (``"SLURM says COMPLETED"``)."""
        return ""

    def reattach(self, handle: Dict[str, Any], join_timeout: float, progress: bool):
        """A launcher (an :class:`~nbdist.runtime.attach.AttachLauncher`) that takes back the
        ranks of ``handle``'s job; :func:`nbdist.reattach` sets its key and ``keep_alive``."""
        raise NotImplementedError(f"the engine {self.name!r} cannot reattach")

    def launcher(self, world_size: int, **options):
        """The launcher of a group of ``world_size`` ranks; raise on bad options before anything
        is submitted."""
        raise NotImplementedError
