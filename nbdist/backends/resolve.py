"""Which torch.distributed backends exist here, which one ``"auto"`` picks, and custom backends.

Everything is decided in the caller, before a worker is started, so a bad choice fails fast with a
message that says why and what to use instead. The resolution order for ``backend="auto"`` is:

1. the ``NBDIST_BACKEND`` environment variable, when it is set (the one switch nbdist reads);
2. ``nccl`` when the device is CUDA, NCCL is built into torch and the platform is not Windows;
3. ``gloo`` otherwise -- with a one-line note when CUDA was asked for but NCCL is missing.

An explicit ``backend=`` argument always wins over the environment variable.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from ..errors import BackendError

ENV_VAR = "NBDIST_BACKEND"
_BUILTIN = ("gloo", "nccl", "mpi", "ucc", "xccl")
_DEVICES = ("cpu", "cuda", "xpu")


@dataclass(frozen=True)
class CustomBackend:
    """A backend registered with :func:`register_backend`, registered again inside every worker."""

    name: str
    creator: Union[str, Callable]
    devices: Tuple[str, ...]
    extended_api: bool = False

    def load_creator(self) -> Callable:
        """Return the creator callable (importing ``"pkg.module:function"`` strings)."""
        if callable(self.creator):
            return self.creator
        module_name, _, attr = self.creator.partition(":")
        module = importlib.import_module(module_name)
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj

    def register_in_torch(self) -> None:
        """Register with ``torch.distributed.Backend`` in this process (idempotent)."""
        import torch.distributed as dist

        if self.name.lower() in dist.Backend.backend_list:
            return
        dist.Backend.register_backend(self.name, self.load_creator(),
                                      extended_api=self.extended_api, devices=list(self.devices))


@dataclass(frozen=True)
class BackendChoice:
    """The outcome of :func:`resolve_backend`: what the workers will use, and why."""

    backend: str
    device: str
    note: Optional[str] = None
    custom: Tuple[CustomBackend, ...] = field(default_factory=tuple)


_registry: Dict[str, CustomBackend] = {}
# nbdist's own backend for ranks on one host (nbdist/shm), selectable by name like any custom one.
_registry["nbdist_shm"] = CustomBackend("nbdist_shm", "nbdist.backends.shm:create", ("cpu",))


def register_backend(name: str, creator: Union[str, Callable], devices: Optional[Sequence[str]] = None,
                     extended_api: bool = False, replace: bool = False) -> CustomBackend:
    """Register a custom process-group backend for every group nbdist starts from now on.

    Args:
        name: the backend name used in ``nbdist.start(backend=name)``.
        creator: ``"package.module:function"`` (imported inside each worker) or a callable (shipped
            by value). torch calls it as ``creator(store, rank, world_size, timeout)``; it returns a
            ``torch.distributed.ProcessGroup`` (or a C++ ``Backend``).
        devices: device types the backend handles, e.g. ``["cpu"]``. Default ``["cpu"]``.
        extended_api: passed through to ``torch.distributed.Backend.register_backend``.
        replace: allow replacing an earlier registration of the same name.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"backend name must be an identifier-like string, got {name!r}")
    key = name.lower()
    if key in _BUILTIN or key in ("auto", "undefined", "fake"):
        raise BackendError(f"{name!r} is a built-in torch backend name; choose another name "
                           "for a custom backend.")
    if isinstance(creator, str):
        if ":" not in creator:
            raise ValueError(f"creator must look like 'package.module:function', got {creator!r}")
    elif not callable(creator):
        raise TypeError(f"creator must be a callable or a 'package.module:function' string, "
                        f"got {type(creator).__name__}")
    devs = tuple(devices) if devices is not None else ("cpu",)
    for d in devs:
        if d not in _DEVICES:
            raise ValueError(f"unknown device {d!r} for backend {name!r}; expected one of {_DEVICES}")
    entry = CustomBackend(key, creator, devs, extended_api)
    old = _registry.get(key)
    if old is not None and old != entry and not replace and not _same_backend(old, entry):
        raise BackendError(f"backend {name!r} is already registered (creator {old.creator!r}); "
                           "pass replace=True to replace it.")
    if isinstance(creator, str):
        try:
            entry.load_creator()
        except (ImportError, AttributeError) as err:
            raise BackendError(f"cannot load the creator {creator!r} of backend {name!r}: {err}. "
                               "The module must be importable in the workers (and here).") from err
    _registry[key] = entry
    return entry


