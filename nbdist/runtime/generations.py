"""A torchrun restart is a new generation of an attached group.

With ``torchrun --max-restarts=K``, a failed worker makes torchrun restart every worker of the job
(nbdist ends the survivors so that every node's agent does: :mod:`.ranks`). The restarted workers
run ``python -m nbdist.worker`` again and connect to the same address with the same key. After
the first generation joined, :class:`Regenerator` keeps the group's listener open and, on a
background thread, admits the next full set of ``world_size`` ranks as soon as they knock -- a
worker gives up if its handshake is not answered within 10 s, so this cannot wait for the next
call -- with a fresh rendezvous (a new ``TCPStore``: the old generation's keys stay behind) and an
output relay of its own. The group takes the new generation on its next call
(:meth:`AttachLauncher.launch <nbdist.runtime.attach.AttachLauncher.launch>`), which moves the
ranks' streams into the group's relay. Variables on the ranks are gone: these are new processes.

When the group stops (:meth:`Regenerator.close`), a generation that is still joining is stopped at
once (its admission wakes up) and one that joined but was never taken -- even one that completed
just as the group stopped -- is told to exit (:data:`~nbdist.wire.relay.ABORT_EXIT_CODE`: each
launcher sees a failure, instead of holding its node) and its relay closed. The background thread
is the only one that admits; it owns the read end of its wake-up pair.
"""
from __future__ import annotations

import selectors
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import NbdistError
from ..wire import locks
from ..wire.deadline import WAKE_S, Deadline, poll_until
from ..wire.relay import OutputRelay
from .ranks import ASKED_S, Rank
from .reaper import reap_ranks
from .ready import Admission, AdmissionStopped, accept_until_ready
from .rendezvous import host_store

Generation = Tuple[List[Rank], Any, OutputRelay]  #: ranks ready, their TCPStore, their relay


