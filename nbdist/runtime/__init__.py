"""The runtime: the ranks a notebook owns, and how a call reaches them and comes back.

Parts, one owner each:

* :class:`~nbdist.runtime.group.Group` -- the public object; the only writer of the group's state
  (``ready`` / ``busy`` / ``broken`` / ``stopped``) and owner of its resources (temp dir, relay,
  store, the :class:`~nbdist.runtime.ranks.RankSet`). :mod:`.api` has the front functions.
* Launchers -- where ranks come from: :class:`~nbdist.runtime.launcher.LocalLauncher` (fresh
  workers, :mod:`.forkserver`) and :class:`~nbdist.runtime.attach.AttachLauncher` (ranks started
  by torchrun/srun). Both hand back ready ranks through one accept/ready loop (:mod:`.ready`).
  Where workers are spawned, a start takes warm spares first (:mod:`.spares`).
  An attached group's next generation (ranks torchrun restarted) joins in :mod:`.generations`;
  each generation's rendezvous store listens on the group's one address (:mod:`.rendezvous`).
  Engines that place ranks themselves (``start(on="slurm")``) live above, in :mod:`nbdist.engines`;
  :mod:`.engines` finds them by name (entry-point group ``nbdist.engines``) without importing them.
  An engine's group started with ``keep_alive`` outlives the kernel: its ranks wait for a new
  controller (:mod:`.orphan`, rank 0 serving the store) and ``reattach()`` finds them through a
  handle file (:mod:`.handles`).
* :mod:`.ranks` -- a :class:`~nbdist.runtime.ranks.Rank` per rank, the one owner of that rank's
  state (``Rank.MOVES`` is the whole state machine; every change is a method of ``Rank``), and the
  ``RankSet`` a call talks to. :mod:`.processes` -- the process behind a rank, local or started
  elsewhere, behind one interface (``exit_status``, ``where``, ``node``, ``kill``, ``join``...).
* :mod:`.calls` -- a :class:`~nbdist.runtime.calls.Call` (sequence number, targets, deadline,
  pending / replies / dead) ends in one outcome; :func:`~nbdist.runtime.calls.settle` is the one
  teardown policy that turns it into results or an error, and says whether the group is broken.
  :mod:`.reader` -- the one reader of the ranks' control channels, and its one dispatch table:
  whichever thread reads them (a call's, a job's, ``Group.stacks()``'s, the start-up's) hands
  each message to the same handler of its kind (on a rank, ``_Worker.receive`` is the one).
  :mod:`.dispatch` -- the group's calls half: one call from check to verdict under the group's
  lock, a Ctrl-C wherever it lands, and how a background job (:mod:`.jobs`) ends.
* :mod:`.worker` -- the worker process itself; :mod:`.status` -- what ``status()`` shows;
  :mod:`.imports` -- modules a rank imports between calls (``Group.preload``).
* :mod:`.cells` -- where the code a rank runs came from: a notebook cell's name (``Cell In[5]``)
  and text, which reach each rank once, so that tracebacks, stacks, pdb and warnings there show
  the cell and the line (the notebook layer says which files are cells: ``cells.CELLS``).
* :mod:`.output` -- where the ranks' lines go: kept on the call (``last_output``, ``job.output``),
  then shown with repeats folded (quiet ranks), as written, or queued for the user's ``output=``
  sink.
* Beside the runtime, in :mod:`nbdist.wire`: the output relay (reads every rank's stdout/stderr)
  and each rank's lifeline (interrupt / kill / abort commands down its stderr socket, liveness
  up; an attached group aborts every other remote rank when one is lost).

Threading model
    Threads, on the notebook's side (every one a daemon; none outlives its group but the prewarm
    thread, which ends by itself):

    *Caller thread* (the kernel's, or any thread that calls): runs a whole call while holding the
    group's lock -- send, wait, settle, and any teardown -- and every lifecycle change
    (``start``, ``restart``, ``stop``). One call at a time per group. However a call ends -- a
    Ctrl-C between two of its steps included -- it leaves the group ``ready``, ``broken`` or
    ``stopped``, never ``busy`` (:mod:`.dispatch`); a teardown runs to its end however often
    Ctrl-C comes (:mod:`.teardown`).
    *Relay thread* (one per group, ``nbdist-output``): reads the ranks' output sockets and hands
    lines to the output router, in the context of the call that was running (so output lands in
    the cell that made the call); its buffers are guarded by the relay's own lock, and the caller
    thread drains it under that lock before returning results. It also ticks the output router,
    which releases folded lines held back for their 0.2 s window; the call's thread shows what is
    still held, and the summary of repeats, when the call ends (a job's thread, when the job ends).
    It runs an attached group's lifeline hook (a lost rank ends the others). It never runs the
    user's ``output=`` sink: it only queues lines for it.
    *Sink thread* (``nbdist-sink``, while lines come): calls the user's sink, line by line in
    order, in each line's context, outside every lock -- so a slow or blocked sink never holds up
    the relay, which reads the lifelines that tell of a death. The caller thread (or a job's)
    waits until the sink got the call's lines before it returns a value or a ``RemoteError``; a
    death, a timeout or an interrupt is reported at once, its lines following as the sink takes
    them.
    *Job thread* (``nbdist-job-NAME``, one per background job): the job is recorded on the group
    only once its request reached the ranks, and its thread always starts; it waits without the
    group's lock -- holding its rank set's (``ranks``), as it reads the channels and moves the
    ranks' states --, then takes the group's to settle the call as a blocking call would --
    unless the group was stopped or restarted meanwhile, which ends the job with
    ``GroupClosedError`` (and, if that stop could not take the rank set from it in time, the
    job's thread reaps those ranks itself: ``RankSet.retire``).
    *Regenerate thread* (attached groups, ``nbdist-regenerate``): alone admits the ranks torchrun
    restarted, into a relay of its own, and hands the generation over under its condition; the
    caller thread takes it on the next call. It stops when the group closes.
    *Turn-away thread* (attached groups, ``nbdist-turn-away``, for a while after a stop): closes
    on ranks torchrun restarts after the group stopped, so they exit; it starts only once the
    regenerate thread has stopped, and is then the listener's only user.
    *Prewarm thread* (``nbdist-prewarm``, once, at ``%load_ext nbdist`` or the first start): starts
    the forkserver with torch imported, or, where workers are spawned, the warm spares
    (:mod:`.spares`); it shares only the ``__main__`` swap
    (:func:`~nbdist.runtime.forkserver.main_hidden`, the ``main`` leaf lock) and the spares' pool
    (the list and the spawns in flight under the ``spares`` leaf lock) with a starting group,
    which takes spares; after each spawn start another prewarm thread tops them up again (never
    the caller's, which holds the group). ``spares.close`` (at exit: for good) waits for spawns in
    flight, which then keep nothing.
    *Widget poller* (``nbdist-launcher-status``, one per launcher panel) and *live view*
    (``nbdist-watch-NAME``, one per watched job), in :mod:`nbdist.ui`: they only read --
    ``status()``, ``job.metrics``, ``job.output`` -- and survive an error in one refresh.
    *Job output timer* (``nbdist-job-output-NAME``, in :mod:`nbdist.ui.joboutput`, for a moment
    after a job's line): sends the display of the job's output again when lines come faster than
    five times a second; it takes only that display's own lock.
    *Any thread or the GC*: a tensor on a pooled result segment dies and puts the segment on its
    rank's lock-free ``SimpleQueue``; the next request to that rank carries it back.
    *Another thread* may call ``status()`` at any time (it reads ranks without the lock: a row may
    be one step behind; each process handle is read once, and one released meanwhile means the
    exit status is known) and ``stop(timeout)``, all of which takes at most ``max(timeout,
    5)`` s, one deadline for every step (:mod:`nbdist.wire.deadline`): a job is interrupted and
    waited for within it; if another thread holds the lock once only 5 s are left, ``stop``
    records the stop (``_stop_requested``: the holder checks it after each step and completes the
    stop itself, within the stop's deadline) and kills that call's processes (and nothing else),
    ending its pdb prompt if one waits for the user (SIGINT to the main thread) -- or, with no
    call running (ranks starting), closes the launcher, which ends an attached group's wait for
    torchrun's next generation; the holder then tears the group down and raises
    ``GroupClosedError``. If the holder still has the lock at the deadline ``stop`` raises
    ``GroupBusyError`` saying what it could not stop; ranks not confirmed gone by then (an
    unreachable host; a job's thread still holding the rank set) raise ``DistTimeoutError``
    naming them, once the group is stopped (:mod:`.stopping`). Interpreter exit uses
    ``stop(5.0)`` (``stop_all``, which says on stderr what a stop left).
    Signals: Ctrl-C reaches the main thread as ``KeyboardInterrupt`` wherever it runs. While
    sending or waiting, the call records the outcome ``interrupted`` and the policy interrupts the
    ranks (a rank whose request was cut in half is killed: its channel is torn); once every rank
    replied (unpickling the results, showing the output), only this call's results are lost and
    the group stays ready; anywhere else the group is torn down, and ``restart()`` brings it back.

    Locks, outermost first (:data:`nbdist.wire.locks.ORDER`; a thread holding one may take only a
    later one, and the test suite checks every acquisition against this order -- module-level
    locks too, and every move of a rank's state against the lock below that guards it):
    ``panel`` (a launcher panel's refresh; it reads ``status()``) -> ``group`` (the group's
    ``RLock``: a call, a lifecycle change) -> ``ranks`` (a running group's
    :class:`~nbdist.runtime.ranks.RankSet`: its holder alone reads the control channels and moves
    the ranks' states -- the caller's thread in a call, under ``group``; a job's thread while it
    waits, without it; the teardown) -> ``generations`` (the regenerate thread's hand-over) ->
    ``relay`` (an output relay's buffers; the router and the lifeline hook run under it; a
    generation's relay nests the group's in ``move_to``) -> ``abort`` (an attached group's abort
    of its ranks) -> ``output`` (the router's folder) -> ``display`` (a job output display,
    :mod:`nbdist.ui.joboutput`) -> ``sink`` (the sink thread's queue) -> ``metrics`` (a call's
    rows) -> ``lifeline`` and ``channel`` (one writer per socket) -> the leaves, under which
    nothing else is taken: ``pauses`` (a job's ranks at a breakpoint), ``stacks`` (the stacks box,
    :class:`~nbdist.runtime.stacks.StacksBox`: whichever thread reads a rank's channel posts its
    stack there; ``Group.stacks()`` reads the channels itself, under the group's lock, only when
    it could take that lock at once and no job runs), ``spares`` (:mod:`.spares`), ``main`` (the
    ``__main__`` swap), ``interrupts`` (a rank's move between requests and its watchdog's
    SIGINT for one, :class:`~nbdist.runtime.worker_signals.Interrupts`) -> ``raising`` (a rank's
    SIGINT on Windows) -> ``segments`` (the
    shared-memory mappings a Windows process holds) -> ``pool`` (segment hooks; finalizers take
    it). Outside the order, on the ranks only: the log batcher's and the stream pumps' locks
    (``interrupts`` and ``raising`` are in it but taken on the ranks only). A control channel is
    torn per direction: a debugger's thread may send on it while another thread reads it.

    On a rank (:mod:`.worker`): the main thread serves requests; the *watchdog*
    (``nbdist-watchdog``) reads the lifeline and interrupts, kills or exits the process
    (:mod:`.rankserver`; an unanswered interrupt is sent again from ``nbdist-interrupt``,
    :mod:`.worker_signals`), and hands each stack request to a short-lived ``nbdist-stacks``
    thread, which takes the stacks and sends them over the control channel (so no failure there
    can end the watchdog); a ``breakpoint()`` in user code
    makes the main thread itself read pdb commands from the channel (:mod:`.rankpdb`), which the
    notebook's waiting thread answers from the kernel's stdin (:mod:`.stacks`; the channel's send
    lock keeps its messages whole beside the main thread's replies); where fds 1 and 2 are pipes, one *pump* per stream
    (``nbdist-pump-stdout`` / ``-stderr``) forwards them to the caller (:mod:`nbdist.wire.pump`,
    chosen in :mod:`.streams`).

    Who writes what: the group's ``_state``, ``_rs``, ``_inc``, ``_job``, ``_last_call`` -- the
    thread holding the group's lock (``_stop_requested`` also ``stop()`` from another thread,
    which only sets it); a :class:`~nbdist.runtime.ranks.Rank` -- its own methods, called by the
    thread holding its rank set's ``ranks`` lock (checked by the suite; while ranks start, the
    thread starting them: the caller's, or the regenerate thread for a generation nobody has
    taken yet); a
    :class:`~nbdist.runtime.calls.Call`'s ``pending`` / ``replies`` / ``dead`` -- the thread
    waiting on it; its ``output`` and ``lines`` -- the relay thread (what each rank printed,
    appended by the router; the job's thread reads the count, never iterates the dict the relay
    grows); its ``metrics`` -- the waiting thread, under ``metrics`` (readers take copies); a
    relay's buffers and streams -- whoever holds ``relay`` (only its reads close a stream).

May import: :mod:`nbdist.backends`, :mod:`nbdist.wire`, :mod:`nbdist.errors`, :mod:`nbdist.report`,
torch. Never strategies, memory, bench, Lightning or the notebook layer: code from those reaches
the ranks by value (cloudpickle) or as ``"module:function"`` rank hooks.
"""
