"""Backend resolution (DESIGN.md's table). The machine has no GPU, so the CUDA rows are checked
by faking what torch reports about the hardware; the resolution logic itself runs for real."""
import platform
import sys

import pytest
import torch
import torch.distributed as dist

import nbdist
from nbdist.backends import resolve as backends


@pytest.fixture
def fake_cuda(monkeypatch):
    def set_(cuda=True, nccl=True, platform="linux"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if cuda else 0)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
        monkeypatch.setattr(sys, "platform", platform)
    return set_


def test_auto_on_cpu_is_gloo_without_a_note(cpu_only_torch):
    choice = nbdist.resolve_backend("auto", device="cpu")
    assert (choice.backend, choice.device, choice.note) == ("gloo", "cpu", None)


def test_auto_device_follows_cuda_availability(fake_cuda):
    assert nbdist.resolve_backend().device == "cpu"
    fake_cuda(cuda=True, nccl=True)
    assert nbdist.resolve_backend("auto", "auto") == backends.BackendChoice("nccl", "cuda")


def test_auto_on_cuda_without_nccl_says_why_it_picks_gloo(fake_cuda):
    fake_cuda(cuda=True, nccl=False)
    choice = nbdist.resolve_backend("auto", "cuda")
    assert choice.backend == "gloo"
    assert "using gloo for CUDA tensors because NCCL is not built into this torch" in choice.note


def test_auto_on_windows_cuda_is_gloo_with_a_note(fake_cuda):
    fake_cuda(cuda=True, nccl=True, platform="win32")
    choice = nbdist.resolve_backend("auto", "cuda")
    assert choice.backend == "gloo" and "NCCL does not exist on Windows" in choice.note


def test_nccl_with_cpu_device_is_refused_with_the_fix(fake_cuda):
    fake_cuda(cuda=True, nccl=True)
    with pytest.raises(nbdist.BackendError, match="NCCL only moves CUDA tensors.*use backend='gloo'"):
        nbdist.resolve_backend("nccl", "cpu")


def test_nccl_on_windows_is_refused(fake_cuda):
    fake_cuda(cuda=True, nccl=True, platform="win32")
    with pytest.raises(nbdist.BackendError, match="NCCL does not exist on Windows"):
        nbdist.resolve_backend("nccl", "cuda")


def test_mapping_with_nccl_passes_through_when_usable(fake_cuda):
    fake_cuda(cuda=True, nccl=True)
    assert nbdist.resolve_backend("cpu:gloo,cuda:nccl", "cuda").backend == "cpu:gloo,cuda:nccl"


def test_unknown_backend_lists_the_available_ones(cpu_only_torch):
    with pytest.raises(nbdist.BackendError, match=r"unknown backend 'nope'.*Available here for 'cpu': gloo"):
        nbdist.resolve_backend("nope", "cpu")


def test_ucc_and_xccl_refused_here(cpu_only_torch):
    with pytest.raises(nbdist.BackendError, match="UCC is not built"):
        nbdist.resolve_backend("ucc", "cpu")
    with pytest.raises(nbdist.BackendError, match="XCCL needs an XPU build"):
        nbdist.resolve_backend("xccl", "cpu")


def test_env_var_auto_means_auto(monkeypatch, cpu_only_torch):
    monkeypatch.setenv("NBDIST_BACKEND", "auto")
    assert nbdist.resolve_backend().backend == "gloo"


#: nbdist_shm runs on Linux x86-64 only (futexes, x86 memory ordering)
SHM_HERE = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


def test_available_backends_and_report(cpu_only_torch):
    assert nbdist.available_backends() == (["gloo", "nbdist_shm"] if SHM_HERE else ["gloo"])
    report = {name: (ok, why) for name, ok, why in backends.backend_report("cpu")}
    assert report["gloo"] == (True, "available") and report["nccl"][0] is False
    if not SHM_HERE:  # Windows, macOS, ARM: refused, with the reason
        assert report["nbdist_shm"] == (False, "nbdist_shm needs Linux on x86-64 (shared "
                                               "memory, futexes, x86 memory ordering)")


def test_world_size_on_cuda_is_limited_to_the_gpus(fake_cuda):
    fake_cuda(cuda=True, nccl=True)
    with pytest.raises(ValueError, match="one rank per GPU"):
        nbdist.start(3, device="cuda")


def test_public_surface_is_sorted_and_documented():
    assert nbdist.__all__ == sorted(nbdist.__all__)
    for name in nbdist.__all__:
        obj = getattr(nbdist, name)
        assert obj.__doc__, f"{name} has no docstring"


def test_core_imports_no_ui_libraries():
    import subprocess

    code = ("import sys, nbdist, nbdist.group, nbdist.worker, nbdist.backends\n"
            "bad = [m for m in ('IPython', 'ipywidgets', 'matplotlib') if m in sys.modules]\n"
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_import_nbdist_never_imports_the_optional_extras():
    """DeepSpeed picks its accelerator when imported and takes ~0.5 s: only wrap() loads it."""
    import subprocess

    code = ("import sys, nbdist, nbdist.strategies, nbdist.memory, nbdist.bench\n"
            "from nbdist.strategies import deepspeed, fairscale\n"
            "bad = [m for m in ('deepspeed', 'fairscale', 'lightning', 'pytorch_lightning') "
            "if m in sys.modules]\n"
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_nbdist_shm_is_registered_by_default_and_refused_off_linux_x86(monkeypatch):
    if SHM_HERE:
        assert nbdist.resolve_backend("nbdist_shm", "cpu").backend == "nbdist_shm"
        monkeypatch.setattr(backends.platform, "machine", lambda: "arm64")
    with pytest.raises(nbdist.BackendError, match="nbdist_shm needs Linux on x86-64"):
        nbdist.resolve_backend("nbdist_shm", "cpu")
