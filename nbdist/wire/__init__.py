"""The wire: how bytes move between the notebook and its ranks.

Owns the authenticated control channel and its framing (:mod:`.transport`), pickling by value with
CPU tensors through shared memory (:mod:`.serialize`), the segment files themselves
(:mod:`.segments`) and the pool of reusable result segments (:mod:`.pool`), and the relay of every
rank's stdout/stderr, which also carries the one-byte interrupt/kill commands (:mod:`.relay`), and
the rules that fold the same line from several ranks, or repeated, into one (:mod:`.repeats`);
the per-message signatures of protected (network) groups (:mod:`.seal`).

May import: :mod:`nbdist.errors`, the standard library, cloudpickle, torch (lazily). Knows nothing of
groups, backends or training.
"""
