"""The runtime: the ranks a notebook owns, and how a call reaches them and comes back.

Parts, one owner each:

* :class:`~nbdist.runtime.group.Group` -- the public object; the only writer of the group's state
  (``ready`` / ``busy`` / ``broken`` / ``stopped``) and owner of its resources (temp dir, relay,
  store, the :class:`~nbdist.runtime.ranks.RankSet`). :mod:`.api` has the front functions.
* Launchers -- where ranks come from: :class:`~nbdist.runtime.launcher.LocalLauncher` (fresh
  workers, :mod:`.forkserver`) and :class:`~nbdist.runtime.attach.AttachLauncher` (ranks started
  by torchrun/srun). Both hand back ready ranks through one accept/ready loop (:mod:`.ready`).
  An attached group's next generation (ranks torchrun restarted) joins in :mod:`.generations`;
  each generation's rendezvous store listens on the group's one address (:mod:`.rendezvous`).
* :mod:`.ranks` -- a :class:`~nbdist.runtime.ranks.Rank` per rank, whatever started its process
  (local or remote: same ``exit_status`` / ``kill`` / ``join``), and the ``RankSet`` a call talks to.
* :mod:`.calls` -- a :class:`~nbdist.runtime.calls.Call` (sequence number, targets, deadline,
  pending / replies / dead) ends in one outcome; :func:`~nbdist.runtime.calls.settle` is the one
  teardown policy that turns it into results or an error, and says whether the group is broken.
* :mod:`.worker` -- the worker process itself; :mod:`.status` -- what ``status()`` shows;
  :mod:`.imports` -- modules a rank imports between calls (``Group.preload``).
* :mod:`.output` -- where the ranks' lines go: kept on the call (``last_output``, ``job.output``),
  then shown with repeats folded (quiet ranks), as written, or to the user's ``output=`` sink.
* Beside the runtime, in :mod:`nbdist.wire`: the output relay (reads every rank's stdout/stderr)
  and each rank's lifeline (interrupt / kill / abort commands down its stderr socket, liveness
  up; an attached group aborts every other remote rank when one is lost).

Threading model
    *Caller thread* (the kernel's, or any thread that calls): runs a whole call while holding the
    group's ``RLock`` -- send, wait, settle, and any teardown -- and every lifecycle change
    (``start``, ``restart``, ``stop``). One call at a time per group; ``Rank.state`` moves between
    ``idle`` and ``busy`` only inside a call, and to ``dead`` / ``stopped`` only in a teardown.
    *Relay thread* (one per group, ``nbdist-output``): reads the ranks' output sockets and hands
    lines to the sink, in the context of the call that was running (so output lands in the cell
    that made the call); its buffers are guarded by the relay's own lock, and the caller thread
    drains it under that lock before returning results. It also ticks the output router, which
    releases folded lines held back for their 0.2 s window; the call's thread shows what is still
    held, and the summary of repeats, when the call ends (a job's thread, when the job ends).
    *Regenerate thread* (attached groups, ``nbdist-regenerate``): admits ranks torchrun restarted
    into a relay of its own; the caller thread takes them on the next call.
    *Any thread or the GC*: a tensor on a pooled result segment dies and puts the segment on its
    rank's lock-free ``SimpleQueue``; the next request to that rank carries it back.
    *Another thread* may call ``status()`` at any time (it reads ranks without the lock: a row may
    be one step behind; it never touches a closed process handle) and ``stop(timeout)``: if a call
    holds the lock longer than ``timeout``, ``stop`` kills that call's processes (and nothing
    else), the call's own thread sees the deaths, tears the group down and raises
    ``GroupClosedError``; ``stop`` waits up to 5 s for that. Interpreter exit uses ``stop(5.0)``.
    Signals: Ctrl-C reaches the caller thread as ``KeyboardInterrupt`` inside a call's wait; the
    call records the outcome ``interrupted`` and the policy interrupts the ranks.

May import: :mod:`nbdist.backends`, :mod:`nbdist.wire`, :mod:`nbdist.errors`, :mod:`nbdist.report`,
torch. Never strategies, memory, bench, Lightning or the notebook layer: code from those reaches
the ranks by value (cloudpickle) or as ``"module:function"`` rank hooks.
"""
