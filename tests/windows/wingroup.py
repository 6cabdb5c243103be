"""The group the Windows test modules share a start of: two ranks by spawn, output through pipes
(Windows' only ways; Linux takes them when told), generous start-up time (a start under Wine is
20-35 s). This directory is on sys.path while its tests run."""
import contextlib
import os

import nbdist


@contextlib.contextmanager
def windows_group(timeout: float = 60):
    """A started group with ``NBDIST_STREAMS=pipe`` set while it lives (restored after)."""
    old = os.environ.get("NBDIST_STREAMS")
    os.environ["NBDIST_STREAMS"] = "pipe"  # the Windows default; Linux takes it when told
    try:
        with nbdist.start(2, backend="gloo", device="cpu", timeout=timeout, start_method="spawn",
                          init_timeout=180) as group:
            yield group
    finally:
        if old is None:
            os.environ.pop("NBDIST_STREAMS", None)
        else:
            os.environ["NBDIST_STREAMS"] = old
