"""A background job's stall watch (:class:`nbdist.runtime.stacks.StallWatch`) against the relay
thread, which adds what the ranks print to the call while the job's thread ticks the watch
(issue 34, risk 3): a real call, a real second thread, the interleaving forced."""
import threading

import pytest

from nbdist.runtime.calls import OUTPUT_LINES, Call
from nbdist.runtime.stacks import StallWatch

pytestmark = pytest.mark.timeout(30)


class _Lines(list):
    """Rank 0's lines: counting them waits until the other thread added rank 1's first line."""

    def __init__(self, reached, added):
        super().__init__()
        self.reached, self.added = reached, added

    def __len__(self):
        self.reached.set()
        assert self.added.wait(10), "the relay thread never added its line"
        return super().__len__()


def test_a_ranks_first_line_arriving_while_the_watch_looks_is_progress_not_an_error():
    """The stall watch iterated ``call.output`` on the job's thread while the relay thread added
    a rank's first line: ``RuntimeError: dictionary changed size during iteration`` left the
    watch's tick, ended the job's wait, and the job's end tore a healthy group down."""
    call = Call(1, "exec", None, [0, 1], None, "exec")
    reached, added = threading.Event(), threading.Event()
    added.set()  # while the watch is made, counting waits for nothing
    call.output[0] = _Lines(reached, added)
    watch = StallWatch(call, None, stall=3600.0)  # never stalled here: no stacks are asked for
    reached.clear()
    added.clear()  # from now on counting rank 0's lines waits for the relay thread

    def relay():  # the relay thread: rank 1's first line, while the job's thread counts
        reached.wait(10)
        call.add_output(1, "hello from rank 1")
        added.set()

    thread = threading.Thread(target=relay)
    thread.start()
    try:
        watch.tick()  # the job's thread
    finally:
        reached.set()
        thread.join(10)
    watch.tick()
    assert call.output[1] == ["hello from rank 1"]
    assert watch._seen[1] == 1  # the line was seen as progress


def test_lines_beyond_those_kept_are_still_progress():
    """Past the :data:`OUTPUT_LINES` kept per rank, a rank that prints still makes progress."""
    call = Call(1, "exec", None, [0], None, "exec")
    call.add_output(0, "\n".join(["x"] * OUTPUT_LINES))
    watch = StallWatch(call, None, stall=3600.0)
    call.add_output(0, "one more")
    watch.tick()
    assert len(call.output[0]) == OUTPUT_LINES and watch._seen[1] == OUTPUT_LINES + 1
