"""``%dist_mem`` (and ``%dist_bench`` where the collective benchmark is available): the sharded
memory view and the collective sweep, run on the current group, shown inline as a table and a plot.
"""
from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from .base import (NbdistMagics, _at_least_zero, _positive, _show_figure, _sizes,
                   _strategy_list, _world_sizes, register_magics, usage)


_MODEL_HELP = ("--model takes mlp:LAYERSxWIDTH (e.g. mlp:4x2236), a parameter count (e.g. 7.5B), "
               "or the name of a notebook function that builds the model, called with no "
               "arguments on every rank (e.g. def make_model(): return torch.nn.Linear(8, 8), "
               "then --model make_model)")


@register_magics
@magics_class
class MemoryMagics(NbdistMagics):
    """``%dist_mem``: per-rank memory of the strategies (data-parallel and mesh) against the
    formulas."""

    @line_magic
    @magic_arguments()
    @argument("--model", default="mlp:4x2236", metavar="SPEC",
              help="mlp:LAYERSxWIDTH, a parameter count such as 7.5B (estimate only), or the "
                   "name of a function in this notebook that builds the model")
    @argument("--strategies", type=_strategy_list, default="ddp,zero1,fsdp", metavar="S[,S...]",
              help="strategy names, e.g. ddp,zero1,fsdp_grad_op,fsdp,fsdp2 or the mesh ones "
                   "tp,fsdp2+tp,hsdp,pp (at their default sizes: no options here)")
    @argument("--optimizer", default="adam", help="adam, adamw, momentum or sgd")
    @argument("--precision", default="fp32", help="fp32 or bf16-mixed")
    @argument("--steps", type=_positive(int), default=2, help="training steps per strategy (2)")
    @argument("--batch", type=_positive(int), default=16, help="samples per rank (16)")
    @argument("--world-sizes", type=_world_sizes, default="2,8,64,512,4096", metavar="N[,N...]",
              help="world sizes for the estimate plot of a parameter count")
    @argument("--profile", action="store_true", help="measure the step's peak (CPU profiler)")
    @argument("--no-plot", action="store_true", help="table only")
    @argument("--tp", type=_positive(int), help="estimate: tensor-parallel size")
    @argument("--pp", type=_positive(int), help="estimate: pipeline stages")
    @argument("--transformer", metavar="L=..,h=..,a=..,s=..[,b=..]",
              help="estimate: transformer shape for the activations (Korthikanti et al. 2022)")
    @argument("--sequence-parallel", action="store_true", help="estimate: with SP")
    @argument("--microbatches", type=_positive(int), help="estimate: microbatches per step")
    def dist_mem(self, line: str = ""):
        """Train a few steps under each strategy on the current group and show each rank's
        params / grads / optimizer state against the ZeRO estimate (table and stacked bars).

        With a parameter count as --model (e.g. --model 7.5B) nothing runs: the analytic estimate
        is shown for the world sizes of --world-sizes, so you can plan a cluster from a laptop.
        """
        from ... import memory

        args = self.parse(self.dist_mem, line)
        names = args.strategies
        model = self._model_from_notebook(args.model)
        try:
            spec = model if model is not None else memory.model_spec(args.model)
            extra = memory.activations.estimate_options(
                args.tp, args.pp, args.transformer, args.sequence_parallel,
                microbatches=args.microbatches)
            if isinstance(spec, int):
                sizes = args.world_sizes
                for n in sizes:
                    display(memory.estimate_table(spec, n, names, args.precision, args.optimizer,
                                                  **extra))
                if not args.no_plot:
                    _show_figure(memory.estimate_curve(
                        spec, names, sizes, precision=args.precision, optimizer=args.optimizer,
                        **{k: v for k, v in extra.items() if k in ("tp", "pp")}).plot())
                return None
            if extra:
                raise ValueError("--tp, --pp, --transformer, --sequence-parallel and "
                                 "--microbatches apply to the estimate of a parameter count "
                                 "(e.g. --model 7.5B)")
            report = memory.measure(self.group, spec, names, args.optimizer, args.steps,
                                    args.batch, precision=args.precision, profile=args.profile)
        except (ValueError, TypeError) as err:
            raise UsageError(f"{err}\n{usage(self.dist_mem)}") from None
        display(report)
        if not args.no_plot:
            _show_figure(report.plot())
        return None

    def _model_from_notebook(self, name: str):
        """The notebook's function called ``name`` (``--model make_model``); ``None`` if the
        notebook has no such name (then ``name`` is a model spec). ``UsageError`` if it has one
        that cannot build the model on the ranks."""
        from ...memory.report import model_fn_problem

        if name not in self.shell.user_ns:
            return None
        model = self.shell.user_ns[name]
        problem = model_fn_problem(model)
        if problem is not None:
            raise UsageError(f"--model {name}: the notebook's {name} {problem}. {_MODEL_HELP}"
                             f"\n{usage(self.dist_mem)}")
        return model


@register_magics
@magics_class
class BenchMagics(NbdistMagics):
    """``%dist_bench``: a collective benchmark sweep on the current group."""

    @line_magic
    @magic_arguments()
    @argument("--ops", default="all_reduce,all_gather,broadcast,barrier", metavar="OP[,OP...]",
              help="all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all, "
                   "barrier, send_recv")
    @argument("--sizes", type=_sizes, default="4K-16M", metavar="RANGE",
              help="e.g. 4K-64M or 1K,1M")
    @argument("--iters", type=_positive(int), default=50,
              help="measured iterations per point (50)")
    @argument("--warmup", type=_at_least_zero, default=10,
              help="unmeasured iterations first (10)")
    @argument("--dtype", default="float32")
    @argument("--no-limit", action="store_true", help="don't measure and draw the memcpy line")
    @argument("--no-plot", action="store_true", help="table only")
    def dist_bench(self, line: str = ""):
        """Measure latency, algbw and busbw (nccl-tests' definitions) of collectives on the
        current group; show the table and, inline, latency and bus bandwidth against size held
        against this machine's single-core memcpy bandwidth (the fastest of three copies)."""
        from ... import bench

        args = self.parse(self.dist_bench, line)
        group = self.group
        try:
            records = bench.collectives(group, ops=args.ops, sizes=args.sizes, dtype=args.dtype,
                                        iters=args.iters, warmup=args.warmup)
        except (ValueError, TypeError) as err:
            raise UsageError(f"{err}\n{usage(self.dist_bench)}") from None
        from IPython.display import HTML

        display(HTML(records._repr_html_()))
        if not args.no_plot:
            limit = None if args.no_limit else bench.memcpy_bandwidth(group)
            _show_figure(records.plot(limit=limit))
        return None
