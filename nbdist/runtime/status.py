"""What ``Group.status()`` returns: per-rank state, as text for terminals and HTML for Jupyter."""
from __future__ import annotations

import html
import time
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class RankStatus:
    """One rank: ``state`` is ``"idle"``, ``"busy"``, ``"dead"`` or ``"stopped"``."""

    rank: int
    pid: Optional[int]
    host: str
    device: str
    backend: str
    state: str
    busy_with: str = ""
    since: Optional[float] = None
    exitcode: Optional[int] = None
    rss: Optional[int] = None
    last_error: str = ""

    def describe_state(self) -> str:
        """``busy: run f (2.1 s)`` / ``dead (exit -9)`` / ``idle``."""
        if self.state == "busy" and self.since is not None:
            return f"busy: {self.busy_with} ({time.time() - self.since:.1f} s)"
        if self.state == "dead":
            return f"dead (exit {self.exitcode})"
        return self.state


@dataclass
class GroupStatus:
    """The group: ``state`` is ``"ready"``, ``"busy"``, ``"broken"`` (needs restart) or ``"stopped"``."""

    state: str
    world_size: int
    backend: str
    device: str
    ranks: List[RankStatus] = field(default_factory=list)

    _COLUMNS = ("rank", "pid", "host", "device", "backend", "state", "memory", "last error")

    def _rows(self):
        for r in self.ranks:
            mem = f"{r.rss / 2**20:.0f} MiB" if r.rss is not None else "-"
            yield (str(r.rank), str(r.pid or "-"), r.host, r.device, r.backend,
                   r.describe_state(), mem, r.last_error[:60])

    def __str__(self) -> str:
        rows = [self._COLUMNS] + list(self._rows())
        widths = [max(len(row[i]) for row in rows) for i in range(len(self._COLUMNS))]
        lines = [f"group: {self.state}, world size {self.world_size}, backend {self.backend}, "
                 f"device {self.device}"]
        for row in rows:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self._COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                       for row in self._rows())
        return (f"<div class='nbdist-status'><b>nbdist group</b>: {html.escape(self.state)}, "
                f"world size {self.world_size}, backend <code>{html.escape(self.backend)}</code>, "
                f"device {html.escape(self.device)}<table><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table></div>")
