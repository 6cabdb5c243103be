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
  :mod:`.dispatch` -- the group's calls half: one call from check to verdict under the group's
  lock, a Ctrl-C wherever it lands, and how a background job (:mod:`.jobs`) ends.
* :mod:`.worker` -- the worker process itself; :mod:`.status` -- what ``status()`` shows;
  :mod:`.imports` -- modules a rank imports between calls (``Group.preload``).
* :mod:`.output` -- where the ranks' lines go: kept on the call (``last_output``, ``job.output``),
  then shown with repeats folded (quiet ranks), as written, or queued for the user's ``output=``
  sink.
* Beside the runtime, in :mod:`nbdist.wire`: the output relay (reads every rank's stdout/stderr)
  and each rank's lifeline (interrupt / kill / abort commands down its stderr socket, liveness
  up; an attached group aborts every other remote rank when one is lost).

Threading model
    *Caller thread* (the kernel's, or any thread that calls): runs a whole call while holding the
    group's ``RLock`` -- send, wait, settle, and any teardown -- and every lifecycle change
    (``start``, ``restart``, ``stop``). One call at a time per group; ``Rank.state`` moves between
    ``idle`` and ``busy`` only inside a call, and to ``dead`` / ``stopped`` only in a teardown.
    However a call ends -- a Ctrl-C between two of its steps included -- it leaves the group
    ``ready``, ``broken`` or ``stopped``, never ``busy`` (:mod:`.dispatch`).
    *Relay thread* (one per group, ``nbdist-output``): reads the ranks' output sockets and hands
    lines to the output router, in the context of the call that was running (so output lands in
    the cell that made the call); its buffers are guarded by the relay's own lock, and the caller
    thread drains it under that lock before returning results. It also ticks the output router,
    which releases folded lines held back for their 0.2 s window; the call's thread shows what is
    still held, and the summary of repeats, when the call ends (a job's thread, when the job ends).
    The relay thread never runs the user's ``output=`` sink: it only queues lines for it.
    *Sink thread* (``nbdist-sink``, while lines come): calls the user's sink, line by line in
    order, in each line's context, outside every lock -- so a slow or blocked sink never holds up
    the relay, which reads the lifelines that tell of a death. The caller thread (or a job's)
    waits until the sink got the call's lines before it returns a value or a ``RemoteError``; a
    death, a timeout or an interrupt is reported at once, its lines following as the sink takes
    them.
    *Job thread* (``nbdist-job-NAME``, one per background job): the job is recorded on the group
    only once its request reached the ranks, and its thread always starts; it waits without the
    group's lock, then takes it to settle the call as a blocking call would -- unless the group
    was stopped or restarted meanwhile, which ends the job with ``GroupClosedError``.
    *Regenerate thread* (attached groups, ``nbdist-regenerate``): admits ranks torchrun restarted
    into a relay of its own; the caller thread takes them on the next call.
    *Any thread or the GC*: a tensor on a pooled result segment dies and puts the segment on its
    rank's lock-free ``SimpleQueue``; the next request to that rank carries it back.
    *Another thread* may call ``status()`` at any time (it reads ranks without the lock: a row may
    be one step behind; each process handle is read once, and one released meanwhile means the
    exit status is known) and ``stop(timeout)``: if another thread holds the lock longer than
    ``timeout``, ``stop`` records the stop (``_stop_requested``: the holder checks it after each
    step and completes the stop itself) and kills that call's processes (and nothing else) -- or,
    with no call running (ranks starting), closes the launcher, which ends an attached group's
    wait for torchrun's next generation; the holder then tears the group down and raises
    ``GroupClosedError``. ``stop`` waits up to 5 s for that, else raises ``GroupBusyError`` saying
    what it could not stop. Interpreter exit uses ``stop(5.0)``.
    Signals: Ctrl-C reaches the caller thread as ``KeyboardInterrupt`` wherever it runs. While
    sending or waiting, the call records the outcome ``interrupted`` and the policy interrupts the
    ranks (a rank whose request was cut in half is killed: its channel is torn); once every rank
    replied (unpickling the results, showing the output), only this call's results are lost and
    the group stays ready; anywhere else the group is torn down, and ``restart()`` brings it back.

May import: :mod:`nbdist.backends`, :mod:`nbdist.wire`, :mod:`nbdist.errors`, :mod:`nbdist.report`,
torch. Never strategies, memory, bench, Lightning or the notebook layer: code from those reaches
the ranks by value (cloudpickle) or as ``"module:function"`` rank hooks.
"""
