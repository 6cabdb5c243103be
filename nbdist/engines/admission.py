"""The admission of an engine's ranks: the rank's process is the engine's own kind of
:class:`EngineProcess` (where it runs, what the engine says when it is lost, what to do then), and
each join is counted on the engine's live wait, when it shows one."""
from __future__ import annotations

from typing import Any, Optional, Type

from ..errors import ExitStatus
from ..runtime.attach import _Remote
from ..runtime.processes import RemoteProcess
from ..runtime.ranks import Rank


class EngineProcess(RemoteProcess):
    """A rank an engine placed: lost as an attached rank is, with the engine's word on why
    (:meth:`engine_note`, asked once) added to the loss."""

    launcher: Any = None  #: the engine's launcher (set at admission)
    _note: Optional[str] = None

    def engine_note(self) -> str:
        """What the engine says about this rank's loss (``""``: nothing unusual, or it could not
        be asked). A subclass asks its engine and never raises."""
        return ""

    @property
    def exit_status(self) -> Optional[ExitStatus]:
        """As an attached rank's, with the engine's word (:meth:`engine_note`) when it was lost."""
        status = super().exit_status
        if status is None or not status.lost:
            return status
        if self._note is None:
            self._note = self.engine_note()
        if not self._note:
            return status
        return ExitStatus(lost=True, where=status.where,
                          why=(status.why + "; " if status.why else "") + self._note)


class EngineAdmission(_Remote):
    """Admits the ranks an engine started; a launcher sets :attr:`launcher` and, while it shows
    the job's wait, :attr:`waiting` (anything with a ``joined()``)."""

    process_class: Type[RemoteProcess] = EngineProcess  #: the engine's process class
    launcher: Any = None  #: given to each rank's process (its ``where`` and loss advice ask it)
    waiting: Optional[Any] = None

    def control(self, hello, channel, ranks):
        r = super().control(hello, channel, ranks)
        if r is None:
            return None
        p = r.process
        process = self.process_class(p.rank, p.pid, p.host, p._relay, p.node, channel)
        process.launcher = self.launcher
        return Rank(r.rank, process, channel=channel)

    def joined(self, rank):
        if self.waiting is not None:
            self.waiting.joined()
        else:
            super().joined(rank)
