"""The public surface, pinned: a change to any of these lists is a visible API decision.

Update the list here *and* the CHANGELOG when you add, rename or remove a public name.
"""
import importlib
import inspect

import pytest

import nbdist

API = {
    "nbdist": [
        "BackendError", "DistTimeoutError", "Group", "GroupBusyError", "GroupClosedError",
        "GroupInterrupted", "Job", "JobPausedError", "Metrics", "NbdistError", "RankDiedError",
        "RemoteError", "Stacks",
        "attach", "available_backends", "current_group", "launch", "load_ipython_extension",
        "log", "reattach", "register_backend",
        "resolve_backend", "start", "step", "stop_all", "unload_ipython_extension", "use_group",
    ],
    "nbdist.backends": [
        "ENV_VAR", "BackendChoice", "CustomBackend", "available_backends", "backend_report",
        "register_backend", "registered_backends", "resolve_backend", "resolve_device",
        "unregister_backend",
    ],
    "nbdist.bench": [
        "DEFAULT_SIZES", "FIELDS", "NOISY_SPREAD", "OPS", "Records", "Summary", "Table", "Trace",
        "Traffic", "bandwidths", "bus_factor", "cli", "collectives", "compare", "expected_traffic",
        "format_bytes", "format_rate", "format_time", "memcpy_bandwidth", "parse_ops",
        "parse_size", "parse_sizes", "step", "summarize", "trace", "traffic",
    ],
    "nbdist.memory": [
        "OPTIMIZERS", "Estimate", "EstimateCurve", "MemoryRecord", "MemoryReport", "Transformer",
        "cli", "count_params", "estimate", "estimate_curve", "estimate_table", "human_bytes",
        "measure", "mesh_estimate", "mlp", "model_spec", "parse_count", "unit_for",
    ],
    "nbdist.strategies": [
        "DEEPSPEED_HINT", "DeepSpeedOptimizer", "FAIRSCALE_HINT", "PRECISIONS", "Strategy",
        "available_strategies", "default_device",
        "full_parameters", "get_strategy", "mesh_sizes", "register_strategy", "wrap",
    ],
    "nbdist.parallel": [
        "DIMS", "MeshLayout", "Pipeline", "SCHEDULES", "Timeline", "TransformerBlock", "auto_plan",
        "check_plan", "describe", "device_mesh", "factorizations", "mesh_ranks", "pipeline",
        "tensor_parallel",
    ],
    "nbdist.engines": ["ENTRY_POINT_GROUP", "Engine", "available_engines"],
    "nbdist.engines.slurm": ["SlurmEngine", "start"],
    "nbdist.engines.ray": ["PLACEMENTS", "RayEngine", "start"],
    "nbdist.engines.k8s": ["K8sEngine", "Manifests", "manifests", "start"],
    "nbdist.lightning": ["FitResult", "NbdistDeepSpeedStrategy", "NbdistEnvironment", "fit",
                         "install_hooks", "load_zero_checkpoint", "prepare", "warm"],
    "nbdist.ui": ["BenchPanel", "Launcher", "MemoryPanel", "MeshPanel", "Watch", "bench_panel",
                  "launcher", "memory_panel", "mesh_panel", "watch"],
}
CONSTANTS = {"ENTRY_POINT_GROUP", "DIMS", "ENV_VAR", "DEFAULT_SIZES", "FIELDS", "NOISY_SPREAD", "OPS", "OPTIMIZERS",
             "FAIRSCALE_HINT", "DEEPSPEED_HINT", "PRECISIONS", "SCHEDULES",
             "PLACEMENTS"}


@pytest.mark.parametrize("module", sorted(API))
def test_public_names_are_pinned(module):
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(API[module])
    for name in mod.__all__:
        assert getattr(mod, name, None) is not None or name == "NbdistEnvironment", name


@pytest.mark.parametrize("module", sorted(API))
def test_every_public_name_has_a_docstring(module):
    mod = importlib.import_module(module)
    missing = []
    for name in mod.__all__:
        if name in CONSTANTS or name == "NbdistEnvironment":  # built on first use (Lightning)
            continue
        obj = getattr(mod, name)
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(name)
    assert missing == []


def test_dir_shows_the_api_and_the_documented_subpackages_only():
    shown = set(dir(nbdist))
    assert set(nbdist.__all__) <= shown
    assert {"backends", "bench", "errors", "lightning", "memory", "parallel", "strategies",
            "ui"} <= shown
    internal = {"runtime", "wire", "report", "group", "launcher", "worker", "transport",
                "serialize", "dispatch", "output", "shmpool", "accounting", "status"}
    assert not shown & internal


def test_all_is_sorted_and_matches_the_pinned_list():
    assert nbdist.__all__ == sorted(nbdist.__all__)
    assert nbdist.__version__.count(".") == 2
