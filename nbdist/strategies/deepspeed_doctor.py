"""What ``python -m nbdist doctor`` says about DeepSpeed (moved out of
:mod:`nbdist.strategies.deepspeed`, which it asks nothing of but :func:`require`): it never
imports DeepSpeed in this process; a subprocess asks DeepSpeed what it would pick."""
from __future__ import annotations

import os
import sys
from typing import List

from .deepspeed import DEEPSPEED_HINT, require

_PROBE = """import json
from deepspeed.accelerator import get_accelerator
a = get_accelerator()
print("nbdist-probe " + json.dumps(dict(accelerator=a.device_name(), comm=a.communication_backend_name(),
      bf16=bool(a.is_bf16_supported()), fp16=bool(a.is_fp16_supported()))))
"""


def doctor_lines(timeout: float = 120.0) -> List[str]:
    """What ``python -m nbdist doctor`` says about DeepSpeed here: installed or not (version),
    the accelerator and communication backend it picks in a plain process (asked in a
    subprocess, so this process never imports it), and the C++ compiler its ops would need."""
    import importlib.metadata
    import json
    import shutil
    import subprocess

    try:
        require()
        version = importlib.metadata.version("deepspeed")
    except (ImportError, importlib.metadata.PackageNotFoundError):
        return [f"DeepSpeed: not installed (optional: {DEEPSPEED_HINT})"]
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              errors="replace", timeout=timeout)  # any locale, any output
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith("nbdist-probe ")]
        info = json.loads(found[-1].split(" ", 1)[1]) if found else None
    except subprocess.TimeoutExpired:
        info, proc = None, None
    if info is None:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1] if proc else "timed out"
        lines = [f"DeepSpeed {version}: installed, but importing it failed here ({tail})"]
    else:
        lines = [f"DeepSpeed {version}: picks accelerator {info['accelerator']!r} and "
                 f"communication backend {info['comm']!r} in a plain process (half precision: "
                 f"{_precisions(info)}); in a group, deepspeed_zero* run over the group's own "
                 "process group, and on CPU nbdist sets its accelerator to 'cpu'"]
    cxx = os.environ.get("CXX") or ("cl" if sys.platform == "win32" else "c++")
    compiler = shutil.which(cxx)
    lines.append(f"  C++ compiler for DeepSpeed's own ops: {compiler}" if compiler else
                 f"  C++ compiler for DeepSpeed's own ops: none ({cxx!r} not found): DeepSpeed "
                 "cannot JIT-build them")
    lines.append("  (the deepspeed_zero* strategies need none: nbdist skips the one DeepSpeed "
                 "would build, its Linux shared-memory op, deepspeed_shm_comm)")
    return lines


def _precisions(info) -> str:
    """The half precisions DeepSpeed's accelerator reports; on the CPU, where it reports fp16 (a
    CPU with avx512_fp16 / AMX-FP16), that nbdist refuses fp16 there all the same."""
    found = ", ".join(k for k in ("bf16", "fp16") if info[k]) or "none"
    if info["accelerator"] == "cpu" and info["fp16"]:
        found += " -- fp16 is refused on a CPU group whatever the CPU: use bf16"
    return found
