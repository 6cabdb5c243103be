"""pdb on a rank, answered from the notebook (issue 27): ``breakpoint()``, ``pdb.set_trace()`` and
``torch.distributed.breakpoint(rank=r)`` in code a rank runs open a pdb prompt in the notebook
cell, labelled with the rank.

On the rank (:func:`install`, at start-up), the three entry points make a :class:`RankPdb`, whose
stdin and stdout are the control channel: what pdb prints, up to its prompt, goes to the notebook
as ``("pdb", seq, {"text": ..., "where": "file:line (function)"}, [])``; the rank's main thread --
the one that hit the breakpoint, and the only reader of the channel -- then waits for
``("pdb_cmd", seq, line)`` through the rank's one reader (``_Worker.receive``), which an
interrupt may stop waiting for but never cuts in half. The
other ranks run on until their next collective, and wait there. On the notebook's side the thread
waiting on the call (:meth:`Call.poll <nbdist.runtime.calls.Call.poll>`) prints the text, reads a
line from the kernel's stdin, and answers (:func:`answer`); the call's timeout is suspended
meanwhile. ``c`` continues; ``q`` ends the call with an error that says so.

A background job pauses at a breakpoint instead, and never blocks another cell: the job's thread
keeps the rank's prompt in the job's :class:`Pauses` (``job.state`` is ``"paused"``; its timeout
and stall watch are suspended) until someone attaches from any cell (:meth:`Job.debug
<nbdist.Job.debug>`, ``%dist_debug NAME``) and answers it. A blocking call made from another
thread (nothing can prompt there) tells the rank to continue, which says so in its output.
"""
from __future__ import annotations

import _thread
import io
import pdb
import signal
import sys
import threading
import time
from typing import Any, Dict, Optional

from ..wire import locks

PROMPT = "(Pdb) "
BACKGROUND = "\x00background"  #: the notebook's answer where nothing can prompt: say so, continue
#: pdb commands that let the program run on without a prompt to come (the others prompt again)
RESUME = ("c", "cont", "continue", "q", "quit", "exit")
_worker: Any = None  # the rank's _Worker (its channel, the request running)


class _Wire(io.TextIOBase):
    """pdb's stdin and stdout on a rank: output is kept until pdb reads a line, then sent to the
    notebook with the prompt; the line comes back down the control channel."""

    def __init__(self):
        super().__init__()
        self._out: list = []
        self.debugger: Optional[pdb.Pdb] = None

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._out.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self, size: int = -1) -> str:
        text, self._out = "".join(self._out), []
        where = ""
        stack = getattr(self.debugger, "stack", None)
        if stack:  # where the program stopped (not the frame ``up`` moved to)
            frame, line = stack[-1]
            where = f"{frame.f_code.co_filename}:{line} ({frame.f_code.co_name})"
        return _ask({"text": text, "where": where}) + "\n"


def _ask(body: Dict[str, str]) -> str:
    worker = _worker
    seq = worker.interrupts.running
    worker.channel.send(("pdb", seq, body, []))
    while True:  # the rank's one reader: segments given back are released there
        kind, s, payload = worker.receive(worker.channel, whole=True)
        if kind == "pdb_cmd" and payload == BACKGROUND:
            sys.stderr.write(f"nbdist: rank {worker.rank} hit a breakpoint in a call made from "
                             "a thread other than the notebook's; it continues (nothing can "
                             "prompt there: call from the notebook, or submit a background job "
                             "and attach with job.debug()).\n")
            sys.stderr.flush()
            return "c"
        if kind == "pdb_cmd":
            return payload


class RankPdb(pdb.Pdb):
    """pdb whose prompt is answered from the notebook."""

    def __init__(self):
        wire = _Wire()
        super().__init__(stdin=wire, stdout=wire, nosigint=True)
        wire.debugger = self
        self.use_rawinput = False
        self.prompt = PROMPT


def set_trace(*, header: Optional[str] = None) -> None:
    """``pdb.set_trace()`` on a rank: a prompt in the notebook (a background job continues)."""
    frame = sys._getframe().f_back
    _enter(frame, header)


def breakpointhook(*args, **kwargs) -> None:
    """``breakpoint()`` on a rank (``sys.breakpointhook``)."""
    _enter(sys._getframe().f_back, None)


def _enter(frame, header: Optional[str]) -> None:
    if _worker is None or _worker.channel is None or _worker.interrupts.running is None:
        return  # not inside a request: nothing could answer
    debugger = RankPdb()
    if header is not None:
        debugger.message(header)
    debugger.set_trace(frame)


