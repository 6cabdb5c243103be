"""A function's pickled request, reused only while nothing it was made from can have changed
(nbdist.runtime.fnbytes; issue 39, the trivial call). Real cloudpickle, real requests: the bytes
sent to the ranks are unpickled here and called, as a rank would."""
import sys
import types

import cloudpickle
import pytest

from nbdist.runtime import cells, fnbytes, requests

PREFIX = "/dev/shm/nbdist-test-fnbytes-"


@pytest.fixture(autouse=True)
def _fresh():
    fnbytes.clear()
    yield
    fnbytes.clear()


def notebook(source: str, name: str = "f"):
    """A function defined as in a notebook (a module nobody can import: it travels by value),
    and its globals."""
    ns = {"__name__": "nbdist_test_notebook"}
    exec(source, ns)
    return ns[name], ns


def payload(fn, *args):
    return requests.run_request(fn, args, None, PREFIX).payload


def called(data: bytes):
    fn, args, kwargs = cloudpickle.loads(data)
    return fn(*args, **kwargs)


def test_the_same_function_again_sends_the_same_bytes_without_pickling():
    f, _ = notebook("import math\nLR = 0.5\ndef f(x=2):\n    return math.floor(LR * 4) + x\n")
    first = payload(f)
    assert payload(f) is first  # kept: not pickled again
    assert called(first) == 4


def test_a_rebound_global_is_pickled_again_and_reaches_the_ranks():
    f, ns = notebook("LR = 0.5\ndef f():\n    return LR\n")
    assert called(payload(f)) == 0.5
    ns["LR"] = 0.25
    assert called(payload(f)) == 0.25
    ns["LR"] = 0.5  # an equal value, another object: pickled again too
    assert called(payload(f)) == 0.5


@pytest.mark.parametrize("source", [
    "STATE = [1]\ndef f():\n    return STATE[-1]\n",                  # a mutable global
    "def helper():\n    return 1\ndef f():\n    return helper()\n",   # another function
    "def f(x=[1]):\n    return x[-1]\n",                             # a mutable default
])
def test_what_can_change_in_place_is_pickled_on_every_call(source):
    f, _ = notebook(source)
    assert payload(f) is not payload(f)


def test_a_mutated_global_list_reaches_the_ranks():
    f, ns = notebook("STATE = [1]\ndef f():\n    return STATE[-1]\n")
    assert called(payload(f)) == 1
    ns["STATE"].append(2)
    assert called(payload(f)) == 2


def test_closures_defaults_and_attributes_are_followed():
    def make(k):
        def inner():
            return k
        return inner

    g, h = make(1), make(2)  # one code object, two closures
    assert called(payload(g)) == 1 and called(payload(h)) == 2
    assert called(payload(g)) == 1

    f, _ = notebook("def f(x=1):\n    return x\n")
    first = payload(f)
    f.__defaults__ = (3,)
    assert called(payload(f)) == 3 and payload(f) is not first

    f.note = "an attribute of its own"
    assert payload(f) is not payload(f)
    del f.note
    f.__annotations__["return"] = int
    assert payload(f) is not payload(f)


def test_keyword_only_defaults_and_arguments_are_never_kept():
    f, _ = notebook("def f(*, x=1):\n    return x\n")
    assert payload(f) is not payload(f)
    f, _ = notebook("def f(x):\n    return x\n")
    assert payload(f, 1) is not payload(f, 1)
    assert requests.run_request(f, (), {"x": 4}, PREFIX).payload is not \
        requests.run_request(f, (), {"x": 4}, PREFIX).payload


def test_an_import_invalidates():
    f, _ = notebook("import math\ndef f():\n    return math.pi\n")
    first = payload(f)
    assert payload(f) is first
    mod = types.ModuleType("nbdist_test_fnbytes_new")
    sys.modules[mod.__name__] = mod  # cloudpickle names the imported submodules a code reaches
    try:
        assert payload(f) is not first
    finally:
        del sys.modules[mod.__name__]


def test_a_module_registered_by_value_is_never_kept_and_others_do_not_matter():
    # (other test modules of the suite register themselves by value: nothing here assumes none)
    mod = types.ModuleType("nbdist_test_fnbytes_mod")
    mod.K = 1
    other = types.ModuleType("nbdist_test_fnbytes_other")
    sys.modules[mod.__name__] = mod
    sys.modules[other.__name__] = other
    try:
        f, ns = notebook("def f():\n    return mod.K\n")
        ns["mod"] = mod
        assert payload(f) is payload(f)  # an imported module travels by name
        cloudpickle.register_pickle_by_value(other)
        try:
            first = payload(f)  # the registry changed: pickled again, then kept
            assert payload(f) is first and called(first) == 1
        finally:
            cloudpickle.unregister_pickle_by_value(other)
        cloudpickle.register_pickle_by_value(mod)  # now it travels by value, its dict with it
        try:
            assert called(payload(f)) == 1
            mod.K = 2
            assert called(payload(f)) == 2
            assert payload(f) is not payload(f)
        finally:
            cloudpickle.unregister_pickle_by_value(mod)
    finally:
        del sys.modules[mod.__name__], sys.modules[other.__name__]


