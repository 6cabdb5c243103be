"""What the tests that stop or interrupt a group from another thread share (tests/integration, on
sys.path while they run): a call run on a thread of its own, how long to wait for it, and a
Ctrl-C that the OS hands to a thread other than the main one."""
import contextlib
import signal
import threading

from nbdist.wire.deadline import Deadline, poll_until

#: How long a test waits for a call that must end while something else stays blocked: a liveness
#: bound (the call ends within about a second), not a speed target.
LIVENESS = 60.0


def in_thread(fn, *args, **kwargs):
    """Run ``fn`` on a thread of its own; ``(thread, box)``: box gets "value" or "error"."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 -- the test inspects whatever it was
            box["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


@contextlib.contextmanager
def ctrl_c_elsewhere(after: float, ready=lambda: True):
    """Within the block: SIGINT to a thread of this process that is not the main one, ``after`` s
    after ``ready()`` first holds (polled; at most 60 s). The OS may deliver a process's SIGINT to
    any thread that does not block it; Python runs the handler on the main thread only, once that
    thread runs Python code again. Nothing is sent once the block has ended."""
    lock, done, release = threading.Lock(), threading.Event(), threading.Event()
    bystander = threading.Thread(target=release.wait, daemon=True)
    bystander.start()

    def send():
        poll_until(lambda: ready() or done.is_set(), done.wait, Deadline(60), cap=0.05)
        if done.is_set() or not ready() or done.wait(after):
            return
        with lock:  # the bystander still runs: the block has not ended
            if not done.is_set():
                signal.pthread_kill(bystander.ident, signal.SIGINT)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        yield
    finally:
        with lock:
            done.set()
        sender.join()
        release.set()
        bystander.join()