def dist_breakpoint(rank: int = 0, skip: int = 0, timeout_s: float = 3600) -> None:
    """``torch.distributed.breakpoint(rank=r)`` on a rank: pdb on rank ``r`` (answered from the
    notebook), then every rank meets in a barrier, as torch's does."""
    import torch.distributed as dist

    if dist.get_rank() == rank:
        _enter(sys._getframe().f_back, f"rank {rank}: torch.distributed.breakpoint()")
    dist.barrier()


def install(worker) -> None:
    """Make this rank's breakpoints prompt in the notebook."""
    global _worker
    _worker = worker
    sys.breakpointhook = breakpointhook
    pdb.set_trace = set_trace
    import torch.distributed as dist

    dist.breakpoint = dist_breakpoint


# ---- on the notebook's side ---------------------------------------------------------------------
def answer(call, rs, rank: int, body: Dict[str, Any], interactive: bool) -> None:
    """Rank ``rank``'s pdb waits for a command. A background job keeps the prompt in its
    :class:`Pauses` until someone attaches (a job being stopped tells pdb to quit). A blocking
    call in the notebook's thread (``interactive``) shows what pdb printed, reads the command from
    the kernel's stdin and sends it; its deadline moves by the time the prompt was open. Any
    other call tells pdb to continue."""
    if call.outcome is not None:  # the call is being ended (a timeout, an interrupt, a death,
        line = "q"  # job.interrupt(), stop()): leave pdb; never a prompt in the middle of that
    elif call.pauses is not None:
        call.pauses.post(rank, body)
        return
    elif interactive:
        line = _prompt(call, rank, body.get("text", ""))
    else:
        line = BACKGROUND  # the rank says so in its output, and continues
    try:
        rs[rank].channel.send(("pdb_cmd", call.seq, line))
    except OSError:
        pass  # the rank is gone: the wait notices


def _prompt(call, rank: int, text: str) -> str:
    if text.endswith(PROMPT):
        text = text[:-len(PROMPT)]
    if rank not in call.debugged:
        call.debugged.add(rank)
        print(f"nbdist: rank {rank} stopped at a breakpoint; this call's timeout is suspended "
              "while pdb is open (c continues, q ends the call).")
    sys.stdout.write(text)
    began = time.monotonic()
    _PROMPTING[0] = call
    try:
        line = input(f"(Pdb rank {rank}) ")
    except EOFError:
        line = "q"
    except Exception as err:  # noqa: BLE001 -- a kernel run without stdin (nbclient, voila)
        print(f"nbdist: rank {rank}'s pdb cannot prompt here ({type(err).__name__}: {err}); "
              "it continues.")
        line = "c"
    finally:
        _PROMPTING[0] = None
    if call.deadline is not None:
        call.deadline += time.monotonic() - began
    return line


_PROMPTING: list = [None]  # the call whose pdb prompt waits for the user now (main thread only)


def end_prompt(call) -> bool:
    """(``stop()`` from another thread.) If ``call``'s pdb prompt waits for the user, end it as
    Ctrl-C would -- SIGINT to the main thread, which holds the group meanwhile -- so that the call
    ends and the group can be stopped; True if one waited."""
    if call is None or _PROMPTING[0] is not call:
        return False
    kill = getattr(signal, "pthread_kill", None)
    if kill is not None:  # a real signal: it wakes a read of the terminal, too
        kill(threading.main_thread().ident, signal.SIGINT)
    else:  # Windows: the kernel's input() polls, and sees it
        _thread.interrupt_main()
    return True


