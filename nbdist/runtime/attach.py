"""Ranks on other hosts: the notebook listens, torchrun or srun starts ``python -m nbdist.worker``.

:class:`AttachLauncher` opens the control listener on an address the user chose (loopback unless
told otherwise), writes the group key to a file readable only by its owner, prints the commands to
run on the nodes, and waits -- with a progress bar and a deadline -- until every rank has connected
and initialised torch.distributed. The rendezvous is a ``TCPStore`` hosted by the caller on the
same address (:mod:`.rendezvous`: never all interfaces).

Once the ranks joined, the listener stays open: when torchrun restarts the workers after a
failure (``--max-restarts``), they join again as the next generation of the same group
(:mod:`.generations`), which the group takes on its next call.
"""
from __future__ import annotations

import os
import shlex
import sys
import tempfile
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

from ..backends import BackendChoice, resolve_backend
from ..errors import GroupClosedError, NbdistError, ranks_phrase
from ..wire import transport
from ..wire.relay import OutputRelay
from .launcher import RANK_HOOKS, Launcher, custom_backend_blobs
from .generations import Regenerator
from .processes import RemoteProcess
from .ranks import Rank
from .ready import Admission, accept_until_ready
from .rendezvous import host_store
from .status import backend_name, debug_env
from .teardown import interrupts_deferred

TURN_AWAY = 30.0  #: s after stop() during which ranks torchrun restarts are told to go at once
RESTART_REFUSAL = ("the ranks of an attached group were started by your launcher (torchrun/srun); "
                   "nbdist cannot restart them. Call stop(), then nbdist.attach() again and re-run "
                   "the launcher command.")


