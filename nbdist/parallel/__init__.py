"""Beyond data parallel: pipelines (and device meshes) over a group's ranks.

:func:`pipeline` splits an ``nn.Sequential`` into stages over the ranks and trains it with a
``torch.distributed.pipelining`` schedule (GPipe, 1F1B, interleaved 1F1B); its
:meth:`Pipeline.timeline` measures where each rank waits (:class:`Timeline`: a table, the bubble
against the schedule's theory, a Gantt chart).

May import: nbdist.runtime and below (backends, wire, errors, report), torch. Not strategies,
memory, bench or ui (above it); a record's ``.plot()`` loads :mod:`nbdist.ui.plots` when called.
"""
from __future__ import annotations

from ._timeline import Timeline
from .pipeline import SCHEDULES, Pipeline, pipeline

__all__ = ["Pipeline", "SCHEDULES", "Timeline", "pipeline"]