class Pauses:
    """A background job's ranks stopped at a breakpoint, each waiting for a pdb command.

    The job's thread, which reads the ranks' channels, posts each prompt (:meth:`post`); whoever
    attaches (:meth:`Job.debug <nbdist.Job.debug>`, ``%dist_debug NAME``), from any thread, reads
    it (:meth:`prompt`) and answers (:meth:`command`). While a rank waits here the job's deadline
    does not run (:meth:`hold`) and its stall watch looks for nothing. Its lock is a leaf."""

    def __init__(self, rs, seq: int):
        self._cond = threading.Condition(locks.make("pauses"))
        self._rs, self._seq = rs, seq
        self._prompts: Dict[int, Dict[str, str]] = {}
        self._ended = False
        self._last: Optional[float] = None  # the job thread's last tick (hold)
        #: the job is being stopped (``job.interrupt()``): its prompts are only there to be quit
        self.stopping = False

    def post(self, rank: int, body: Dict[str, str]) -> None:
        """(The job's thread.) Rank ``rank``'s pdb waits: what it printed, and where."""
        with self._cond:
            self._prompts[rank] = body
            self._cond.notify_all()

    def end(self) -> None:
        """(The job's thread.) The job's wait is over: no rank waits any more."""
        with self._cond:
            self._ended = True
            self._prompts.clear()
            self._cond.notify_all()

    def quit_all(self) -> None:
        """(Any thread: the job is being stopped.) Every waiting rank leaves pdb (``q``)."""
        with self._cond:
            ranks, self._prompts = list(self._prompts), {}
        for rank in ranks:
            try:
                self._rs[rank].channel.send(("pdb_cmd", self._seq, "q"))
            except OSError:
                pass  # the rank is gone: the job's wait notices

    def where(self) -> Dict[int, str]:
        """Each waiting rank's ``file:line (function)``, by rank."""
        with self._cond:
            if self.stopping:
                return {}
            return {r: body.get("where", "") for r, body in sorted(self._prompts.items())}

    def hold(self, call) -> bool:
        """(The job's thread, every tick.) Move the call's deadline on by the time a rank waited
        here since the last tick; True while one waits."""
        now = time.monotonic()
        with self._cond:
            waiting = bool(self._prompts)
        if waiting and self._last is not None and call.deadline is not None:
            call.deadline += now - self._last
        self._last = now
        return waiting

    def prompt(self, rank: int) -> str:
        """What rank ``rank``'s pdb printed before its prompt (LookupError: it does not wait)."""
        with self._cond:
            if rank not in self._prompts or self.stopping:
                raise LookupError(rank)
            text = self._prompts[rank].get("text", "")
        return text[:-len(PROMPT)] if text.endswith(PROMPT) else text

    def command(self, rank: int, line: str) -> str:
        """Send pdb ``line`` to rank ``rank`` (LookupError: it does not wait). Unless the command
        lets the program run on (:data:`RESUME`), wait for pdb's next prompt and return what it
        printed; ``""`` when it resumed, or the rank left pdb as the job ended."""
        with self._cond:
            if rank not in self._prompts or self.stopping:
                raise LookupError(rank)
            del self._prompts[rank]
        try:
            self._rs[rank].channel.send(("pdb_cmd", self._seq, line))
        except OSError:
            return ""  # the rank is gone: the job's wait notices
        if line.strip().split(" ")[0] in RESUME:
            return ""
        with self._cond:
            while rank not in self._prompts and not self._ended:
                self._cond.wait(0.5)  # a Ctrl-C in the asking thread lands between two waits
        try:
            return self.prompt(rank)
        except LookupError:
            return ""


# ---- attaching to a paused background job ----------------------------------------------------
def paused_text(job, short: bool = False) -> str:
    """Where the ranks of ``job`` wait at a breakpoint, and how to go on (``short``: for the
    job's one-line status)."""
    where = job.paused or {}
    ranks = "; ".join(f"rank {r} at a breakpoint, {w}" for r, w in where.items())
    if short:
        return (f"{ranks} (timeout and stall watch suspended; attach with %dist_debug "
                f"{job.name} or job.debug())")
    return (f"job {job.name!r} is paused: {ranks}, waiting for a debugger; waiting for its "
            f"result would last until one attaches. Attach with %dist_debug {job.name} (or "
            "job.debug()): c continues the job, q ends it. Its timeout and stall watch are "
            "suspended meanwhile.")


def attach(job, command: Optional[str], rank: Optional[int]) -> str:
    """:meth:`Job.debug <nbdist.Job.debug>`: one pdb command on a paused rank of ``job``."""
    where = job.paused or {}
    if rank is None and where:
        rank = min(where)
    if rank not in where:
        raise LookupError(_not_paused(job, rank, where))
    try:
        return job.call.pauses.prompt(rank) if command is None else \
            job.call.pauses.command(rank, command)
    except LookupError:  # it went on meanwhile (the job ended, or another thread answered)
        raise LookupError(_not_paused(job, rank, job.paused or {})) from None


def _not_paused(job, rank: Optional[int], where: Dict[int, str]) -> str:
    if where:
        return (f"rank {rank} of job {job.name!r} is not at a breakpoint; "
                f"{'ranks' if len(where) > 1 else 'rank'} {', '.join(map(str, where))} "
                f"{'are' if len(where) > 1 else 'is'} (--rank R / rank=R)")
    return (f"job {job.name!r} is not at a breakpoint (it is {job.state}): a breakpoint() in a "
            "background job pauses it there, and %dist_jobs then shows it as paused")
