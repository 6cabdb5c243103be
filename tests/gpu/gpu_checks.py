"""What the GPU tests share (tests/gpu, on sys.path while they run)."""


def report(what: str, **figures) -> None:
    """One line for scripts/gpu-check.sh's summary (shown with pytest -s)."""
    parts = " ".join(f"{k}={v}" for k, v in figures.items())
    print(f"\nGPU-CHECK {what}: {parts}", flush=True)
