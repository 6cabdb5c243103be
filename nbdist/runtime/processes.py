"""The processes behind a group's ranks, and how the caller notices that one ended.

A rank's process is either a :class:`LocalProcess` (a worker nbdist started: it has a sentinel and
an exit code) or a :class:`RemoteProcess` (started by torchrun/srun elsewhere: alive while its
lifeline is connected). Both are a :class:`Process`: they answer the same questions --
``exit_status``, ``where``, ``node``, ``ended_by_us``, ``kill()``, ``join()``, ``abort()`` -- so
nothing above this module asks which kind it has (no ``getattr`` with a default, no
``isinstance``). Whether a failed group must end the ranks that survive is the launcher's to say
(:attr:`nbdist.runtime.launcher.Launcher.ends_survivors`), not the processes'.
"""
from __future__ import annotations

import selectors
import sys
from typing import Any, Dict, Iterable, List, Optional

from ..errors import ExitStatus
from ..wire import transport
from ..wire.relay import ABORT_EXIT_CODE, OutputRelay


#: Whether a process sentinel can wait in a selector next to sockets. Not on Windows, where
#: ``select()`` takes sockets only and a sentinel is a process handle: there, exits are polled
#: every :data:`POLL_S` seconds instead (tests switch this off to run that path on Linux).
SENTINELS_SELECTABLE = sys.platform != "win32"
POLL_S = 0.1


def watch_exits(sel: selectors.BaseSelector, ranks: Iterable[Any]) -> Dict[int, Process]:
    """Register the sentinel of each rank's process (``ranks``: :class:`~.ranks.Rank` objects,
    which import this module) in ``sel`` as ``("dead", rank)``; return the processes that must be
    polled instead (where sentinels are not selectable), by rank."""
    polled = {}
    for r in ranks:
        if r.process.sentinel is None:
            continue
        if SENTINELS_SELECTABLE:
            sel.register(r.process.sentinel, selectors.EVENT_READ, ("dead", r.rank))
        else:
            polled[r.rank] = r.process
    return polled


def select_exits(sel: selectors.BaseSelector, polled: Dict[int, Process],
                 timeout: Optional[float]) -> List[Any]:
    """``sel.select(timeout)`` as ``(data, fileobj)`` pairs, plus ``(("dead", r), None)`` for each
    polled process that has exited (the wait is then at most :data:`POLL_S`)."""
    if polled:
        timeout = POLL_S if timeout is None else min(timeout, POLL_S)
    events = [(key.data, key.fileobj) for key, _ in sel.select(timeout)]
    return events + [(("dead", r), None) for r, p in list(polled.items())
                     if p.exit_status is not None]


class Process:
    """What the caller asks of a rank's process, whoever started it. Threads: ``exit_status``,
    ``kill()`` and ``abort()`` from any thread; ``join()`` and ``release()`` from the thread that
    owns the group (the caller's, or a teardown's)."""

    pid: Optional[int] = None
    #: what a selector can wait on for its exit (``None``: liveness comes from its lifeline)
    sentinel: Any = None
    #: where it runs, for messages (``""``: this machine)
    where = ""
    #: the launcher's node label (``""`` or ``"?"``: none named)
    node = ""

    @property
    def exit_status(self) -> Optional[ExitStatus]:
        """``None`` while the process runs; its :class:`ExitStatus` after."""
        raise NotImplementedError

    @property
    def ended_by_us(self) -> bool:
        """True if the group itself told the process to stop or to abort."""
        return False

    def kill(self) -> None:
        """End the process at once (safe from any thread, and after it exited)."""
        raise NotImplementedError

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait up to ``timeout`` s for the process to be gone."""
        raise NotImplementedError

    def expect_exit(self) -> None:
        """The group is about to ask the process to stop: its end is then a clean exit."""

    def abort(self) -> bool:
        """Tell the process to exit because its group failed; True if it was told."""
        return False

    def release(self) -> None:
        """Free what the caller holds of an exited process (its exit status is kept)."""


class LocalProcess(Process):
    """A worker nbdist started (a ``multiprocessing.Process``).

    Any thread may ask for its ``exit_status`` or ``kill()`` it while the group's thread
    :meth:`release` s it: each reads the handle once, and a handle released meanwhile means the
    exit status is known (``release`` records it first).
    """

    def __init__(self, process):
        self._process = process
        self.pid: Optional[int] = process.pid
        self.sentinel = process.sentinel
        self._status: Optional[ExitStatus] = None

    @property
    def exit_status(self) -> Optional[ExitStatus]:
        """``None`` while the process runs; its :class:`ExitStatus` after."""
        process = self._process  # once: release() may clear it from another thread
        if self._status is None and process is not None:
            try:
                code = process.exitcode
            except ValueError:  # closed by release() meanwhile, which recorded the status
                code = None
            if code is not None and self._status is None:
                self._status = ExitStatus(code)
        return self._status

    def kill(self) -> None:
        """SIGKILL the process (safe from any thread, and after it exited)."""
        process = self._process
        if self._status is None and process is not None:
            try:
                process.kill()
            except (OSError, ValueError):
                pass  # reaped and closed meanwhile

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the process to exit."""
        process = self._process
        if self._status is None and process is not None:
            try:
                process.join(timeout)
            except ValueError:
                pass  # released meanwhile: it has exited

    def release(self) -> None:
        """Free the process handle once it has exited (its exit status is kept)."""
        if self.exit_status is not None and self._process is not None:
            process, self._process = self._process, None
            process.close()


