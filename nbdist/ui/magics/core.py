"""The core magics: ``%dist_start``/``restart``/``stop``/``status``, ``%%dist``, ``%autodist``,
``%dist_push``/``%dist_pull``."""
from __future__ import annotations

import contextlib
import html
import sys
from typing import Iterator, List, Optional, Sequence

from IPython.core.error import UsageError
from IPython.core.magic import line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import publish_display_data

from ...errors import NbdistError
from ...runtime.api import start
from ...runtime.group import Group, current_group, use_group
from ...runtime.advice import option_names
from .base import (JOBS, START_OPTIONS, NbdistMagics, _positive, _rank, _rank_list, _seconds,
                   _show_figure, _start_seconds, _started, check_ranks, job_name, register_magics,
                   split_statement, usage)
from .engine_flags import engine_arguments, engine_options
from .syntax import check_cell, check_statement

_STOP_TRACE = "_nbdist_trace_cm.__exit__(None, None, None)"  # ends what run_traced started


@contextlib.contextmanager
def _all_output(group: Optional[Group]) -> Iterator[None]:
    """``%%dist --all-output``: the calls made inside show every line of ``group``'s ranks (a
    background job keeps the setting it started with); ``None``: change nothing."""
    if group is None:
        yield
        return
    before, group.dedupe_output = group.dedupe_output, False
    try:
        yield
    finally:
        group.dedupe_output = before