class AttachLauncher(Launcher):
    """Ranks started elsewhere by torchrun/srun join a group this process listens for."""

    ends_survivors = True
    broken_advice = ("nbdist cannot restart ranks that torchrun/srun started: call stop(), then "
                     "nbdist.attach() again and re-run the launcher command.")

    def __init__(self, address: Tuple[str, int], key_file: Optional[str] = None,
                 join_timeout: float = 600.0, nproc_per_node: Optional[int] = None,
                 progress: bool = True, protect: Optional[bool] = None):
        self.address, self.key_file, self.own_key_file = address, key_file, key_file is None
        #: every message sealed (:mod:`nbdist.wire.seal`): on unless the address is loopback
        self.protect = not is_loopback(address[0]) if protect is None else bool(protect)
        self.join_timeout, self.nproc_per_node, self.progress = join_timeout, nproc_per_node, progress
        self.commands: Dict[str, str] = {}
        self.regen: Optional[Regenerator] = None
        self.restarts = (0, 0)  #: (torchrun's restart count, its --max-restarts) seen on the ranks
        self._current: List[Rank] = []  #: the generation the group runs
        self._closed = False  # close() is final: stop() may call it while a launch is under way
        #: seconds the ranks outlive this kernel, waiting for ``nbdist.reattach()`` (an engine's
        #: group started with ``keep_alive=``; ``None``: they exit with it)
        self.keep_alive: Optional[float] = None
        self.engine = ""  #: the engine's name (``on=``), saved in the handle
        self.reattach_key: Optional[bytes] = None  #: set: reconnect to ranks that outlived a kernel
        self.handle_path: Optional[str] = None  #: the handle file of a keep_alive group

    @property
    def restart_refusal(self) -> Optional[str]:
        """Why restart() cannot work: ``None`` while a new generation of ranks is on its way."""
        return None if self.can_relaunch(False) else RESTART_REFUSAL

    def can_relaunch(self, auto_restart: bool) -> bool:
        """A broken attached group comes back when torchrun restarts its ranks (they re-join)."""
        regen = self.regen
        if regen is None or not any(r.exit_status is not None and (r.exit_status.lost or
                                                                    r.exit_status.code)
                                    for r in self._current):
            return False  # a healthy group: a restart would only stop it (torchrun would not)
        return regen.pending or self.restarts[0] < self.restarts[1]

    @property
    def generation(self) -> int:
        """1 for the ranks that joined at attach(), 2 after torchrun restarted them once, ..."""
        return self.regen.generation if self.regen is not None else 1

    def choose(self, opts: Dict[str, Any]) -> BackendChoice:
        """Named backends are checked here; ``"auto"`` is resolved by the ranks on their hardware."""
        if opts["backend"] in (None, "", "auto"):
            return BackendChoice("auto", opts["device"] or "auto")
        return resolve_backend(opts["backend"], "cpu" if opts["device"] in (None, "auto")
                               else opts["device"])

    def launch(self, group_id, choice, opts, threads, tmp, relay):
        """Listen, print the commands, wait for every rank; the TCPStore is returned to keep."""
        if self._closed:  # stop() from another thread closed it on this launch's way here
            raise GroupClosedError("this attached group was stopped.")
        if self.regen is not None:
            return self._next_generation(relay)
        ws = opts["world_size"]
        listener = listen_again(self.address) if self.reattach_key else \
            transport.listen(*self.address)
        key = self.reattach_key or transport.new_key()
        try:
            host, port = listener.getsockname()[:2]
            if not self.reattach_key:
                self.key_file = write_key(key, self.key_file)
                self.commands = commands(host, port, self.key_file, ws, self.nproc_per_node)
            self.listening(host, port, ws)
            # reattached ranks have their process group (and rank 0 its store) already
            store = None if self.reattach_key else host_store(host, ws, opts["timeout"])
            config = {"backend": choice.backend, "device": choice.device,
                      "timeout": float(opts["timeout"]), "threads": threads,
                      "custom_backends": custom_backend_blobs(choice), "rank_hooks": RANK_HOOKS,
                      "store_tcp": (host, store.port) if store is not None else None,
                      # keep_alive: rank 0 serves the rendezvous store, which must outlive this
                      # kernel for dist.new_group after a reattach (docs/multinode.md)
                      "keep_alive": self.keep_alive, "store_on_rank0": bool(self.keep_alive),
                      "env": dict(opts["env"] or {}, **debug_env(opts["debug"]))}
            admission = self._admission(ws, config, relay, self.progress)
            admission.reattaching = bool(self.reattach_key)
            ranks: Dict[int, Rank] = {}
            try:
                ready = accept_until_ready(listener, key, ws, ranks, relay, self.join_timeout,
                                           admission)
            except BaseException:
                from ..wire.deadline import Deadline
                from .reaper import reap_ranks

                reap_ranks(ranks.values(), Deadline(1.0))
                raise
            finally:
                admission.close()
        except BaseException:
            listener.close()
            raise
        self._seen(ready)
        if self.reattach_key:
            say_lost_calls(ready)
        self.regen = Regenerator(listener, key, ws, config, relay, self.join_timeout,
                                 lambda cfg, rel: self._admission(ws, cfg, rel, False))
        if self.keep_alive:
            self.save_handle(host, port, key, ws, opts)
        return ready, store

    def save_handle(self, host: str, port: int, key: bytes, ws: int, opts) -> None:
        """A keep_alive group: save what a new kernel needs to reattach (:mod:`.handles`)."""
        from . import handles

        old, self.handle_path = self.handle_path, handles.save(dict(
            self.handle_fields(), engine=self.engine, address=[host, port], key=key.hex(),
            world_size=ws, timeout=float(opts["timeout"]), keep_alive=self.keep_alive,
            protect=self.protect, pid=os.getpid()))
        if old != self.handle_path:  # reattached under another name: one handle per group
            handles.remove(old)
        if self.progress:
            print(f"nbdist: the ranks outlive this kernel for {self.keep_alive:g} s (keep_alive); "
                  f"in a new kernel, nbdist.reattach() (or %dist_start --reattach) reconnects. "
                  f"Handle: {self.handle_path}")

    @property
    def letting_go(self) -> bool:
        """True for a reattach that got no ranks: closing it leaves their job and handle alone."""
        return bool(self.reattach_key) and not self._current

    def handle_fields(self) -> Dict[str, Any]:
        """What the engine needs besides the address and the key to reattach (its ``job``)."""
        return {"job": str(os.getpid())}

    def listening(self, host: str, port: int, world_size: int) -> None:
        """The listener and the key file are ready: print the commands that start the ranks (an
        engine that starts them itself submits them here)."""
        if self.progress:
            print(f"nbdist: waiting for {world_size} ranks on {host}:{port} ("
                  f"{'messages signed' if self.protect else 'unprotected'}; "
                  f"key in {self.key_file}; "
                  f"copy it to the nodes, mode 0600). Start them with\n"
                  f"  {self.commands['torchrun']}\nor\n  {self.commands['srun']}")

    def _admission(self, ws, config, relay, progress) -> "_Remote":
        """The admission of one generation of ranks: signed as the group is."""
        admission = _Remote(ws, config, relay, progress)
        admission.protect = self.protect
        return admission

    def _next_generation(self, relay):
        """The ranks torchrun restarted, re-joined in the background: move their streams into
        the group's new relay and hand them over."""
        regen = self.regen
        n = regen.generation + 1
        if self.progress and not regen.pending:
            print(f"nbdist: waiting for torchrun to restart the ranks (generation {n})...")
        ranks, store, old = regen.take(self.join_timeout)
        old.move_to(relay)
        for r in ranks:
            r.process.use_relay(relay)
        self._seen(ranks)
        print(f"nbdist: torchrun restarted the ranks: generation {n}, {len(ranks)} ranks joined; "
              "variables on the ranks are gone (they are new processes).", file=sys.stderr)
        return ranks, store

    def _seen(self, ranks) -> None:
        self._current = list(ranks)
        counts = [r.info.get("restarts") or (0, 0) for r in ranks]
        self.restarts = (min(int(c[0]) for c in counts), min(int(c[1]) for c in counts))

    def resolved(self, choice, ranks):
        """What the ranks chose for ``"auto"`` (from their ready reports); they must agree."""
        return agreed_choice(choice, {r.rank: r.info or {} for r in ranks})

    def cleanup(self, deadline=None) -> None:
        """Nothing while a new generation may still join (see :meth:`close`)."""
        if self.regen is None:
            self.close(deadline)

    def close(self, deadline=None) -> None:
        """The group stopped: stop listening, remove the key file if nbdist made it (to the end
        even when interrupted: :mod:`.teardown`); a generation still joining or never taken is
        ended by ``deadline``."""
        self._closed = True
        with interrupts_deferred():
            regen = self.regen
            if regen is not None:
                # torchrun may restart the failed ranks after this: turn them away for a while
                regen.close(TURN_AWAY if self.can_relaunch(False) else 0.0, deadline)
                self.regen = None
            if self.handle_path and not self.letting_go:  # stopped: nothing to reattach to
                from . import handles

                handles.remove(self.handle_path)
                self.handle_path = None
            if self.own_key_file and self.key_file:
                try:
                    os.unlink(self.key_file)
                except FileNotFoundError:
                    pass


