"""A teardown runs to its end however often Ctrl-C comes (issue 25, risk 3): a second interrupt
halfway through ``stop()`` used to leave the output relay's thread, the group's temp dir and its
store behind, because the group had already let go of them.

Each case interrupts a real group's ``stop()`` at one step of its teardown: with a real SIGINT
delivered right there ("signal": what Ctrl-C does), or with the step itself raising
``KeyboardInterrupt`` ("raise": a step that fails). Either way everything is released, then the
interrupt is raised.
"""
import os
import signal

import pytest

import nbdist
from nbdist.runtime import launcher, processes, reaper
from nbdist.wire import relay, segments

pytestmark = pytest.mark.timeout(120)

#: where a teardown can be interrupted: (object, attribute) of the step
POINTS = {
    "reaping the ranks": (processes.LocalProcess, "join"),
    "killing stragglers": (reaper, "reap"),
    "showing the last output": (relay.OutputRelay, "drain"),
    "closing the output relay": (relay.OutputRelay, "close"),
    "removing result segments": (segments, "remove_segments"),
    "launcher cleanup": (launcher.LocalLauncher, "cleanup"),
}


def interrupting(original, how):
    """``original``, interrupted the first time it runs."""
    fired = []

    def step(*args, **kwargs):
        if not fired:
            fired.append(True)
            if how == "signal":
                signal.raise_signal(signal.SIGINT)  # Python's handler runs right here
            else:
                raise KeyboardInterrupt
        return original(*args, **kwargs)

    return step


@pytest.mark.parametrize("how, point", [("signal", p) for p in POINTS] +
                         [("raise", "reaping the ranks"), ("raise", "showing the last output"),
                          ("raise", "launcher cleanup")])
def test_an_interrupted_stop_still_releases_everything(monkeypatch, how, point):
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30)
    inc = g._inc
    tmp, output, procs = inc.tmp, inc.relay._thread, [r.process for r in inc.rs.ranks]
    owner, name = POINTS[point]
    monkeypatch.setattr(owner, name, interrupting(getattr(owner, name), how))
    with pytest.raises(KeyboardInterrupt):
        g.stop()
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not output.is_alive(), "the output relay's thread outlived the teardown"
    assert not os.path.exists(tmp), "the group's temp dir outlived the teardown"
    assert all(p.exit_status is not None for p in procs), "a rank outlived the teardown"
    assert inc.store is None and inc.relay._closed
    g.stop()  # what the interrupted stop() left to do: only its own state
    assert g.state == "stopped"


def test_an_interrupted_stop_of_an_attached_group_still_closes_its_listener(tmp_path, monkeypatch):
    from attach_helpers import Cluster
    from nbdist.runtime import generations

    c = Cluster(tmp_path, nnodes=1, nproc=1)
    listener = c.group._launcher.regen.listener
    close = generations.Regenerator.close
    monkeypatch.setattr(generations.Regenerator, "close", interrupting(close, "signal"))
    with pytest.raises(KeyboardInterrupt):
        c.group.stop()
    monkeypatch.undo()
    assert listener.fileno() == -1, "the control listener outlived the teardown"
    assert c.group._launcher.regen is None
    assert c.close() == [0]  # the ranks were stopped cleanly before the interrupt came