def test_a_new_cell_hook_names_the_code_again(monkeypatch):
    f, _ = notebook("def f():\n    return 1\n")
    first = payload(f)
    text = "def f():\n    return 1\n"
    monkeypatch.setattr(cells, "CELLS", lambda filename: ("Cell In[7]", text)
                        if filename == f.__code__.co_filename else None)
    req = requests.run_request(f, (), None, PREFIX)
    assert req.payload is not first and req.cells == {"Cell In[7]": text}
    again = requests.run_request(f, (), None, PREFIX)
    assert again.payload is req.payload and again.cells == req.cells  # the texts kept too
    assert again.cells is not req.cells


def test_large_payloads_are_not_kept_and_the_cache_is_bounded():
    f, _ = notebook("BIG = 'x' * (%d + 1)\ndef f():\n    return len(BIG)\n" % fnbytes.MAX_BYTES)
    assert payload(f) is not payload(f)
    for i in range(fnbytes.MAX_ENTRIES + 5):
        fn, _ = notebook(f"def f():\n    return {i}\n")
        payload(fn)
    assert len(fnbytes._kept) == fnbytes.MAX_ENTRIES


def test_exec_source_is_compiled_here_once_and_a_syntax_error_every_time(monkeypatch):
    compiled = []

    def counting(source, filename, mode):
        compiled.append(source)
        return compile(source, filename, mode)

    monkeypatch.setattr(requests, "_COMPILED", {})
    monkeypatch.setattr(requests, "compile", counting, raising=False)
    for _ in range(3):
        assert requests.exec_request("x = 1\n", "<dist-cell-1>").payload[0] == "x = 1\n"
    assert compiled == ["x = 1\n"]
    for _ in range(2):
        with pytest.raises(SyntaxError):
            requests.exec_request("x = (\n", "<dist-cell-2>")
    assert compiled == ["x = 1\n", "x = (\n", "x = (\n"]


def test_a_value_changed_while_the_bytes_are_made_never_stays_in_them():
    # The segment prefix is asked for between the look-up and the pickling: another thread could
    # run there. What is kept is made from the values read at the look-up, so it matches them.
    f, ns = notebook("STOP = False\ndef f():\n    return STOP\n")

    def switch():
        ns["STOP"] = True  # "another thread" sets it...
        return PREFIX

    assert called(requests.run_request(f, (), None, switch).payload) is False
    ns["STOP"] = False  # ...and back (False is a singleton: the same object again)
    assert called(payload(f)) is False
    ns["STOP"] = True
    assert called(payload(f)) is True


def test_functions_that_travel_by_reference_are_not_kept():
    lib = types.ModuleType("nbdist_test_fnbytes_lib")  # an importable module's function...
    exec("def f():\n    return 1\n", lib.__dict__)
    sys.modules[lib.__name__] = lib
    try:
        f = lib.f
        first = payload(f)
        assert payload(f) is not first
        lib.f = lambda: 2  # ...replaced there: cloudpickle now sends f itself, by value
        assert called(payload(f)) == 1 and payload(f) != first
    finally:
        del sys.modules[lib.__name__]


def test_what_the_bytes_say_is_compared_by_identity_not_equality():
    f, _ = notebook("def f():\n    return 1\n")
    f.__doc__ = "one"
    first = payload(f)
    f.__doc__ = "".join(["o", "ne"])  # equal, another object
    assert payload(f) is not first
    f.__doc__ = ["v1"]
    assert called(payload(f)) == 1 and payload(f) is not payload(f)  # mutable: never kept


def test_a_submodule_registered_by_value_is_not_kept_through_its_package():
    pkg = types.ModuleType("nbdist_test_fnbytes_pkg")
    pkg.__path__ = []
    sub = types.ModuleType("nbdist_test_fnbytes_pkg.sub")
    pkg.sub = sub
    sys.modules[pkg.__name__], sys.modules[sub.__name__] = pkg, sub
    try:
        f, ns = notebook("def f():\n    return pkg.sub\n")
        ns["pkg"] = pkg
        assert payload(f) is payload(f)
        cloudpickle.register_pickle_by_value(sub)
        try:
            assert payload(f) is not payload(f)
        finally:
            cloudpickle.unregister_pickle_by_value(sub)
    finally:
        del sys.modules[pkg.__name__], sys.modules[sub.__name__]


def test_arguments_are_taken_as_a_sequence_not_tested_for_truth():
    class Ambiguous(tuple):
        def __bool__(self):
            raise ValueError("the truth value is ambiguous")

    f, _ = notebook("def f(a, b):\n    return a + b\n")
    assert called(requests.run_request(f, Ambiguous((1, 2)), None, PREFIX).payload) == 3