def _same_backend(old: CustomBackend, new: CustomBackend) -> bool:
    """The same creator under another import path (``nbdist.shm:create`` is
    ``nbdist.backends.shm:create``), same devices: registering it again changes nothing."""
    if (old.devices, old.extended_api) != (new.devices, new.extended_api):
        return False
    try:
        return old.load_creator() is new.load_creator()
    except (ImportError, AttributeError):
        return False


def unregister_backend(name: str) -> None:
    """Forget a custom backend registered with :func:`register_backend` (no error if absent)."""
    _registry.pop(name.lower(), None)


def registered_backends() -> Dict[str, CustomBackend]:
    """The custom backends registered so far, by name."""
    return dict(_registry)


def backend_report(device: str = "cpu") -> List[Tuple[str, bool, str]]:
    """``(name, usable, reason)`` for every backend nbdist knows, for ``device``.

    Used by ``python -m nbdist doctor`` and the launcher widget, which shows unusable backends
    disabled with their reason.
    """
    rows = []
    for name in _BUILTIN + tuple(sorted(_registry)):
        reason = _unavailable_reason(name, device)
        rows.append((name, reason is None, reason or "available"))
    return rows


def available_backends(device: Optional[str] = None) -> List[str]:
    """Names of the backends usable here (for ``device``, or for any device when ``None``)."""
    devices = [device] if device else [d for d in _DEVICES if _device_reason(d) is None]
    names = set()
    for d in devices:
        names.update(name for name, ok, _ in backend_report(d) if ok)
    return sorted(names)


def _device_reason(device: str) -> Optional[str]:
    import torch

    if device == "cpu":
        return None
    if device == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device is visible to torch"
    if device == "xpu":
        ok = hasattr(torch, "xpu") and torch.xpu.is_available()
        return None if ok else "no XPU device is visible to torch"
    return f"unknown device {device!r}"


