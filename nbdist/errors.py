"""The exceptions nbdist raises.

Every error nbdist raises on purpose derives from :class:`NbdistError`::

    NbdistError
    ├── RemoteError          user code raised on one or more ranks (remote tracebacks attached)
    ├── RankDiedError        a worker process exited or was killed (exit code / signal, stderr tail)
    ├── DistTimeoutError     a call or the rendezvous did not finish in time (names the ranks)
    ├── GroupInterrupted     the caller interrupted a call (says which ranks were killed)
    ├── BackendError         a backend is unknown or not available here (also a ``ValueError``)
    ├── GroupClosedError     the group was stopped, or must be restarted before use
    └── GroupBusyError       a background job (or another thread) holds the group

User mistakes in arguments (a world size of 0, a device name nbdist does not know) raise plain
``ValueError`` / ``TypeError`` with a message that says what was expected.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence


def ranks_phrase(ranks) -> str:
    """``[3]`` -> ``"rank 3"``, ``[0, 2]`` -> ``"ranks 0, 2"``: how every message names ranks."""
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


class NbdistError(Exception):
    """Base class of every error nbdist raises on purpose."""

    def _render_traceback_(self) -> List[str]:
        # In IPython/Jupyter: the message says what happened; nbdist's own frames would not help.
        return [f"\x1b[31m{type(self).__name__}\x1b[0m: {line}" if i == 0 else line
                for i, line in enumerate(str(self).splitlines() or [""])]


class BackendError(NbdistError, ValueError):
    """A backend was asked for that is unknown or not usable on this machine."""


class GroupClosedError(NbdistError):
    """The group was stopped, or is broken and needs ``restart()`` before the next call."""


class GroupBusyError(NbdistError):
    """A call needs the group while a background job runs on it (``job`` is that job), or
    ``stop(timeout)`` could not stop a group that another thread holds (``job`` is ``None``)."""

    def __init__(self, message: str, job=None):
        self.job = job
        super().__init__(message)


class JobPausedError(NbdistError):
    """A background job is paused at a breakpoint (``job`` is that job): waiting for its result
    would last until someone attaches a debugger (``%dist_debug NAME``, ``job.debug()``)."""

    def __init__(self, message: str, job=None):
        self.job = job
        super().__init__(message)


class RemoteError(NbdistError):
    """User code raised an exception on one or more ranks.

    Attributes:
        failures: ``{rank: RemoteFailure}`` for every rank that raised, in rank order.
        results: per-rank results where a rank succeeded, ``None`` where it failed.
        advice: what the failure did to the group and what to do (``""``: the group is usable).
        hint: torch's error in plain words, and what nbdist saw on the ranks (``seen``: the
            collective each failed rank raised in, from the collective recorder); ``""`` if none.
    """

    def __init__(self, failures: Dict[int, "RemoteFailure"], results: Optional[List] = None,
                 world_size: Optional[int] = None, advice: str = "", seen: str = ""):
        self.failures = dict(sorted(failures.items()))
        self.results = results
        self.world_size = world_size
        self.advice = advice
        root = self.root_cause
        head = f"{root.type_name} on {ranks_phrase(self.failures)}{_places(self.failures)}: " \
               f"{root.message}"
        if len(self.failures) > 1:
            head += f"\n(root cause: rank {root.rank}, the first failure observed)"
        # a plain-words reading of torch's error, then what nbdist saw on the ranks (``seen``)
        self.hint = " ".join(filter(None, (
            hint_for(" ".join(f.message for f in self.failures.values())), seen)))
        if self.hint:
            head += f"\nnbdist: {self.hint}"
        if advice:
            head += f"\nnbdist: {advice}"
        super().__init__(head + "\n\n" + root.traceback.rstrip())

    @property
    def root_cause(self) -> "RemoteFailure":
        """The failure observed first (earliest timestamp on the ranks)."""
        return min(self.failures.values(), key=lambda f: (f.time, f.rank))

    @property
    def ranks(self) -> List[int]:
        """The ranks that raised, sorted."""
        return list(self.failures)

    def _render_traceback_(self) -> List[str]:
        # IPython calls this instead of printing nbdist's own frames: show the remote tracebacks.
        lines: List[str] = []
        for failure in self.failures.values():
            lines.append(f"\x1b[31m--- rank {failure.rank}{_where(failure)} ---\x1b[0m")
            lines.extend(failure.traceback.rstrip().splitlines())
        if len(self.failures) > 1:
            lines.append(f"(root cause: rank {self.root_cause.rank}, the first failure observed)")
        if self.hint:
            lines.append(f"nbdist: {self.hint}")
        if self.advice:
            lines.append(f"\x1b[31mnbdist: {self.advice}\x1b[0m")
        return lines


class RemoteFailure:
    """One rank's exception: type name, message, formatted traceback, and when it happened."""

    def __init__(self, rank: int, type_name: str, message: str, traceback: str, time: float,
                 exception: Optional[BaseException] = None):
        self.rank = rank
        self.type_name = type_name
        self.message = message
        self.traceback = traceback
        self.time = time
        self.exception = exception
        self.where = ""  #: ``"node 1, host gpu7"`` for a rank torchrun/srun started

    def __repr__(self) -> str:
        return f"RemoteFailure(rank={self.rank}, {self.type_name}: {self.message!r})"