class _Remote(Admission):
    """Admission of ranks started elsewhere: world size checked, duplicates refused, config sent."""

    def __init__(self, world_size: int, config: Dict[str, Any], relay: OutputRelay,
                 progress: bool):
        self.world_size, self.config, self.relay = world_size, config, relay
        self.bar = _bar(world_size, progress)

    def control(self, hello, channel, ranks):
        rank = int(hello["rank"])
        if int(hello.get("world_size", self.world_size)) != self.world_size:
            print(f"nbdist: refused rank {rank} from {hello.get('host')}: it was started with "
                  f"WORLD_SIZE={hello.get('world_size')}, this group expects {self.world_size}.",
                  file=sys.stderr)
            return None
        if rank in ranks:
            _refuse_twice(rank, "control", hello)
            return None
        proc = RemoteProcess(rank, int(hello.get("pid", 0)), str(hello.get("host", "?")),
                             self.relay, str(hello.get("node", "?")), channel)
        r = Rank(rank, proc, channel=channel)
        r.channel.send(("config", -1, self.config))
        return r

    def stream(self, hello, role, relay):
        if relay.has(int(hello["rank"]), role):
            _refuse_twice(int(hello["rank"]), role, hello)
            return False
        return True

    reattaching = False  #: ranks that outlived a kernel come back (nbdist.reattach)

    def timed_out(self, missing, ranks, timeout):
        if self.reattaching:
            return (f"reattach: {ranks_phrase(missing)} did not come back within {timeout:.0f} s; "
                    f"{len(ranks)} of {self.world_size} connected. A rank still running the call "
                    "it had when its kernel died comes back once that call ends: reattach() "
                    "again (the ranks wait on), or with a longer join_timeout.")
        return (f"{ranks_phrase(missing)} did not join within {timeout:.0f} s; {len(ranks)} of "
                f"{self.world_size} connected. Check that the launcher command ran on every node "
                "and can reach this address.")

    def joined(self, rank):
        if self.bar is not None:
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def listen_again(address: Tuple[str, int]):
    """Listen on the address a kernel that is gone listened on (its ranks come back there);
    :class:`NbdistError` saying why when it is taken."""
    try:
        return transport.listen(*address)
    except OSError as err:
        raise NbdistError(f"reattach: cannot listen on {address[0]}:{address[1]}, where the ranks "
                          f"look for their controller ({err}). Is another kernel attached to "
                          "them, or did another program take the port?") from None


