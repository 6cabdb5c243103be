"""What the tests that stop or interrupt a group from another thread share (tests/integration, on
sys.path while they run): a call run on a thread of its own, and how long to wait for it."""
import threading

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
