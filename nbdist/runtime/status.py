"""What ``Group.status()`` returns: per-rank state, as text for terminals and HTML for Jupyter; and
the checks of a group's options."""
from __future__ import annotations

import html
import socket
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..errors import ExitStatus
from .advice import option


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
    exit: Optional[ExitStatus] = None
    rss: Optional[int] = None
    last_error: str = ""
    node: str = ""  #: the node label of a rank torchrun/srun started (GROUP_RANK / SLURM_NODEID)

    @property
    def exitcode(self) -> Optional[int]:
        """The exit code (negative: the signal that killed it); ``None`` while running or lost."""
        return None if self.exit is None else self.exit.code

    def describe_state(self) -> str:
        """``busy: run f (2.1 s)`` / ``dead (exit -9)`` / ``idle``."""
        if self.state == "busy" and self.since is not None:
            return f"busy: {self.busy_with} ({time.time() - self.since:.1f} s)"
        if self.state == "dead":
            if self.exit is not None and self.exit.lost:
                return "dead (connection lost)"
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
    job: str = ""  #: the background job running, in one line ("" when none)

    @property
    def _columns(self):  # "node" only for ranks torchrun/srun started
        nodes = ("node",) if any(r.node for r in self.ranks) else ()
        return ("rank", "pid", "host") + nodes + ("device", "backend", "state", "memory (RSS)",
                                                  "last error")

    def _rows(self):
        nodes = any(r.node for r in self.ranks)
        for r in self.ranks:
            mem = f"{r.rss / 2**20:.0f} MiB" if r.rss is not None else "-"
            yield (str(r.rank), str(r.pid or "-"), r.host) + ((r.node,) if nodes else ()) + (
                r.device, r.backend, r.describe_state(), mem, r.last_error[:60])

    def __str__(self) -> str:
        cols = self._columns
        rows = [cols] + list(self._rows())
        widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
        lines = [f"group: {self.state}, world size {self.world_size}, backend {self.backend}, "
                 f"device {self.device}"] + ([self.job] if self.job else [])
        for row in rows:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self._columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                       for row in self._rows())
        return (f"<div class='nbdist-status'><b>nbdist group</b>: {html.escape(self.state)}, "
                f"world size {self.world_size}, backend <code>{html.escape(self.backend)}</code>, "
                f"device {html.escape(self.device)}"
                + (f"<br>{html.escape(self.job)}" if self.job else "")
                + f"<table><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table></div>")


def generation_note(ranks: List) -> str:
    """``" (generation 2, 4 ranks)"`` for ranks torchrun restarted; ``""`` for the first ones."""
    gen = max((getattr(r, "generation", 1) for r in ranks or ()), default=1)
    return f" (generation {gen}, {len(ranks)} ranks)" if gen > 1 else ""


def backend_name(config: str) -> str:
    """torch's backend config as one name when every device uses the same backend
    (``"cpu:gloo,cuda:gloo"`` -> ``"gloo"``); a mixed one (``"cpu:gloo,cuda:nccl"``) as it is."""
    names = {part.rpartition(":")[2].strip() for part in config.split(",")}
    return names.pop() if len(names) == 1 else config


def collect_status(state: str, world_size: int, backend: str, device: str,
                   ranks: List, job: str = "") -> GroupStatus:
    """A :class:`GroupStatus` from a group's ranks (reads them without locks: safe from any thread;
    a row may be one step behind a call that is running)."""
    import psutil

    rows = []
    for r in ranks:
        info = r.info or {}
        rss = None
        rstate = r.state
        if r.exit_status is not None and rstate not in ("stopped",):
            rstate = "dead"
        elif rstate not in ("stopped", "dead") and \
                info.get("host") in (None, socket.gethostname()):  # RSS only for local pids
            try:
                rss = psutil.Process(r.pid).memory_info().rss
            except (psutil.Error, TypeError):
                pass
        rows.append(RankStatus(r.rank, r.pid, info.get("host", "?"), info.get("device", "?"),
                               backend_name(str(info.get("backend", backend))), rstate,
                               r.busy_with if rstate == "busy" else "", r.since, r.exit_status,
                               rss, r.last_error, str(r.process.node)))
    return GroupStatus(state + generation_note(ranks), world_size, backend, device, rows, job)


MIN_TIMEOUT = 1.0  #: s: below it a group cannot even start (``timeout``, ``init_timeout``)
#: why each of those options cannot be shorter (the magics say the same)
TOO_SHORT = {"timeout": "the ranks' rendezvous and every collective must finish within it",
             "init_timeout": "the ranks need longer than that to start"}


def check_options(opts: Dict) -> None:
    """Refuse group options that cannot work, saying what was expected."""
    ws = opts["world_size"]
    if isinstance(ws, bool) or not isinstance(ws, int):
        raise TypeError(f"world_size must be an int, got {type(ws).__name__} ({ws!r})")
    if ws < 1:
        raise ValueError(f"world_size must be at least 1, got {ws}")
    for name in ("timeout", "call_timeout", "init_timeout", "grace", "stall"):
        v = opts.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if name in TOO_SHORT and v is not None and v < MIN_TIMEOUT:  # checked before a restart
            raise ValueError(f"{name} must be at least {MIN_TIMEOUT:g} s ({TOO_SHORT[name]}), "
                             f"got {v!r}")
    debug_env(opts.get("debug"))  # refuses a bad debug= value
    if opts["threads"] is not None and (not isinstance(opts["threads"], int)
                                        or opts["threads"] < 1):
        raise ValueError(f"threads must be a positive int, got {opts['threads']!r}")


#: ``debug=`` values: the level of torch's ``TORCH_DISTRIBUTED_DEBUG`` on the ranks (None: unset)
DEBUG_LEVELS = {"off": None, "detail": "DETAIL"}

#: said once, when a group starts with ``debug="detail"``
DETAIL_NOTE = ("nbdist: debug='detail' sets torch's TORCH_DISTRIBUTED_DEBUG=DETAIL on the ranks: "
               "every collective is checked against the other ranks' (a mismatch raises, naming "
               "each rank's call), at a store round trip per collective: it made a small "
               "training step 2.4x slower (docs/benchmarks.md). On torch 2.13 with "
               "gloo, a DDP model's backward pass crashes every rank (SIGSEGV) in this mode: use "
               "it without DDP (docs/troubleshooting.md).")


def debug_env(value) -> Dict[str, str]:
    """The ranks' environment for ``debug=value`` (``"detail"`` or ``True``: torch's
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``; ``"off"``, ``False`` or ``None``: nothing); a ValueError
    listing the accepted values for anything else."""
    if value is None or isinstance(value, bool):
        level = "DETAIL" if value else None
    elif isinstance(value, str) and value.lower() in DEBUG_LEVELS:
        level = DEBUG_LEVELS[value.lower()]
    else:
        raise ValueError(f"{option('debug')} got {value!r}; accepted: 'detail' (torch's "
                         "TORCH_DISTRIBUTED_DEBUG=DETAIL: collectives checked across ranks, a "
                         "mismatch named) or 'off' (the default); True and False mean the same")
    return {"TORCH_DISTRIBUTED_DEBUG": level} if level else {}
