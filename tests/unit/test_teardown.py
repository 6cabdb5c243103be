"""Teardown that runs to its end (nbdist.runtime.teardown): the two tools, with real signals."""
import signal
import threading

import pytest

from nbdist.runtime.teardown import interrupts_deferred, run_all

pytestmark = pytest.mark.timeout(30)


def test_every_step_runs_and_the_first_error_is_raised_after_the_last():
    ran = []

    def fails(what):
        def step():
            ran.append(what)
            raise what

        return step

    errors = [KeyboardInterrupt(), OSError("second")]
    with pytest.raises(KeyboardInterrupt):
        run_all(fails(errors[0]), lambda: ran.append("middle"), fails(errors[1]),
                lambda: ran.append("last"))
    assert ran == [errors[0], "middle", errors[1], "last"]


def test_a_ctrl_c_inside_is_raised_once_the_block_is_done():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # pressed twice: one interrupt after
            done.append("the rest of the block")
    assert done == ["the rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_nested_blocks_raise_at_the_outermost_end():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            with interrupts_deferred():
                signal.raise_signal(signal.SIGINT)
            done.append("after the inner block")
    assert done == ["after the inner block"]


def test_the_handler_in_place_gets_the_interrupt():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            assert seen == []
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_other_threads_run_it_unchanged():
    box = {}

    def work():
        with interrupts_deferred():
            box["ran"] = True

    t = threading.Thread(target=work)
    t.start()
    t.join(10)
    assert box == {"ran": True}
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