class Regenerator:
    """Admits generation 2, 3, ... of an attached group on a background thread.

    ``admission(config, relay)`` makes the :class:`Admission` for one generation; ``config`` is the
    first generation's, copied with the new rendezvous address.
    """

    def __init__(self, listener, key: bytes, world_size: int, config: Dict[str, Any],
                 relay: OutputRelay, join_timeout: float,
                 admission: Callable[[Dict[str, Any], OutputRelay], Admission]):
        self.listener, self.key, self.world_size = listener, key, world_size
        self.config, self.join_timeout, self._admission = config, join_timeout, admission
        self._sink, self._tick = relay.sink, relay.tick
        self.generation = 1  #: the generation the group runs (or last ran)
        self._ready: Optional[Generation] = None
        self._arriving = False
        self._cond = threading.Condition(locks.make("generations", reentrant=True))
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._loop, name="nbdist-regenerate", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> bool:
        """True while a next generation is joining or ready to be taken."""
        with self._cond:
            return self._arriving or self._ready is not None

    def take(self, timeout: float) -> Generation:
        """Wait up to ``timeout`` s for the next generation; return it (the caller owns it now)."""
        with self._cond:
            # (in steps of WAKE_S: a Ctrl-C the OS gave another thread acts)
            if not poll_until(lambda: self._ready is not None or self._closed, self._cond.wait,
                              Deadline(timeout), cap=WAKE_S):
                raise NbdistError(f"no new generation of ranks joined within {timeout:.0f} s "
                                  "(did torchrun restart them? its --max-restarts may be used up); "
                                  "call stop(), then nbdist.attach() again.")
            if self._ready is None:
                raise NbdistError("this attached group was stopped.")
            gen, self._ready = self._ready, None
            self.generation += 1
            self._cond.notify_all()
            return gen

    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, "listen")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while True:
                with self._cond:  # one generation waits to be taken at a time
                    self._cond.wait_for(lambda: self._ready is None or self._closed)
                    if self._closed:
                        return
                events = sel.select()
                if self._closed:
                    return
                if any(key.data == "listen" for key, _ in events):
                    self._admit()
        finally:
            sel.close()
            self._wake_r.close()

    def _admit(self) -> None:
        with self._cond:
            self._arriving = True
        relay = OutputRelay(self._sink, self._tick)
        ranks: Dict[int, Rank] = {}
        store = None
        try:
            host = self.listener.getsockname()[0]
            store = host_store(host, self.world_size, self.config["timeout"])
            config = dict(self.config, store_tcp=(host, store.port))
            admission = self._admission(config, relay)
            admission.wake = self._wake_r  # close() stops a generation that is still joining
            ready = accept_until_ready(self.listener, self.key, self.world_size, ranks, relay,
                                       self.join_timeout, admission)
        except BaseException as err:  # noqa: BLE001 -- report, and wait for the next try
            end_generation(list(ranks.values()), relay)
            if not (self._closed or isinstance(err, AdmissionStopped)):
                sys.stderr.write(f"nbdist: a new generation of ranks tried to join and failed: "
                                 f"{err}\n")
            with self._cond:
                self._arriving = False
                self._cond.notify_all()
            return
        for r in ready:
            r.of_generation(self.generation + 1)
        with self._cond:
            self._arriving = False
            self._cond.notify_all()
            if not self._closed:
                self._ready = (ready, store, relay)
                return
        end_generation(ready, relay)  # joined as the group stopped: nobody will take it

    def close(self, turn_away: float = 0.0, deadline: Optional[Deadline] = None) -> None:
        """Stop admitting; end a generation that joined but was never taken, by ``deadline``
        (default :data:`CLOSE_S` s); close the listener -- after ``turn_away`` seconds during
        which ranks that still connect (torchrun restarting them after the group stopped) are
        closed on at once, so they exit instead of retrying."""
        deadline = deadline or Deadline(CLOSE_S)
        with self._cond:
            if self._closed:
                return
            self._closed = True
            gen, self._ready = self._ready, None
            self._cond.notify_all()
        self._wake_w.send(b"x")  # stays readable: the admission of a joining generation stops
        self._wake_w.close()
        self._thread.join(deadline.left())  # it ends a generation joining meanwhile (_admit)
        if gen is not None:
            end_generation(gen[0], gen[2], deadline)
        if turn_away > 0:
            threading.Thread(target=self._turn_away, args=(time.monotonic() + turn_away,),
                             name="nbdist-turn-away", daemon=True).start()
        else:
            self.listener.close()

    def _turn_away(self, deadline: float) -> None:
        # A worker whose lifeline closes right after its handshake exits (code 70): torchrun then
        # counts a failure and, with its restarts used up, ends the job.
        from ..wire import transport

        try:
            self.listener.settimeout(0.5)
            while time.monotonic() < deadline:
                try:
                    conn, _ = self.listener.accept()
                except socket.timeout:
                    continue
                try:
                    transport.server_handshake(conn, self.key, timeout=5.0)
                except (transport.AuthenticationError, OSError, ValueError):
                    pass
                finally:
                    conn.close()
        except OSError:
            pass
        finally:
            self.listener.close()


def end_generation(ranks: List[Rank], relay: OutputRelay,
                   deadline: Optional[Deadline] = None) -> None:
    """Tell the ranks of a generation that will never run to exit with ABORT_EXIT_CODE (their
    launcher sees a failure, as when a group fails), give them up to :data:`ASKED_S` s of
    ``deadline`` (default :data:`CLOSE_S` s) to do so, kill what still runs, close their relay."""
    deadline = deadline or Deadline(CLOSE_S)
    for r in ranks:
        r.process.abort()
    reap_ranks(ranks, deadline, asked=Deadline.earliest(deadline, Deadline(ASKED_S)))
    relay.close()


#: seconds closing the generations takes at most, unless a stop's deadline says less
CLOSE_S = 5.0
