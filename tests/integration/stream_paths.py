"""The ways a rank's stdout and stderr reach the caller (nbdist.runtime.streams), as start()
keyword arguments: the fds are the sockets themselves (POSIX's default), pipes with a thread
that forwards (Windows' only way, ``NBDIST_STREAMS=pipe`` elsewhere), and pipes whose chunks go
in sealed frames (a protected group). Output tests run under each, so every path stays tested
on every machine."""
import pytest

STREAM_PATHS = {"socket": {}, "pipe": {"env": {"NBDIST_STREAMS": "pipe"}},
                "protect": {"protect": True}}

#: ``@each_stream_path`` gives a test a ``streams`` argument: start()'s keyword arguments
each_stream_path = pytest.mark.parametrize("streams", list(STREAM_PATHS.values()),
                                           ids=list(STREAM_PATHS))
