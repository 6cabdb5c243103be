"""The kernel imports torch only when it needs it (issue 39): starting a group on a machine where
torch certainly sees no GPU, and calls that move no tensor, leave torch unimported in the kernel;
the first tensor that arrives imports it."""
import subprocess
import sys

import pytest

from nbdist.backends import resolve

SCRIPT = r"""
import sys
import nbdist
print("resolved", nbdist.resolve_backend("auto", "auto").backend, "torch" in sys.modules)
with nbdist.start(2, threads=1) as g:
    print("started", "torch" in sys.modules)
    print("ran", g.run(lambda: 41 + 1), g.exec("rank * 2"), "torch" in sys.modules)
    t = g.run(lambda: __import__("torch").ones(2))
    print("tensor", type(t[0]).__name__, "torch" in sys.modules)
"""


def test_a_group_starts_and_runs_without_torch_in_the_kernel():
    if resolve.torch_build().get("cuda") is not None or resolve.torch_build().get("hip"):
        pytest.skip("a GPU build of torch: the kernel asks torch itself whether a GPU is visible")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if not line.startswith("nbdist:")]
    assert lines == ["resolved gloo False", "started False", "ran [42, 42] [0, 2] False",
                     "tensor Tensor True"]


def test_the_build_is_read_from_torch_without_importing_it():
    import torch

    build = resolve.torch_build()
    assert build == {"cuda": torch.version.cuda, "hip": torch.version.hip,
                     "xpu": getattr(torch.version, "xpu", None)}


@pytest.mark.parametrize("build, nvidiactl, platform, expected", [
    ({"cuda": None, "hip": None, "xpu": None}, True, "linux", True),   # a CPU build: certain
    ({"cuda": "13.0", "hip": None, "xpu": None}, False, "linux", True),  # no NVIDIA driver
    ({"cuda": "13.0", "hip": None, "xpu": None}, True, "linux", False),  # ask torch
    ({"cuda": "12.8", "hip": None, "xpu": None}, False, "win32", False),  # ask torch
    ({"cuda": None, "hip": "6.4", "xpu": None}, False, "linux", False),  # ROCm: ask torch
    ({}, False, "linux", False),                                         # unknown: ask torch
])
def test_only_a_certain_answer_skips_torch(monkeypatch, build, nvidiactl, platform, expected):
    monkeypatch.setattr(resolve, "_BUILD", build)
    monkeypatch.setattr(resolve.os.path, "exists", lambda p: nvidiactl and p == "/dev/nvidiactl")
    monkeypatch.setattr(resolve.sys, "platform", platform)
    monkeypatch.delitem(sys.modules, "torch")  # as in a kernel that never imported it
    assert resolve._surely_no_gpu() is expected
