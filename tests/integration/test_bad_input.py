"""Bad input gets a clear error, and the group -- with its per-rank state -- stays usable."""
import threading

import pytest
import torch

import nbdist
from nbdist.wire.segments import shm_prefix

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def g():
    group = nbdist.start(2, backend="gloo", timeout=30)
    group.exec("marker = rank * 100")
    yield group
    group.stop()


def _still_usable(group):
    assert group.pull("marker") == [0, 100]
    assert group.exec("t = torch.ones(1); dist.all_reduce(t); t.item()") == [2.0, 2.0]


START_CASES = [
    (dict(world_size=0), ValueError, "world_size must be at least 1, got 0"),
    (dict(world_size=-3), ValueError, "at least 1"),
    (dict(world_size=2.5), TypeError, "world_size must be an int, got float"),
    (dict(world_size="2"), TypeError, "world_size must be an int, got str"),
    (dict(world_size=True), TypeError, "world_size must be an int, got bool"),
    (dict(world_size=10_000), ValueError, "max_world_size="),
    (dict(device="tpu"), ValueError, "device must be 'auto' or one of"),
    (dict(device="cuda"), ValueError, "not usable here: no CUDA device"),
    (dict(backend="foo"), nbdist.BackendError, "unknown backend 'foo'.*Available here for 'cpu': gloo"),
    (dict(backend="nccl"), nbdist.BackendError, "NCCL is not built into this torch.*use backend='gloo'"),
    (dict(backend="mpi"), nbdist.BackendError, "MPI is not built into this torch"),
    (dict(backend="cpu:gloo,cuda:nccl"), nbdist.BackendError, "'cuda:nccl' of 'cpu:gloo,cuda:nccl' cannot be used"),
    (dict(backend="cpu:gloo,nccl"), nbdist.BackendError, "cannot parse backend string"),
    (dict(backend="tpu:gloo"), nbdist.BackendError, "unknown device 'tpu' in backend string"),
    (dict(backend=5), TypeError, "backend must be a string"),
    (dict(timeout=-1), ValueError, "timeout must be a positive number of seconds, got -1"),
    (dict(timeout="soon"), ValueError, "timeout must be a positive number"),
    (dict(timeout=0.0001), ValueError, r"timeout must be at least 1 s \(the ranks' rendezvous and "
     r"every collective must finish within it\), got 0.0001"),
    (dict(init_timeout=0.5), ValueError, r"init_timeout must be at least 1 s \(the ranks need "
     r"longer than that to start\), got 0.5"),
    (dict(threads=0), ValueError, "threads must be a positive int"),
    (dict(call_timeout=0), ValueError, "call_timeout must be a positive number"),
]


