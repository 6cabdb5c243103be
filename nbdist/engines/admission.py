"""The admission of an engine's ranks: the rank's process is the engine's own kind of
:class:`~nbdist.runtime.processes.RemoteProcess` (where it runs, what to do when it is lost), and
each join is counted on the engine's live wait, when it shows one."""
from __future__ import annotations

from typing import Any, Optional, Type

from ..runtime.attach import _Remote
from ..runtime.processes import RemoteProcess
from ..runtime.ranks import Rank


class EngineAdmission(_Remote):
    """Admits the ranks an engine started; a launcher sets :attr:`launcher` and, while it shows
    the job's wait, :attr:`waiting` (anything with a ``joined()``)."""

    process_class: Type[RemoteProcess] = RemoteProcess  #: the engine's process class
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