class RemoteProcess(Process):
    """A rank nbdist did not start (torchrun/srun on another host): alive while its lifeline is.

    After the lifeline closes, its exit status is 0 if the rank was told to stop,
    :data:`ABORT_EXIT_CODE` if it was told to abort, else ``lost``. A rank whose host stopped
    answering (on its lifeline or its control ``channel``: no end of stream ever comes) is ``lost``
    at once, saying so.
    """

    def __init__(self, rank: int, pid: int, host: str, relay: OutputRelay, node: str = "?",
                 channel: Optional[transport.Channel] = None):
        self.rank, self.pid, self.host, self.node, self._relay = rank, pid, host, node, relay
        self.channel = channel
        self._expected: Optional[int] = None  # the exit code we asked for

    @property
    def exit_status(self) -> Optional[ExitStatus]:
        """``None`` while connected, then ``ExitStatus(0)`` or ``ExitStatus(lost=True)``."""
        lifeline = self._relay.lifeline(self.rank)
        if lifeline is None:
            return None
        silent = lifeline.why or self._silent
        if silent:
            return ExitStatus(lost=True, where=self.where, why=silent)
        if lifeline.alive:
            return None
        if self._expected is not None:
            return ExitStatus(self._expected)
        return ExitStatus(lost=True, where=self.where)

    @property
    def _silent(self) -> str:
        """Why the control channel was given up, if its peer's host stopped answering."""
        channel = self.channel
        return channel.failure if channel is not None and channel.peer_silent else ""

    @property
    def where(self) -> str:
        """``"node 1, host gpu7"`` (``"host gpu7"`` when the launcher named no node): how
        messages place this rank."""
        node = f"node {self.node}, " if self.node not in ("", "?") else ""
        return f"{node}host {self.host}"

    @property
    def ended_by_us(self) -> bool:
        """True if the group told this rank to stop or to abort."""
        return self._expected is not None

    def expect_exit(self) -> None:
        """We asked the rank to stop: its lifeline closing then means a clean exit."""
        if self._expected is None:
            self._expected = 0

    def abort(self) -> bool:
        """Tell the rank to exit with :data:`ABORT_EXIT_CODE` (its group failed); True if told."""
        lifeline = self._relay.lifeline(self.rank)
        if self._expected == ABORT_EXIT_CODE or lifeline is None or not lifeline.abort():
            return False
        self._expected = ABORT_EXIT_CODE
        return True

    def kill(self) -> None:
        """Ask the worker's watchdog to SIGKILL its own process."""
        lifeline = self._relay.lifeline(self.rank)
        if lifeline is not None:
            lifeline.kill()

    def use_relay(self, relay: OutputRelay) -> None:
        """The rank's streams moved to ``relay`` (a generation admitted in the background)."""
        self._relay = relay

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait until the rank's streams are closed (not at all once its host stopped answering:
        nothing more will come from it)."""
        if not self._silent:
            self._relay.wait_closed(self.rank, 3600.0 if timeout is None else timeout)
