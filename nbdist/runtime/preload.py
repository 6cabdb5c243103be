"""What nbdist's forkserver imports before it serves: the worker module, and torch with it.

Jupyter's "interrupt kernel" and "shut down kernel" send SIGINT to the kernel's whole process
group, and the forkserver is in it. While it imports torch (a second or two after
``%load_ext nbdist``) such a SIGINT would kill it with a ``KeyboardInterrupt`` traceback in the
kernel's log. :func:`nbdist.runtime.forkserver.prewarm` therefore starts the forkserver with SIGINT
blocked (which covers Python's own start-up), and this module, first thing, ignores SIGINT (the
forkserver ignores it anyway once it serves) and unblocks it, so the workers it forks don't inherit
the block: each worker sets its own SIGINT handling (:mod:`nbdist.runtime.worker`).

In a process that did not start with SIGINT blocked, that part changes nothing.

Then the modules ``NBDIST_PRELOAD`` lists (:mod:`.imports`): what every rank forked from here, or
every warm spare, then starts with. A name that fails here is skipped; each rank's own import of it
then fails its start and says why.

Last, a collection and :func:`gc.freeze` (below): every object alive then is out of the
collector's sight for good, in this process and in each rank forked from it. So
``gc.get_objects()`` and ``gc.get_referrers()`` on a rank do not see them either (the memory
accounting then cannot name a holder made at import, such as a module's global).
"""
import signal

if hasattr(signal, "pthread_sigmask") and \
        signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # drops a SIGINT that came during start-up
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])

from . import worker  # noqa: E402,F401 -- the point of the preload: torch, imported once
from . import imports  # noqa: E402

imports.from_env(strict=False)

import gc  # noqa: E402

# Last: what the imports left as garbage is freed (a module that failed above may leave cycles,
# which a freeze would keep for good), then every object alive (torch's modules, mostly) leaves the
# collector's generations. A forked rank's full collections then never walk them: such a walk
# writes to the header of every object it visits, which copied about 36 MiB of the server's memory
# into each rank (9,300 pages) and cost it about 95 ms of CPU before its first call. (Part of
# Python's advice for a server that forks: the server does not disable its collector, and freezes
# once, here, not before every fork; what it allocates later is little and short-lived.) A warm
# spare (spawned, not forked) gains only cheaper full collections.
gc.collect()
gc.freeze()
