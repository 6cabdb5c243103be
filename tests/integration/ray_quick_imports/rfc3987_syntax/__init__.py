"""A lazy stand-in for ``rfc3987_syntax``, first on the test Ray cluster's ``PYTHONPATH``.

``import jsonschema`` (which every Ray process does) imports ``rfc3987_syntax`` when it is
installed (the ``format-nongpl`` extra that Jupyter asks for), and that builds an Earley parser at
import: 3-5 s of CPU per process on a loaded two-core machine -- longer than the 15 s a raylet waits
for its dashboard agent, which then aborts the node. This package has the real one's files on its
``__path__`` and builds the parser at the first IRI checked, not at import.
"""
import os
import sys

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _entry in sys.path:
    _real = os.path.join(os.path.abspath(_entry or "."), "rfc3987_syntax")
    if os.path.abspath(_entry or ".") != _HERE and os.path.isfile(
            os.path.join(_real, "syntax_helpers.py")):
        __path__.append(_real)  # noqa: F821 -- a package's own __path__
        break


def is_valid_syntax(term, value):
    """The real ``rfc3987_syntax.is_valid_syntax`` (its parser built on the first call)."""
    from .syntax_helpers import is_valid_syntax as real

    return real(term, value)
