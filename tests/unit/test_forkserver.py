"""nbdist.runtime.forkserver: the hidden ``__main__`` while workers (or the forkserver) start."""
from __future__ import annotations

import sys
import threading

import pytest

from nbdist.runtime.forkserver import main_hidden


def _run_in_thread(target):
    """Start ``target`` in a thread; the returned list gets the exception it raised, if any."""
    errors = []

    def run():
        try:
            target()
        except BaseException as err:  # noqa: BLE001 -- handed to the test, which re-raises it
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


@pytest.mark.timeout(30)
def test_overlapping_main_hidden_in_two_threads_restore_the_real_main():
    """Thread A hides ``__main__``, B hides it too, A leaves first, then B: B must still see a
    stand-in after A left, and the real ``__main__`` must be back once both have left."""
    real = sys.modules["__main__"]
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with main_hidden():
            seen["a"] = sys.modules["__main__"]
            a_in.set()
            assert b_in.wait(10)
        a_out.set()

    def b():
        assert a_in.wait(10)
        with main_hidden():
            b_in.set()
            assert a_out.wait(10)
            seen["b after a left"] = sys.modules["__main__"]

    threads = [_run_in_thread(a), _run_in_thread(b)]
    for thread, errors in threads:
        thread.join(20)
        assert not thread.is_alive()
        if errors:
            raise errors[0]
    assert sys.modules["__main__"] is real
    for when, main in seen.items():
        assert main is not real and not hasattr(main, "__file__"), when


@pytest.mark.timeout(30)
def test_main_hidden_nested_and_after_an_error():
    real = sys.modules["__main__"]
    with pytest.raises(RuntimeError, match="inside"):
        with main_hidden():
            with main_hidden():
                assert sys.modules["__main__"] is not real
            assert sys.modules["__main__"] is not real
            raise RuntimeError("inside")
    assert sys.modules["__main__"] is real
