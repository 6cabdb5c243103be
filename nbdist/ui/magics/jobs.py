"""``%%dist --bg``'s companions: ``%dist_jobs`` lists the background jobs started in this kernel
(``%%dist --bg``, ``g.submit``, ``nbdist.lightning.fit(..., block=False)``),
``%dist_wait [NAME]`` waits for one (a progress bar follows the steps the ranks log) and
``%dist_watch [NAME]`` shows its live view; ``%dist_stacks`` shows where every rank is now."""
from __future__ import annotations

import html
from typing import Optional

from IPython.core.error import UsageError
from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import publish_display_data

from ...runtime.jobs import Job
from ..joboutput import finish as finish_output
from ..live import finish_views
from ..progress import wait_with_bar
from .base import (JOBS, NbdistMagics, _rank_list, _seconds, job_name,  # noqa: F401
                   register_magics, usage)

def find_job(name: Optional[str]) -> Job:
    """The job called ``name``, or the latest one; ``UsageError`` naming the known jobs if none."""
    for job in reversed(JOBS):
        if name is None or job.name == name:
            return job
    known = ", ".join(j.name for j in JOBS) or "none yet"
    raise UsageError(f"no background job {'named ' + repr(name) if name else 'was started'} "
                     f"(jobs: {known}); start one with %%dist --bg NAME or g.submit(fn)")


@register_magics
@magics_class
class JobMagics(NbdistMagics):
    """``%dist_jobs``, ``%dist_wait``, ``%dist_watch`` and ``%dist_stacks``."""

    @line_magic
    @magic_arguments()
    @argument("--all", action="store_true", help="every thread, not only the main thread")
    @argument("--ranks", type=_rank_list, metavar="R[,R...]",
              help="comma-separated ranks, e.g. 0,2 (default: all)")
    @argument("--timeout", type=_seconds, default=5.0, metavar="S",
              help="how long to wait for the ranks' answers (default 5 s)")
    def dist_stacks(self, line: str = ""):
        """Show where every rank is now: its Python stack, taken by the rank's watchdog thread,
        so it works while a background job or a hung collective keeps the rank busy. Ranks with
        the same stack show once. Returns the Stacks (``_.by_rank`` has the frames)."""
        args = self.parse(self.dist_stacks, line)
        group = self.group
        try:
            return group.stacks(all_threads=args.all, ranks=args.ranks, timeout=args.timeout)
        except (ValueError, TypeError) as err:  # e.g. --ranks 7 on a group of 2
            raise UsageError(f"{err}\n{usage(self.dist_stacks)}") from None

    @line_magic
    @magic_arguments()
    def dist_jobs(self, line: str = "") -> None:
        """List the background jobs started in this kernel (%%dist --bg, g.submit, Lightning's
        fit(block=False)): state, time, last step per rank."""
        self.parse(self.dist_jobs, line)
        if not JOBS:
            print("no background jobs yet: start one with %%dist --bg NAME or g.submit(fn)")
            return
        text = "\n".join(job.describe() for job in JOBS)
        rows = "".join(f"<tr><td>{html.escape(j.name)}</td><td>{j.state}</td>"
                       f"<td>{j.elapsed:.1f}</td><td>{html.escape(_steps(j))}</td></tr>"
                       for j in JOBS)
        publish_display_data({"text/plain": text, "text/html": (
            "<table><thead><tr><th>job</th><th>state</th><th>time (s)</th><th>last step</th>"
            f"</tr></thead><tbody>{rows}</tbody></table>")})

    @line_magic
    @magic_arguments()
    @argument("name", nargs="?", help="the job (default: the latest)")
    @argument("-q", "--quiet", action="store_true", help="don't show the per-rank values")
    def dist_wait(self, line: str = ""):
        """Wait for a background job (default: the latest), with a progress bar of the logged
        steps; then show its per-rank values, or raise its error. Interrupting the wait leaves the
        job running (stop it with job.interrupt())."""
        args = self.parse(self.dist_wait, line)
        job = find_job(args.name)
        try:
            wait_with_bar(job)
        except KeyboardInterrupt:
            print(f"nbdist: stopped waiting; job {job.name!r} is still running "
                  f"(job.interrupt() stops it).")
            return None
        if job.paused:  # waiting on would last until someone attaches, from another cell
            job.result(0)  # raises JobPausedError: where it is paused, and how to attach
        finish_views(job)  # each live view of the job draws its final figure first
        finish_output(job)  # and the display of what its ranks printed is complete
        values = job.result()
        if not args.quiet:
            show = self.shell.display_formatter.format
            for rank, value in enumerate(values):
                if value is not None:
                    data, _ = show(value)
                    publish_display_data({"text/plain": f"Out[rank {rank}]: "
                                                        f"{data.get('text/plain', '')}"})
        return None


    @line_magic
    @magic_arguments()
    @argument("name", nargs="?", help="the job (default: the latest)")
    def dist_watch(self, line: str = ""):
        """A live view of a background job (default: the latest): status, Interrupt button, and
        per-rank curves of what the ranks log, redrawn in place while the notebook stays usable;
        the final figure stays when the job ends."""
        from ..live import watch

        args = self.parse(self.dist_watch, line)
        watch(find_job(args.name))


def _steps(job: Job) -> str:
    """The last step each rank logged, or that none was logged (yet)."""
    steps = job.metrics.last_step()
    text = ", ".join(f"rank {r}: {s}" for r, s in sorted(steps.items()) if s is not None)
    return text or ("none logged yet" if job.running() else "none logged")


__all__ = ["JOBS", "JobMagics", "find_job", "job_name", "usage"]