@register_magics
@magics_class
class DistMagics(NbdistMagics):
    """``%dist_start``, ``%%dist``, ``%autodist``, push/pull, status, restart and stop."""

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self._autodist: Optional[str] = None  # the %%dist options while %autodist is on
        self._autodist_body: Optional[str] = None  # the code of the last cell autodist wrapped

    # ---- lifecycle ----------------------------------------------------------------------------
    @line_magic
    @magic_arguments()
    @argument("-n", "--world-size", type=_positive(int), default=2, metavar="N",
              help="number of ranks (2)")
    @argument("--backend", default="auto", metavar="B", help="gloo, nccl, ... (default: auto)")
    @argument("--device", default="auto", metavar="D", help="cpu, cuda or auto")
    @argument("--timeout", type=_start_seconds("timeout"), default=60.0, metavar="S",
              help="torch.distributed timeout in seconds (60)")
    @argument("--init-timeout", type=_start_seconds("init_timeout"), metavar="S",
              help="how long the ranks may take to start (default: --timeout)")
    @argument("--threads", type=_positive(int), metavar="N",
              help="torch threads per rank (default: the cores shared among the ranks)")
    @argument("--max-world-size", type=_positive(int), metavar="N",
              help="raise the limit on -n (4 ranks per CPU core; one rank per GPU)")
    @argument("--debug", metavar="LEVEL",
              help="detail: torch's TORCH_DISTRIBUTED_DEBUG=DETAIL on the ranks, collectives "
                   "checked across ranks (not with DDP on torch 2.13); off (default)")
    @argument("--on", default="local", metavar="ENGINE",
              help="where the ranks run: local (default), slurm, ray, k8s, or a registered engine")
    @argument("--reattach", nargs="?", const="", default=None, metavar="JOB",
              help="take back the ranks a kernel that is gone started with --keep-alive (its "
                   "newest saved group, or job JOB's)")
    @engine_arguments
    def dist_start(self, line: str = "") -> None:
        """Start a group of worker processes and make it the current one.

        If a group is already running this reports it; use %dist_restart to change it.
        """
        args = self.parse(self.dist_start, line)
        if current_group() is not None and current_group().state != "stopped":
            print(f"nbdist: a group is already running: {current_group()!r}; "
                  "change it with %dist_restart, or %dist_stop it first.")
            return
        if args.reattach is not None:
            from ...runtime.engines import reattach

            group = reattach(args.reattach or None)  # NbdistError says what is missing
            _started.add(group)
            use_group(group)
            self._say_ready(group, "reattached")
            return
        engine = engine_options(args)  # UsageError: engine options for a local group
        with self._usage(self.dist_start), option_names(START_OPTIONS):
            group = start(args.world_size, args.backend, args.device, args.timeout,
                          on=args.on, init_timeout=args.init_timeout, threads=args.threads,
                          max_world_size=args.max_world_size, debug=args.debug or "off",
                          **engine)
        _started.add(group)
        use_group(group)
        self._say_ready(group, "started")

    @line_magic
    @magic_arguments()
    @argument("-n", "--world-size", type=_positive(int), metavar="N", help="new number of ranks")
    @argument("--backend", metavar="B", help="new backend")
    @argument("--device", metavar="D", help="new device")
    @argument("--timeout", type=_start_seconds("timeout"), metavar="S",
              help="new torch.distributed timeout (s)")
    @argument("--init-timeout", type=_start_seconds("init_timeout"), metavar="S",
              help="how long the ranks may take to start (s)")
    @argument("--threads", type=_positive(int), metavar="N", help="torch threads per rank")
    @argument("--max-world-size", type=_positive(int), metavar="N",
              help="raise the limit on -n (4 ranks per CPU core; one rank per GPU)")
    @argument("--debug", metavar="LEVEL",
              help="detail: torch's TORCH_DISTRIBUTED_DEBUG=DETAIL on the ranks, collectives "
                   "checked across ranks (not with DDP on torch 2.13); off (default)")
    def dist_restart(self, line: str = "") -> None:
        """Restart the current group with fresh workers; options not given stay as they were.

        Variables on the ranks are lost. Options are checked before the running group stops.
        """
        args = self.parse(self.dist_restart, line)
        changes = {name: value for name, value in vars(args).items() if value is not None}
        group = self.group
        with self._usage(self.dist_restart), option_names(START_OPTIONS):
            group.restart(**changes)
        self._say_ready(group, "restarted")

    @line_magic
    @magic_arguments()
    def dist_stop(self, line: str = "") -> None:
        """Stop the current group's workers; %dist_start starts a new group."""
        self.parse(self.dist_stop, line)
        if current_group() is None:
            print("nbdist: no group is running.")
            return
        current_group().stop()
        use_group(None)
        self.autodist_off()
        print("nbdist: group stopped.")

    @line_magic
    @magic_arguments()
    def dist_status(self, line: str = "") -> None:
        """Show each rank's state, pid, device, backend and memory (a table in Jupyter)."""
        self.parse(self.dist_status, line)
        if current_group() is None:
            print("nbdist: no group is running; start one with %dist_start.")
            return
        status = current_group().status()
        publish_display_data({"text/plain": str(status), "text/html": status._repr_html_()})

    # ---- running code -------------------------------------------------------------------------
    @line_cell_magic
    @magic_arguments()
    @argument("--ranks", type=_rank_list, metavar="R[,R...]",
              help="comma-separated ranks, e.g. 0,2 (default: all)")
    @argument("--timeout", type=_seconds, metavar="S", help="deadline for the cell (s)")
    @argument("-q", "--quiet", action="store_true", help="don't show the per-rank values")
    @argument("--trace", action="store_true",
              help="record the collectives the cell issues; show a summary and a timeline")
    @argument("--bg", nargs="?", const="", default=None, type=job_name, metavar="NAME",
              help="run in the background: the cell returns a job at once (stored in NAME if "
                   "given); %%dist_jobs lists jobs, %%dist_wait NAME waits")
    @argument("--all-output", action="store_true",
              help="show every line the ranks print (by default a line that several ranks print, "
                   "or that a rank repeats, is shown once with its ranks and counted)")
    def dist(self, line: str = "", cell: Optional[str] = None):
        """Run Python code on the ranks: the cell (%%dist) or one statement (%dist statement).

        Each rank runs it in its own namespace, which persists across cells and starts with
        torch, dist, rank, world_size and device. What the ranks print appears labelled by rank;
        the value of the last expression is shown per rank. In the one-line form the options go
        before the statement (end them with -- when the statement itself starts with --); code
        that does not compile is shown as in a local cell, and nothing runs.

        Quiet ranks: a line that several ranks print shows once, labelled with their ranks
        ([ranks 0-3] ...), and a line a rank prints again (a warning every step) is not shown
        again; at the end of the cell a summary lists those lines with how often each rank printed
        them. Lines that differ per rank (losses) show per rank, in order. --all-output shows every
        line; the group keeps them all (group.last_output, job.output); group.dedupe_output = False
        turns folding off for every cell.
        """
        if cell is None:
            options, cell = split_statement(self.dist, line)
            args = self.parse(self.dist, options)
            if not cell:
                raise UsageError("%dist needs a statement to run on the ranks, e.g. "
                                 f"%dist print(rank)\n{usage(self.dist)}")
            check_statement(self.shell, self.dist, cell)
        else:
            args = self.parse(self.dist, line)
            check_cell(self.shell, cell, from_autodist=cell == self._autodist_body)
        if args.bg is not None and args.trace:
            raise UsageError(f"--trace and --bg do not go together (a trace is shown when "
                             f"the cell ends)\n{usage(self.dist)}")
        with _all_output(self.group if args.all_output else None):
            if args.bg is not None:
                return self.run_in_background(cell, args.ranks, args.timeout, args.bg or None)
            if args.trace:
                self.run_traced(cell, args.ranks, args.timeout, args.quiet)
            else:
                self.run_on_ranks(cell, args.ranks, args.timeout, args.quiet)
        return None

    def run_in_background(self, source: str, ranks: Optional[Sequence[int]] = None,
                          timeout: Optional[float] = None, name: Optional[str] = None):
        """Start ``source`` on the ranks as a background job, at once: return it (in a kernel,
        display it instead, and update that display when the job has ended)."""
        group = self.group
        check_ranks(ranks, group.world_size, "--ranks", self.dist)
        job = group.submit_exec(source, ranks=ranks, timeout=timeout,
                                name=name or f"job{len(JOBS) + 1}")
        if name:
            self.shell.user_ns[name] = job
        from ..joboutput import show_job

        return show_job(job)  # in a kernel a display kept current, not a stale Out[]

    def run_on_ranks(self, source: str, ranks: Optional[Sequence[int]] = None,
                     timeout: Optional[float] = None, quiet: bool = False) -> None:
        """Run ``source`` on ``ranks`` of the current group and show each rank's value."""
        group = self.group
        check_ranks(ranks, group.world_size, "--ranks", self.dist)
        targets = list(range(group.world_size)) if ranks is None else sorted(set(ranks))
        values = group.exec(source, ranks=targets, timeout=timeout)
        if not quiet:
            for rank, value in zip(targets, values):
                if value is not None:
                    self._show(rank, value)

    def run_traced(self, source: str, ranks: Optional[Sequence[int]] = None,
                   timeout: Optional[float] = None, quiet: bool = False) -> None:
        """Like :meth:`run_on_ranks`, recording every collective the cell issues on the ranks
        (``nbdist.bench.trace``); then show the per-op summary and the per-rank timeline."""
        from ...bench import Trace

        group = self.group
        check_ranks(ranks, group.world_size, "--ranks", self.dist)  # before the trace starts
        group.exec("import nbdist.bench as _nbdist_bench\n"
                   "_nbdist_trace_cm = _nbdist_bench.trace()\n"
                   "_nbdist_trace = _nbdist_trace_cm.__enter__()", ranks=ranks)
        try:
            self.run_on_ranks(source, ranks, timeout, quiet)
        except BaseException:
            self._stop_trace_after_failure(group, ranks)
            raise
        traces = group.exec(f"{_STOP_TRACE}\n_nbdist_trace", ranks=ranks)
        merged = Trace.merge(traces)
        summary = merged.summary()
        publish_display_data({"text/plain": str(summary), "text/html": summary._repr_html_()})
        if len(merged):
            _show_figure(merged.plot())

    @staticmethod
    def _stop_trace_after_failure(group: Group, ranks: Optional[Sequence[int]]) -> None:
        """Stop the recording on the ranks after the traced cell failed, without hiding the cell's
        error (the caller re-raises it). Nothing to stop if the failure broke the group: its ranks
        are gone, and a restart (``%dist_restart``, or ``auto_restart``) brings fresh ones."""
        if group.state != "ready":
            return
        try:
            group.exec(_STOP_TRACE, ranks=ranks)
        except NbdistError as err:  # the cell's own error follows; say why the recording may run on
            print(f"nbdist: could not stop the --trace recording on the ranks "
                  f"({type(err).__name__}: {str(err).splitlines()[0]}); %dist_restart stops it.",
                  file=sys.stderr)

    def _show(self, rank: int, value) -> None:
        data, metadata = self.shell.display_formatter.format(value)
        if not data:
            return  # the object displayed itself (_ipython_display_)
        label = f"Out[rank {rank}]:"
        if set(data) - {"text/plain", "text/html"}:  # an image, JSON, ...: header, then as it is
            publish_display_data({"text/plain": label, "text/html": f"<b>{html.escape(label)}</b>"})
            publish_display_data(data, metadata)
            return
        plain = data.get("text/plain", "")
        data["text/plain"] = label + ("\n" if "\n" in plain else " ") + plain
        if "text/html" in data:
            data["text/html"] = f"<div><b>{html.escape(label)}</b></div>" + data["text/html"]
        publish_display_data(data, metadata)

    @line_magic
    @magic_arguments()
    @argument("--ranks", type=_rank_list, metavar="R[,R...]",
              help="comma-separated ranks, e.g. 0,2 (default: all)")
    @argument("--timeout", type=_seconds, metavar="S", help="deadline for each cell (s)")
    @argument("-q", "--quiet", action="store_true", help="don't show the per-rank values")
    @argument("--all-output", action="store_true",
              help="show every line the ranks print (repeated lines are folded by default)")
    def autodist(self, line: str = "") -> None:
        """Toggle running every cell on the ranks, as if each began with %%dist (and these options).

        Cells that start with % or ! (magics, shell commands) still run in the kernel, so
        %autodist again turns it off.
        """
        args = self.parse(self.autodist, line)
        if self._autodist is not None:
            self.autodist_off()
            print("nbdist: autodist off: cells run in the kernel again.")
            return
        check_ranks(args.ranks, self.group.world_size, "--ranks", self.autodist)  # now, not later
        options = [f"--ranks {','.join(map(str, args.ranks))}" if args.ranks else "",
                   f"--timeout {args.timeout:g}" if args.timeout else "",
                   "--quiet" if args.quiet else "", "--all-output" if args.all_output else ""]
        self._autodist = " ".join(o for o in options if o)
        self.shell.input_transformers_cleanup.append(self._autodist_transform)
        print("nbdist: autodist on: every cell runs on the ranks; %autodist turns it off.")

    def autodist_off(self) -> None:
        """Turn ``%autodist`` off (nothing happens if it is off)."""
        if self._autodist_transform in self.shell.input_transformers_cleanup:
            self.shell.input_transformers_cleanup.remove(self._autodist_transform)
        self._autodist = self._autodist_body = None

    def _autodist_transform(self, lines: List[str]) -> List[str]:
        first = next((line.lstrip() for line in lines if line.strip()), "")
        self._autodist_body = None
        if self._autodist is None or not first or first.startswith(("%", "!")):
            return lines
        self._autodist_body = "".join(lines)  # the %%dist line added: the code starts on line 1
        return [f"%%dist {self._autodist}\n"] + lines

    _autodist_transform.has_side_effects = True  # keeps IPython's is-complete check unaffected

    # ---- variables ----------------------------------------------------------------------------
    @line_magic
    @magic_arguments()
    @argument("names", nargs="+", help="kernel variables to copy to the ranks")
    @argument("--ranks", type=_rank_list, metavar="R[,R...]",
              help="comma-separated ranks (default: all)")
    def dist_push(self, line: str = "") -> None:
        """Copy kernel variables, by name, to the ranks (tensors travel via shared memory)."""
        args = self.parse(self.dist_push, line)
        check_ranks(args.ranks, self.group.world_size, "--ranks", self.dist_push)
        missing = [name for name in args.names if name not in self.shell.user_ns]
        if missing:
            raise UsageError(f"not defined in the kernel: {', '.join(missing)}\n"
                             f"{usage(self.dist_push)}")
        with self._usage(self.dist_push):
            self.group.push({name: self.shell.user_ns[name] for name in args.names},
                            ranks=args.ranks)

    @line_magic
    @magic_arguments()
    @argument("names", nargs="+", help="variables to copy from the ranks into the kernel")
    @argument("--rank", type=_rank, metavar="R",
              help="take the value of this rank (default: a list, one per rank)")
    def dist_pull(self, line: str = "") -> None:
        """Copy variables from the ranks into the kernel: a list with one value per rank, or the
        value of one rank with --rank R."""
        args = self.parse(self.dist_pull, line)
        check_ranks([args.rank] if args.rank is not None else None, self.group.world_size,
                    "--rank", self.dist_pull)
        ranks = None if args.rank is None else [args.rank]
        with self._usage(self.dist_pull):
            values = self.group.pull(*args.names, ranks=ranks)
        for i, name in enumerate(args.names):
            per_rank = [v if len(args.names) == 1 else v[i] for v in values]
            self.shell.user_ns[name] = per_rank if args.rank is None else per_rank[0]

    # ---- helpers ------------------------------------------------------------------------------
    @staticmethod
    @contextlib.contextmanager
    def _usage(magic) -> Iterator[None]:
        """Turn the group's argument errors (``ValueError``/``TypeError``) into ``UsageError``."""
        try:
            yield
        except (ValueError, TypeError) as err:
            raise UsageError(f"{err}\n{usage(magic)}") from None

    @staticmethod
    def _say_ready(group: Group, what: str) -> None:
        print(f"nbdist: {what} {group.world_size} ranks (backend {group.backend}, device "
              f"{group.device}); run a cell on them with %%dist.")
