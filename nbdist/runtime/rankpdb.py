"""pdb on a rank, answered from the notebook (issue 27): ``breakpoint()``, ``pdb.set_trace()`` and
``torch.distributed.breakpoint(rank=r)`` in code a rank runs open a pdb prompt in the notebook
cell, labelled with the rank.

On the rank (:func:`install`, at start-up), the three entry points make a :class:`RankPdb`, whose
stdin and stdout are the control channel: what pdb prints, up to its prompt, goes to the notebook
as ``("pdb", seq, {"text": ...}, [])``; the rank's main thread -- the one that hit the breakpoint,
and the only reader of the channel -- then waits for ``("pdb_cmd", seq, line)``. The other ranks
run on until their next collective, and wait there. On the notebook's side the thread waiting on
the call (:meth:`Call.poll <nbdist.runtime.calls.Call.poll>`) prints the text, reads a line from
the kernel's stdin, and answers (:func:`answer`); the call's timeout is suspended meanwhile. ``c``
continues; ``q`` ends the call with an error that says so. A background job does not stop at a
breakpoint (it has no prompt to answer): the rank is told to continue, and says so in its output.
"""
from __future__ import annotations

import io
import pdb
import sys
import time
from typing import Any, Dict, Optional

PROMPT = "(Pdb) "
BACKGROUND = "\x00background"  #: the notebook's answer in a background job: say so, continue
_worker: Any = None  # the rank's _Worker (its channel, the request running)


class _Wire(io.TextIOBase):
    """pdb's stdin and stdout on a rank: output is kept until pdb reads a line, then sent to the
    notebook with the prompt; the line comes back down the control channel."""

    def __init__(self):
        super().__init__()
        self._out: list = []

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
        return _ask(text) + "\n"


def _ask(text: str) -> str:
    worker = _worker
    seq = worker.interrupts.running
    worker.channel.send(("pdb", seq, {"text": text}, []))
    while True:
        kind, s, payload = worker.channel.recv()
        if kind == "pdb_cmd" and payload == BACKGROUND:
            sys.stderr.write(f"nbdist: rank {worker.rank} hit a breakpoint in a background job; it "
                             "continues (pdb prompts in blocking calls only: %%dist without --bg, "
                             "or g.run).\n")
            sys.stderr.flush()
            return "c"
        if kind == "pdb_cmd":
            return payload
        if kind == "free" and worker.pool is not None:  # segments the caller gave back
            worker.pool.release(payload)


class RankPdb(pdb.Pdb):
    """pdb whose prompt is answered from the notebook."""

    def __init__(self):
        wire = _Wire()
        super().__init__(stdin=wire, stdout=wire, nosigint=True)
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
    """Show what rank ``rank``'s pdb printed, read the next command from the kernel's stdin and
    send it (``interactive``: a blocking call in the notebook's thread; otherwise -- a background
    job -- tell pdb to continue). The call's deadline moves by the time the prompt was open."""
    text = body.get("text", "")
    if text.endswith(PROMPT):
        text = text[:-len(PROMPT)]
    if not interactive:
        line = BACKGROUND  # the rank says so in its output, and continues
    else:
        if rank not in call.debugged:
            call.debugged.add(rank)
            print(f"nbdist: rank {rank} stopped at a breakpoint; this call's timeout is suspended "
                  "while pdb is open (c continues, q ends the call).")
        sys.stdout.write(text)
        began = time.monotonic()
        try:
            line = input(f"(Pdb rank {rank}) ")
        except EOFError:
            line = "q"
        except Exception as err:  # noqa: BLE001 -- a kernel run without stdin (nbclient, voila)
            print(f"nbdist: rank {rank}'s pdb cannot prompt here ({type(err).__name__}: {err}); "
                  "it continues.")
            line = "c"
        if call.deadline is not None:
            call.deadline += time.monotonic() - began
    try:
        rs[rank].channel.send(("pdb_cmd", call.seq, line))
    except OSError:
        pass  # the rank is gone: the wait notices
