"""A rank's state has one owner: the Rank's own methods, along Rank.MOVES, and nothing else in the
runtime writes it (issue 25). The processes behind ranks answer one interface: nothing asks which
kind it has."""
import ast
import pathlib

import pytest

import nbdist
from nbdist.runtime import processes
from nbdist.runtime.ranks import MOVES, Rank

RUNTIME = pathlib.Path(nbdist.__file__).parent / "runtime"


class _Exited(processes.Process):
    exit_status = None


def test_a_rank_moves_through_its_life_by_its_methods():
    r = Rank(0, _Exited())
    assert r.state == "starting"
    r.ready({"backend": "gloo"})
    assert (r.state, r.info) == ("idle", {"backend": "gloo"})
    r.begin("run f", 12.5)
    assert (r.state, r.busy_with, r.since) == ("busy", "run f", 12.5)
    r.replied()
    assert (r.state, r.busy_with, r.since) == ("idle", "", None)
    r.settled()  # not busy: nothing to do
    r.begin("run g", 13.0)
    r.settled()
    assert r.state == "idle"
    r.failed("ValueError: x")
    assert r.last_error == "ValueError: x" and r.state == "idle"
    r.died()
    r.stopped()  # dead stays dead
    assert r.state == "dead"


@pytest.mark.parametrize("start, move", [("starting", "begin"), ("idle", "replied"),
                                         ("stopped", "ready")])
def test_a_move_the_state_machine_does_not_have_is_an_internal_error(start, move):
    r = Rank(3, _Exited())
    for step in {"starting": [], "idle": ["ready"], "stopped": ["stopped"]}[start]:
        getattr(r, step)(*([{}] if step == "ready" else []))
    args = {"begin": ("x", 0.0), "ready": ({},)}.get(move, ())
    with pytest.raises(RuntimeError, match=f"rank 3 cannot go from '{start}'"):
        getattr(r, move)(*args)
    assert r.state == start


def test_the_state_is_read_only_and_every_state_is_in_the_machine():
    r = Rank(0, _Exited())
    with pytest.raises(AttributeError):
        r.state = "idle"
    assert set(MOVES) == {to for tos in MOVES.values() for to in tos} | {"starting"}


def _writes(tree, names):
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and el.attr in names and not (
                        isinstance(el.value, ast.Name) and el.value.id == "self"):
                    yield el.attr, node.lineno


def test_no_module_of_the_runtime_writes_a_rank_s_state_but_the_rank():
    fields = {"state", "_state", "busy_with", "since", "info", "last_error", "generation"}
    found = []
    for path in sorted(RUNTIME.glob("*.py")):
        if path.name == "ranks.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [f"{path.name}:{line} .{name}" for name, line in _writes(tree, fields)]
    assert found == []


def test_nothing_above_the_processes_asks_which_kind_of_process_it_has():
    for path in sorted(RUNTIME.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        for probe in ('getattr(r.process', 'getattr(self.process', 'getattr(rs[r].process',
                      'isinstance(r.process', ".remote\n", "rs.remote"):
            assert probe not in text, f"{path.name} uses {probe!r}"
    local, remote = processes.LocalProcess, processes.RemoteProcess
    for name in ("exit_status", "where", "node", "ended_by_us", "kill", "join", "abort",
                 "expect_exit", "release", "sentinel", "pid"):
        assert hasattr(local, name) or name == "pid", name
        assert hasattr(remote, name) or name in ("pid",), name
