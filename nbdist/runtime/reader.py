"""The one reader of the ranks' control channels on the notebook's side, and its one dispatch
table.

Whichever thread reads a running group's control channels -- the thread waiting on a call
(:meth:`Call.poll <nbdist.runtime.calls.Call.poll>`, also while a timed-out call takes its ranks'
stacks or a settled one waits for the survivors), a background job's thread, or
``Group.stacks()`` reading an idle group's channels itself -- reads through :func:`read`, and
ranks that are starting are read through :func:`receive` (:mod:`.ready`). Every message a rank
sends is ``(kind, seq, body, paths)``, and :data:`HANDLERS` says, kind by kind, what becomes of
it, whoever reads it:

* ``"ok"`` / ``"err"`` -- the reply to request ``seq``: the waiter's (:meth:`Waiter.reply`); a
  reply nobody waits for gives its pooled segments back to its rank;
* ``"log"`` -- rows ``nbdist.log`` made during request ``seq``: the waiting call's metrics;
* ``"sync"`` -- a protected rank's count of output frames sent before its reply: the relay
  waits for them (:meth:`OutputRelay.expect <nbdist.wire.relay.OutputRelay.expect>`);
* ``"stacks"`` -- the answer to stack request ``seq``: posted to the rank set's
  :class:`~nbdist.runtime.stacks.StacksBox`, whoever asked;
* ``"pdb"`` -- a breakpoint in request ``seq`` waits for a command: the waiting call answers it
  (:mod:`.rankpdb`); a prompt no call waits for any more is told to quit;
* ``"ready"`` / ``"init_err"`` -- a starting rank initialised torch.distributed, or could not.

A :class:`Waiter` is what a reader waits for and what it does with what concerns it: this base
waits for no call (stacks taken from an idle group); a :class:`~nbdist.runtime.calls.Call` and
the start-up of ranks (:class:`nbdist.runtime.ready.Start`) are waiters too. A rank whose process
died or whose channel failed is the waiter's to :meth:`~Waiter.lose`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Set, Tuple

Message = Tuple[str, int, Any, Any]


class Waiter:
    """What a reader waits for, and what it does with the messages that concern it. This one
    waits for no call: replies and logs of calls that ended are let go, a pdb prompt is told to
    quit, and a lost rank is only left alone for the rest of the read (it stays watched, so the
    next call finds it dead)."""

    def __init__(self):
        #: ranks lost (their process died, or their channel failed): not read again
        self.dead: Set[int] = set()

    def lose(self, rs, r: int) -> None:
        """Rank ``r``'s process died or its channel failed."""
        self.dead.add(r)

    def reply(self, rs, r: int, seq: int, status: str, body: Any, paths) -> None:
        """Rank ``r``'s reply (``status`` ``"ok"`` or ``"err"``) to request ``seq``: a late one
        nobody will read."""
        rs.release(r, paths)

    def log(self, rs, r: int, seq: int, rows: Any) -> None:
        """Rows rank ``r`` logged during request ``seq``, which nobody waits for any more."""

    def pdb(self, rs, r: int, seq: int, body: Any) -> None:
        """A breakpoint on rank ``r`` in request ``seq`` waits, and no call waits for it: quit."""
        try:
            rs[r].channel.send(("pdb_cmd", seq, "q"))
        except OSError:
            pass  # the rank is gone: the next call notices

    def ready(self, rs, r: int, info: Any) -> None:
        """A starting rank initialised torch.distributed (only ranks starting send it)."""

    def init_failed(self, rs, r: int, body: Any) -> None:
        """A starting rank could not initialise torch.distributed (only ranks starting)."""


def _ok(waiter: Waiter, rs, r: int, seq: int, body: Any, paths) -> None:
    waiter.reply(rs, r, seq, "ok", body, paths)


def _err(waiter: Waiter, rs, r: int, seq: int, body: Any, paths) -> None:
    waiter.reply(rs, r, seq, "err", body, paths)


def _log(waiter: Waiter, rs, r: int, seq: int, body: Any, paths) -> None:
    waiter.log(rs, r, seq, body)


def _sync(waiter: Waiter, rs, r: int, seq: int, body: Any, paths) -> None:
    if rs is not None:  # (ranks starting send none)
        rs.relay.expect(r, body)


def _stacks(waiter: Waiter, rs, r: int, seq: int, body: Any, paths) -> None:
    if rs is not None:  # (ranks starting send none: nobody can ask them yet)
        rs.stacks.post(seq, r, body)


def _pdb(waiter: Waiter, rs, r: int, seq: int, body: Any, paths) -> None:
    waiter.pdb(rs, r, seq, body)


def _ready(waiter: Waiter, rs, r: int, seq: int, body: Any, paths) -> None:
    waiter.ready(rs, r, body)


def _init_failed(waiter: Waiter, rs, r: int, seq: int, body: Any, paths) -> None:
    waiter.init_failed(rs, r, body)


Handler = Callable[[Waiter, Any, int, int, Any, Any], None]
#: What becomes of each kind of message from a rank, whoever reads it (see the module's doc).
HANDLERS: Dict[str, Handler] = {
    "ok": _ok, "err": _err, "log": _log, "sync": _sync, "stacks": _stacks, "pdb": _pdb,
    "ready": _ready, "init_err": _init_failed,
}


def receive(waiter: Waiter, rs, r: int, channel) -> Optional[Message]:
    """Read one message of rank ``r`` from ``channel`` and hand it to its kind's handler; the
    message, or ``None`` when the channel failed (EOF, reset, a corrupt or tampered stream: the
    rank is lost to ``waiter``). ``rs``: the rank set (``None`` while ranks start)."""
    try:
        message = channel.recv()
        kind, seq, body = message[:3]
        paths = message[3] if len(message) > 3 else None
    except Exception:  # noqa: BLE001 -- EOF, reset, or a corrupt stream: the rank is lost
        waiter.lose(rs, r)
        return None
    handler = HANDLERS.get(kind)
    if handler is None:  # a kind this side does not know: nothing to do with it but let it go
        if rs is not None:
            rs.release(r, paths)
        return kind, seq, body, paths
    handler(waiter, rs, r, seq, body, paths)
    return kind, seq, body, paths


def read(rs, timeout: Optional[float], waiter: Waiter) -> None:
    """Read what arrives within ``timeout`` s on the control channels of ``rs`` (and the ranks'
    exits) for ``waiter``, each message handed to its kind's handler (:data:`HANDLERS`)."""
    for what, r in rs.select(timeout):
        if r in waiter.dead:
            continue
        if what == "dead":
            waiter.lose(rs, r)
            continue
        receive(waiter, rs, r, rs[r].channel)