def _unavailable_reason(name: str, device: str) -> Optional[str]:
    """Why ``name`` can't be used on ``device`` here, or ``None`` when it can."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return "this torch build has no torch.distributed"
    if name == "nbdist_shm" and name in _registry and not (
            sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")):
        return "nbdist_shm needs Linux on x86-64 (shared memory, futexes, x86 memory ordering)"
    if name in _registry:
        entry = _registry[name]
        if device not in entry.devices:
            return f"registered for devices {list(entry.devices)}, not {device!r}"
        return None
    if name == "gloo":
        return None if dist.is_gloo_available() else "gloo is not built into this torch"
    if name == "nccl":
        if sys.platform == "win32":
            return "NCCL does not exist on Windows"
        if not dist.is_nccl_available():
            return "NCCL is not built into this torch (a CPU-only build?)"
        if device != "cuda":
            return "NCCL only moves CUDA tensors; it needs device='cuda'"
        if not torch.cuda.is_available():
            return "no CUDA device is visible to torch"
        return None
    if name == "mpi":
        return None if dist.is_mpi_available() else (
            "MPI is not built into this torch (only source builds on a host with MPI have it)")
    if name == "ucc":
        return None if dist.is_ucc_available() else "UCC is not built into this torch"
    if name == "xccl":
        ok = getattr(dist, "is_xccl_available", lambda: False)()
        return None if ok and device == "xpu" else "XCCL needs an XPU build of torch and device='xpu'"
    return f"unknown backend {name!r}"


def torch_build() -> Dict[str, Optional[str]]:
    """What torch was built for (``cuda``, ``hip``, ``xpu``: a version, or ``None``), read from
    its ``version.py`` without importing torch (about a second in a kernel that may never need
    it); empty when torch or the file cannot be found."""
    global _BUILD
    if _BUILD is None:
        _BUILD = {}
        spec = importlib.util.find_spec("torch")
        for folder in (spec.submodule_search_locations or []) if spec else []:
            try:
                with open(os.path.join(folder, "version.py"), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (OSError, SyntaxError, ValueError):
                continue
            for node in tree.body:
                target = getattr(node, "target", None) or (node.targets[0] if isinstance(
                    node, ast.Assign) and len(node.targets) == 1 else None)
                if isinstance(target, ast.Name) and target.id in ("cuda", "hip", "xpu") and \
                        isinstance(node.value, ast.Constant):
                    _BUILD[target.id] = node.value.value
            break
    return _BUILD


_BUILD: Optional[Dict[str, Optional[str]]] = None


def _surely_no_gpu() -> bool:
    """True when torch certainly sees no GPU here, known without importing it: a CPU-only build
    (no CUDA, ROCm or XPU in its version.py), or a CUDA build on Linux with no NVIDIA driver
    loaded (no ``/dev/nvidiactl``: ``torch.cuda.is_available()`` is then False). Anything else
    (torch already imported, a GPU build where a driver may be) asks torch itself."""
    if "torch" in sys.modules:
        return False
    build = torch_build()
    if not build or build.get("hip") or build.get("xpu"):
        return False
    if build.get("cuda") is None:
        return True
    return sys.platform.startswith("linux") and not os.path.exists("/dev/nvidiactl")


def resolve_device(device: Optional[str] = "auto") -> str:
    """``"auto"`` -> ``"cuda"`` when a CUDA device is visible, else ``"cpu"``; others are checked.

    Where torch certainly sees no GPU (a CPU-only build, or no NVIDIA driver), ``"auto"`` and
    ``"cpu"`` are answered without importing torch in this process: the ranks import it."""
    if device in (None, "auto", "cpu") and _surely_no_gpu():
        return "cpu"
    import torch

    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, str) or device not in _DEVICES:
        raise ValueError(f"device must be 'auto' or one of {list(_DEVICES)}, got {device!r}")
    reason = _device_reason(device)
    if reason:
        raise ValueError(f"device={device!r} is not usable here: {reason}. Use device='cpu'.")
    return device


def resolve_backend(backend: Optional[str] = "auto", device: Optional[str] = "auto") -> BackendChoice:
    """Decide the backend and device a group will use, or raise :class:`BackendError` saying why not.

    See the module docstring for the order ``"auto"`` follows. Mapping strings such as
    ``"cpu:gloo,cuda:nccl"`` are checked part by part and passed through to torch.
    """
    dev = resolve_device(device)
    asked = backend
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a string such as 'gloo' or 'auto', got {type(backend).__name__}")
    if backend in (None, "", "auto"):
        env = os.environ.get(ENV_VAR, "").strip()
        if env and env != "auto":
            backend = env
        else:
            return _auto(dev)
    name = backend.strip().lower()
    if ":" in name:
        return _resolve_mapping(name, dev, asked)
    reason = _unavailable_reason(name, dev)
    if reason is not None:
        raise BackendError(_explain(name, dev, reason, asked))
    custom = (_registry[name],) if name in _registry else ()
    return BackendChoice(name, dev, None, custom)


def _auto(dev: str) -> BackendChoice:
    if dev == "cuda":
        reason = _unavailable_reason("nccl", dev)
        if reason is None:
            return BackendChoice("nccl", dev)
        return BackendChoice("gloo", dev, f"nbdist: using gloo for CUDA tensors because {reason}; "
                                          "collectives will be slower than with NCCL.")
    if dev == "xpu" and _unavailable_reason("xccl", dev) is None:
        return BackendChoice("xccl", dev)
    return BackendChoice("gloo", dev)


def _resolve_mapping(spec: str, dev: str, asked) -> BackendChoice:
    custom = []
    for part in spec.split(","):
        d, sep, name = part.strip().partition(":")
        if not sep or not d or not name:
            raise BackendError(f"cannot parse backend string {spec!r}: expected 'device:backend' "
                               "parts separated by commas, e.g. 'cpu:gloo,cuda:nccl'.")
        if d not in _DEVICES:
            raise BackendError(f"unknown device {d!r} in backend string {spec!r}; "
                               f"expected one of {list(_DEVICES)}.")
        reason = _device_reason(d) or _unavailable_reason(name, d)
        if reason is not None:
            raise BackendError(_explain(name, d, reason, spec) +
                               f" The part '{d}:{name}' of {spec!r} cannot be used here.")
        if name in _registry:
            custom.append(_registry[name])
    return BackendChoice(spec, dev, None, tuple(custom))


def _explain(name: str, dev: str, reason: str, asked) -> str:
    avail = available_backends(dev)
    fix = "gloo" if "gloo" in avail else (avail[0] if avail else "none")
    source = f" (from ${ENV_VAR})" if asked in (None, "", "auto") else ""
    return (f"backend {name!r}{source} cannot be used with device={dev!r}: {reason}. "
            f"Available here for {dev!r}: {', '.join(avail) or 'none'}; use backend={fix!r}.")
