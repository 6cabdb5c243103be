"""The runtime: the ranks a notebook owns, and how a call reaches them and comes back.

Owns :class:`~nbdist.runtime.group.Group` (the public object), starting local workers
(:mod:`.launcher`) or accepting ranks started by torchrun/srun (:mod:`.attach`), the worker process
itself (:mod:`.worker`), the request/reply engine that turns every fault into one error
(:mod:`.calls`) and the per-rank status (:mod:`.status`).

May import: :mod:`nbdist.backends`, :mod:`nbdist.wire`, :mod:`nbdist.errors`, :mod:`nbdist.report`,
torch. Never strategies, memory, bench, Lightning or the notebook layer: code from those reaches
the ranks by value (cloudpickle) or as ``"module:function"`` rank hooks.
"""