def say_lost_calls(ranks: List[Rank]) -> None:
    """Reattached ranks that were running a call when their kernel went: its result is lost."""
    lost = [r.rank for r in ranks if (r.info or {}).get("lost_call") is not None]
    if lost:
        print(f"nbdist: {ranks_phrase(lost)} {'was' if len(lost) == 1 else 'were'} running a call when the kernel that sent it "
              "went; it ran to its end with no kernel to answer, so its result (its value or "
              "its error) is lost and its output went to the job's log. The variables it set "
              "are on the ranks.", file=sys.stderr)


def agreed_choice(choice: BackendChoice, infos: Dict[int, Dict[str, Any]]) -> BackendChoice:
    """``choice`` with ``"auto"`` replaced by what every rank reported; :class:`NbdistError`
    naming the ranks when they resolved it differently (e.g. some nodes have GPUs, some not)."""
    seen: Dict[Tuple[str, str], list] = {}
    for rank, info in sorted(infos.items()):
        backend = backend_name(str(info.get("backend", "")))
        seen.setdefault((backend, str(info.get("device"))), []).append(rank)
    if len(seen) > 1:
        said = "; ".join(f"{ranks_phrase(rs)}: backend {b}, device {d}"
                         for (b, d), rs in seen.items())
        raise NbdistError(f"the ranks resolved backend/device 'auto' differently ({said}). Pass "
                          "backend= and device= to nbdist.attach(), or run every rank on the same "
                          "kind of node.")
    (backend, device), = seen
    return replace(choice, backend=backend if choice.backend == "auto" else choice.backend,
                   device=device if choice.device == "auto" else choice.device)


def _refuse_twice(rank: int, role: str, hello) -> None:
    print(f"nbdist: refused a second rank {rank} ({role}) from {hello.get('host')}: that rank has "
          "already joined (was the launcher command run twice?).", file=sys.stderr)


def parse_listen(listen: str) -> Tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``; the host must be given explicitly."""
    host, sep, port = str(listen).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"listen must look like 'HOST:PORT' (e.g. '10.0.0.5:0' or "
                         f"'127.0.0.1:29500'), got {listen!r}")
    if host in ("0.0.0.0", "::", ""):
        raise ValueError("listen on one address you chose, not on all interfaces "
                         f"({host!r}); use the address the nodes reach this machine at.")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """True if ``host`` (an address or a name) is a loopback address: only this machine."""
    import ipaddress
    import socket

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return False
        return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback
                                   for i in infos)


def write_key(key: bytes, path: Optional[str]) -> str:
    """Write the hex key to ``path`` (or a new private temp file) with mode 0600; return the path.

    Where there is no ``fchmod`` (Windows) the mode is set by path; Windows maps it to the
    read-only flag only, so privacy there rests on the per-user temp dir's permissions."""
    if path is None:
        fd, path = tempfile.mkstemp(prefix="nbdist-key-", suffix=".hex")
    else:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    if hasattr(os, "fchmod"):
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through os.open: tighten it
    else:
        os.chmod(path, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex())
    return path


def commands(host: str, port: int, key_file: str, world_size: int,
             nproc_per_node: Optional[int]) -> Dict[str, str]:
    """The commands that start the ranks on the nodes (torchrun and srun forms)."""
    nproc = nproc_per_node or world_size
    nnodes = max(1, -(-world_size // nproc))
    worker = (f"-m nbdist.worker --connect {host}:{port} --key-file {shlex.quote(key_file)}")
    return {
        "torchrun": (f"torchrun --nnodes={nnodes} --nproc-per-node={nproc} --rdzv-backend=c10d "
                     f"--rdzv-endpoint=<FIRST_NODE_HOST>:29400 {worker}"),
        "srun": f"srun --ntasks={world_size} --ntasks-per-node={nproc} python {worker}",
    }


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="ranks joined", unit="rank")