class RankDiedError(NbdistError):
    """A worker process died: ``deaths`` maps rank to ``(ExitStatus, stderr_tail)``."""

    def __init__(self, deaths: Dict[int, tuple], detail: str = "", advice: str = ""):
        self.deaths = dict(sorted(deaths.items()))
        parts = []
        for rank, (code, tail) in self.deaths.items():
            parts.append(f"rank {rank}{_where(code)} {describe_exit(code)}")
        msg = "; ".join(parts)
        if detail[:1].islower():  # "... exited with code 7 while starting (...)."
            msg += " " + detail
        else:
            msg += "." + (" " + detail if detail else "")
        for rank, (code, tail) in self.deaths.items():
            if tail:
                msg += f"\n--- rank {rank}{_where(code)} stderr (last lines) ---\n{tail.rstrip()}"
        msg += "\n" + (advice or "The group was shut down; call restart() to bring it back "
                                  "(per-rank variables are lost).")
        super().__init__(msg)

    @property
    def ranks(self) -> List[int]:
        """The ranks that died, sorted."""
        return list(self.deaths)


def _places(failures) -> str:
    """`` (node 1, host h)`` / `` (rank 0: node 0, host h; rank 1: ...)``; ``""``: local ranks."""
    placed = [(r, f.where) for r, f in failures.items() if getattr(f, "where", "")]
    if len(placed) == 1 and len(failures) == 1:
        return f" ({placed[0][1]})"
    return f" ({'; '.join(f'rank {r}: {w}' for r, w in placed)})" if placed else ""


def _where(status) -> str:
    where = getattr(status, "where", "")
    return f" ({where})" if where else ""


class DistTimeoutError(NbdistError, TimeoutError):
    """A call (or the rendezvous) did not finish in time; ``ranks`` are the ones still running.
    ``stacks``: where they were when the time ran out, before any was interrupted or killed
    (an :class:`nbdist.runtime.stacks.Stacks`; ``None`` where none was taken)."""

    def __init__(self, message: str, ranks: Sequence[int] = (), stacks=None):
        self.ranks = list(ranks)
        self.stacks = stacks
        super().__init__(message)


class GroupInterrupted(NbdistError):
    """The caller interrupted a call (Ctrl-C / the notebook's interrupt button).

    Attributes:
        interrupted: ranks that stopped on SIGINT.
        killed: ranks that were still blocked (e.g. inside a collective) and were killed.
    """

    def __init__(self, message: str, interrupted: Sequence[int] = (), killed: Sequence[int] = ()):
        self.interrupted = list(interrupted)
        self.killed = list(killed)
        super().__init__(message)


@dataclass(frozen=True)
class ExitStatus:
    """How a rank's process ended: its exit ``code`` (negative: killed by signal ``-code``), or
    ``lost`` for a rank on another host whose connection broke (its exit code is unknown here)."""

    code: Optional[int] = None
    lost: bool = False
    #: where the rank ran, for ranks on other hosts (``"node 1, host gpu7"``); not compared
    where: str = field(default="", compare=False)
    why: str = ""  #: for ``lost``: why the connection broke, when the controller knows

    def describe(self) -> str:
        """``exited with code 3`` / ``was killed by SIGKILL (exit code -9)`` / ``lost ...``."""
        return describe_exit(self)


def describe_exit(code) -> str:
    """Turn an exit code (or an :class:`ExitStatus`) into words: ``exited with code 3`` /
    ``was killed by SIGKILL``."""
    import signal

    if isinstance(code, ExitStatus):
        if code.lost:
            return "lost its connection to the controller" + (
                f": {code.why}" if code.why else
                " (the process died or its host is unreachable)")
        code = code.code
    if code is None:
        return "died (exit status unknown)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"


# What torch/gloo error texts mean, in plain words (seen with torch 2.13; see FACTS-TORCH.md).
_HINTS = (
    ("Received data size doesn't match",
     "This is a collective mismatch: ranks called the same collective with different tensor "
     "shapes or dtypes. Start the group with debug='detail' (TORCH_DISTRIBUTED_DEBUG=DETAIL) to "
     "see each rank's call."),
    ("Detected mismatch between collectives",
     "The ranks ran different collectives (or different shapes) at the same step; the message "
     "lists each rank's call."),
    ("for recv operation to complete",
     "A rank did not enter the collective within the group timeout: it is stuck, or the ranks ran "
     "different collectives."),
    ("for send operation to complete",
     "A rank did not enter the collective within the group timeout: it is stuck, or the ranks ran "
     "different collectives."),
    ("Application timeout caused pair closure",
     "The process group is dead after an earlier timeout; call restart()."),
    ("Connection closed by peer",
     "Another rank died during the collective; see which one in the group's status."),
    ("Connection reset by peer",
     "Another rank died during the collective; see which one in the group's status."),
    ("failed to pass monitoredBarrier", "The message names the ranks that are stuck."),
)


def hint_for(text: str) -> Optional[str]:
    """A plain-words explanation of a torch/gloo error text, or ``None``."""
    for needle, hint in _HINTS:
        if needle in text:
            return hint
    return None
