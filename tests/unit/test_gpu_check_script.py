"""``scripts/gpu-check.sh`` where torch sees no CUDA: it says so and fails, never passes having
checked nothing (every test in tests/gpu skips without CUDA)."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_without_cuda_the_check_fails_saying_why():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run")
    if os.name == "nt" or shutil.which("bash") is None:
        pytest.skip("scripts/gpu-check.sh is a bash script for a lent Linux GPU machine")
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu-check.sh")],
                          env=dict(os.environ, PYTHON=sys.executable), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert (f"gpu-check: this torch ({torch.__version__}) sees no CUDA device: nothing to check "
            "(set PYTHON= to an interpreter whose torch has CUDA)") in done.stderr
    assert "available False" in done.stdout
