"""The stall analysis of the ranks' recorded collectives (nbdist.runtime.recorder.analyse): what it
says for mismatched collectives, a rank that never reached one, all ranks inside one, and none;
and what a RemoteError says of the collectives its ranks raised in (``failed_in``).
Records are ``[seq, op, group, shape, dtype, issued, returned]`` as the ranks send them (and
``"raised"`` after them where the collective raised)."""
from nbdist.runtime.recorder import analyse, failed_in


def rec(seq, op="all_reduce", group="default", shape=(1024,), dtype="float32", done=True):
    return [seq, op, group, shape, dtype, 1.0, 2.0 if done else None]


def test_nothing_running_says_nothing():
    assert analyse({0: [rec(1)], 1: [rec(1)]}, {}) == []
    assert analyse({0: [], 1: None}, {}) == []


def test_mismatched_ops_and_shapes_are_named_by_rank():
    records = {0: [rec(17), rec(18, done=False)], 1: [rec(17), rec(18, "broadcast", shape=(10,),
                                                                    done=False)],
               2: [rec(17), rec(18, done=False)], 3: [rec(17), rec(18, done=False)]}
    assert analyse(records, {}) == [
        "mismatched collectives: ranks 0, 2, 3 are in all_reduce #18 (1024 float32); rank 1 is in "
        "broadcast #18 (10 float32)."]


def test_a_rank_that_never_reached_the_collective_is_placed():
    records = {0: [rec(17), rec(18, done=False)], 1: [rec(17), rec(18, done=False)],
               2: [rec(17), rec(18, done=False)], 3: [rec(17)]}
    assert analyse(records, {3: "model.py:88 forward"}) == [
        "rank 3 never reached collective #18 (its last was #17); it is at model.py:88 forward."]


def test_all_ranks_inside_one_collective_blame_the_collective():
    records = {0: [rec(5, "barrier", shape=None, dtype=None, done=False)],
               1: [rec(5, "barrier", shape=None, dtype=None, done=False)]}
    assert analyse(records, {}) == [
        "ranks 0, 1 are all in barrier #5: the collective itself has not completed (a slow or "
        "lost peer, or the network)."]


def test_subgroups_and_shapes_read_plainly():
    records = {0: [rec(2, "all_gather_into_tensor", "group 1", (4, 8), "bfloat16", done=False)],
               1: [rec(1, "all_gather_into_tensor", "group 1", (4, 8), "bfloat16")]}
    assert analyse(records, {1: "<dist-cell-3>:2 <module>"}) == [
        "rank 1 never reached collective #2 on group 1 (its last was #1); it is at "
        "<dist-cell-3>:2 <module>."]


class _Held(list):
    """A record whose copy waits, inside :func:`recorder.snapshot`, until the main thread has
    recorded another collective: the interleaving of a stack request (the watchdog thread) with
    the rank's main thread issuing a collective, forced."""

    def __init__(self, entry, reached, go):
        super().__init__(entry)
        self.reached, self.go = reached, go

    def __iter__(self):
        self.reached.set()
        assert self.go.wait(10), "the collective was never recorded"
        return super().__iter__()


def test_a_snapshot_taken_while_the_main_thread_records_a_collective_does_not_fail():
    """Issue 34, risk 4: ``snapshot()`` (the watchdog, answering a stack request) iterated the
    records while the main thread appended one; the RuntimeError ended the watchdog, and the rank
    could no longer be interrupted, killed or aborted."""
    import threading

    from nbdist.runtime import recorder

    saved, counts = list(recorder._records), dict(recorder._counts)
    recorder._records.clear()
    reached, go = threading.Event(), threading.Event()
    recorder._records.append(_Held(rec(1), reached, go))
    recorder._records.append(rec(2))
    got, errors = [], []

    def watchdog():
        try:
            got.append(recorder.snapshot())
        except RuntimeError as err:  # "deque mutated during iteration"
            errors.append(err)

    try:
        thread = threading.Thread(target=watchdog)
        thread.start()
        assert reached.wait(10)
        collective = recorder._wrap("barrier", lambda: None, type(None), type(None))
        collective()  # the main thread records a collective meanwhile
        go.set()
        thread.join(10)
        assert errors == [] and not thread.is_alive()
        assert [e[0] for e in got[0]] == [1, 2]  # the records as they were when it was asked
        assert recorder.snapshot()[-1][1] == "barrier" and len(recorder._records) == 3
    finally:
        go.set()
        recorder._records.clear()
        recorder._records.extend(saved)
        recorder._counts.clear()
        recorder._counts.update(counts)


def test_one_rank_inside_a_collective_reads_in_the_singular():
    records = {0: [rec(2, "barrier", shape=None, dtype=None, done=False)]}
    assert analyse(records, {}) == [
        "rank 0 is in barrier #2: the collective itself has not completed (a slow or lost peer, "
        "or the network)."]


def test_the_collectives_failed_ranks_raised_in_are_named():
    assert failed_in({0: rec(3) + ["raised"], 1: rec(3, "broadcast", shape=(1,)) + ["raised"]}) == (
        "Mismatched collectives: rank 0 failed in all_reduce #3 (1024 float32); rank 1 failed in "
        "broadcast #3 (1 float32).")
    assert failed_in({0: rec(3) + ["raised"], 1: rec(3) + ["raised"]}) == (
        "Ranks 0, 1 failed in all_reduce #3 (1024 float32).")
    assert failed_in({0: None, 1: None}) == ""