@pytest.mark.parametrize("kwargs,exc,match", START_CASES)
def test_bad_start_arguments_fail_before_anything_starts(cpu_only_torch, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        nbdist.start(**kwargs)


def test_unpicklable_function_argument_names_the_object(g):
    lock = threading.Lock()
    with pytest.raises(TypeError, match="cannot send the function .*<lambda> .*cannot be pickled.*lock"):
        g.run(lambda: lock.acquire())
    _still_usable(g)


def test_unpicklable_argument(g):
    with pytest.raises(TypeError, match="cannot be pickled"):
        g.run(print, threading.Lock())
    _still_usable(g)


def test_not_callable(g):
    with pytest.raises(TypeError, match="fn must be callable, got int"):
        g.run(42)
    _still_usable(g)


def test_unpicklable_result_is_reported_by_rank(g):
    with pytest.raises(nbdist.RemoteError, match=r"result on rank \d .*generator.* could not be pickled"):
        g.exec("(i for i in range(3))")
    _still_usable(g)


def test_syntax_error_shows_the_line_without_a_round_trip(g):
    with pytest.raises(SyntaxError) as info:
        g.exec("x = 1\ny = (2 +\n")
    assert info.value.lineno in (2, 3)
    _still_usable(g)


@pytest.mark.parametrize("code", ["input('name? ')", "import sys; sys.stdin.read()",
                                  "import sys; next(iter(sys.stdin))"])
def test_reading_stdin_on_a_rank_says_there_is_none_and_what_to_do(g, code):
    with pytest.raises(nbdist.RemoteError) as info:
        g.exec(code)
    assert info.value.ranks == [0, 1]
    failure = info.value.failures[1]
    assert failure.type_name == "EOFError"  # what code that handles the end of input expects
    assert "rank 1 has no stdin: input() and sys.stdin cannot read from the notebook" in \
        failure.message
    assert "%dist_push name (or g.push(name=value))" in failure.message
    _still_usable(g)


def test_exec_needs_a_string(g):
    with pytest.raises(TypeError, match="source must be a str of Python code, got bytes"):
        g.exec(b"1")
    _still_usable(g)


def test_pull_of_a_missing_name(g):
    with pytest.raises(nbdist.RemoteError, match="name 'nope' not defined on rank [01]"):
        g.pull("nope")
    _still_usable(g)


def test_pull_needs_names(g):
    with pytest.raises(ValueError, match="pull\\(\\) needs at least one variable name"):
        g.pull()
    with pytest.raises(ValueError, match="pull\\(\\) takes variable names, got 3"):
        g.pull(3)
    _still_usable(g)


def test_push_of_an_unpicklable_value(g):
    with pytest.raises(TypeError, match="cannot send the pushed value"):
        g.push(bad=threading.Lock())
    _still_usable(g)


def test_push_with_a_bad_name(g):
    with pytest.raises(ValueError, match="push\\(\\) names must be variable names, got 'a b'"):
        g.push({"a b": 1})
    with pytest.raises(ValueError, match="got 'class' \\(a Python keyword\\)"):
        g.push({"class": 1})
    with pytest.raises(ValueError, match="pull\\(\\) takes variable names, got 'for' "
                                         "\\(a Python keyword\\)"):
        g.pull("for")
    _still_usable(g)


@pytest.mark.parametrize("ranks,match", [([5], "ranks must be ints in 0..1"), ([], "ranks must be"),
                                         (["0"], "ranks must be ints"), ([True], "ranks must be")])
def test_bad_ranks(g, ranks, match):
    with pytest.raises(ValueError, match=match):
        g.exec("1", ranks=ranks)
    _still_usable(g)


@pytest.mark.parametrize("timeout", [0, -1, True])
def test_bad_call_timeout(g, timeout):
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        g.exec("1", timeout=timeout)
    _still_usable(g)


def test_restart_with_unknown_or_bad_options_keeps_the_running_group(g):
    with pytest.raises(TypeError, match="restart\\(\\) got unknown option\\(s\\) \\['worldsize'\\]"):
        g.restart(worldsize=3)
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        g.restart(world_size=0)
    with pytest.raises(ValueError, match="timeout must be at least 1 s"):
        g.restart(timeout=0.0001)
    with pytest.raises(ValueError, match="pass max_world_size= to raise the limit"):
        g.restart(world_size=10_000)
    _still_usable(g)


def test_user_code_raising_systemexit_does_not_stop_a_rank(g):
    with pytest.raises(nbdist.RemoteError, match="SystemExit"):
        g.exec("import sys; sys.exit(3)")
    _still_usable(g)


def test_a_benchmark_size_that_cannot_fit_is_refused_before_anything_is_sent(g):
    from nbdist import bench

    with pytest.raises(ValueError) as info:
        bench.collectives(g, ops="all_reduce,all_to_all", sizes="4K,1024G", progress=False)
    message = str(info.value)
    assert "the largest size, 1024 GiB, does not fit in memory: all_to_all at that size needs " \
           "about" in message, message
    assert "GiB available" in message and "Use sizes up to" in message, message
    with pytest.raises(ValueError, match="a size must be a positive number of bytes, got '-4K-1M'"):
        bench.collectives(g, sizes="-4K-1M", progress=False)
    _still_usable(g)


def test_call_on_a_stopped_group():
    group = nbdist.start(2)
    group.stop()
    with pytest.raises(nbdist.GroupClosedError, match="this group was stopped"):
        group.run(lambda: 1)
    group.stop()  # stopping twice is harmless


def test_register_backend_mistakes():
    with pytest.raises(nbdist.BackendError, match="'gloo' is a built-in torch backend name"):
        nbdist.register_backend("gloo", lambda *a: None)
    with pytest.raises(ValueError, match="must look like 'package.module:function'"):
        nbdist.register_backend("mine", "no_colon_here")
    with pytest.raises(TypeError, match="creator must be a callable"):
        nbdist.register_backend("mine", 42)
    with pytest.raises(nbdist.BackendError, match="cannot load the creator 'nope.mod:create'"):
        nbdist.register_backend("mine", "nope.mod:create")
    with pytest.raises(ValueError, match="unknown device 'tpu' for backend 'mine'"):
        nbdist.register_backend("mine", lambda *a: None, devices=["tpu"])
    with pytest.raises(ValueError, match="identifier-like"):
        nbdist.register_backend("my backend", lambda *a: None)
    nbdist.register_backend("mine", "nbdist.store_backend:create")
    try:
        with pytest.raises(nbdist.BackendError, match="already registered.*replace=True"):
            nbdist.register_backend("mine", "nbdist.store_backend:register")
        row = [r for r in nbdist.backends.backend_report("cuda") if r[0] == "mine"][0]
        assert row == ("mine", False, "registered for devices ['cpu'], not 'cuda'")
    finally:
        nbdist.backends.unregister_backend("mine")


def test_tensor_roundtrip_keeps_dtype_and_shape(g):
    for dtype in (torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.uint8):
        t = torch.ones(300, 301, dtype=dtype)
        g.push(t=t)
        back = g.pull("t")[1]
        assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)
    _still_usable(g)


def test_a_failed_result_gives_its_shared_memory_back(g):
    import glob

    def segments():
        return glob.glob(shm_prefix(g.id, "r0") + "*")  # /dev/shm, or the temp dir without one

    before = len(segments())
    for _ in range(3):
        with pytest.raises(nbdist.RemoteError, match="could not be pickled"):
            g.exec("(torch.ones(1_000_000), (i for i in range(3)))", ranks=[0])
    assert len(segments()) <= before + 1  # one pooled segment reused, not one per failure
    _still_usable(g)
