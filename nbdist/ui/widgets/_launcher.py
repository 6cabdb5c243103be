"""The launcher: choose world size, device, backend, strategy and timeout; Start / Restart / Stop
the current group; a per-rank status table that a background thread keeps up to date."""
from __future__ import annotations

import html
import threading
from typing import Optional

import ipywidgets as widgets
from traitlets import Float, Instance, Int, TraitError, Unicode, observe, validate

from ...backends import registered_backends, resolve_backend, resolve_device
from ...errors import NbdistError
from ...runtime.api import start
from ...runtime.engines import engines_here as available_engines
from ...runtime.group import Group, current_group, use_group
from ...runtime.launcher import restart_refusal
from ...runtime.status import GroupStatus
from ...wire import locks
from ._common import Panel, backend_options, device_options, reasons_html
from ._meshes import mesh_note, strategy_options

_STATE_COLORS = {"idle": "#1b7f3b", "busy": "#b26a00", "dead": "#b00020", "stopped": "#666"}


class Launcher(Panel):
    """Start, restart and stop the current group (:func:`nbdist.current_group`) from a panel.

    The group it starts is made current with :func:`nbdist.use_group`, so ``%%dist`` cells,
    ``nbdist.current_group()`` and the other panels use the very same object; Restart and Stop act
    on the current group, whoever started it. The chosen ``strategy`` name is pushed to the ranks
    as the variable ``strategy`` (for ``nbdist.strategies.wrap(strategy, model, ...)``).

    Every option is a validated trait: ``launcher.backend = "nccl"`` raises ``TraitError`` with the
    reason where NCCL can't be used, and choosing it in the dropdown shows that reason in the panel
    and keeps the previous choice. A background thread refreshes the status table every
    ``refresh_interval`` seconds until :meth:`close`; a refresh that fails leaves the last table
    with the error under it, and the next one tries again.
    """

    world_size = Int(2, min=1, help="number of ranks")
    device = Unicode("cpu", help="'cpu' or 'cuda'")
    backend = Unicode("auto", help="'auto', a built-in backend or a registered custom one")
    strategy = Unicode("ddp", help="a registered strategy name (nbdist.strategies)")
    timeout = Float(60.0, help="torch.distributed timeout in seconds")
    where = Unicode("local", help="where the ranks run: 'local' or an engine usable here ('slurm')")
    status = Instance(GroupStatus, allow_none=True, help="the current group's last status")
    refresh_interval = Float(0.5, help="seconds between two refreshes of the status table")

    def __init__(self, world_size: Optional[int] = None, device: Optional[str] = None,
                 backend: str = "auto", strategy: str = "ddp", timeout: float = 60.0,
                 refresh_interval: float = 0.5):
        super().__init__()
        self.add_class("nbdist-launcher")
        running = current_group()
        if running is not None and running.state != "stopped":  # show the group as it is
            world_size, device = running.world_size, running.device
            backend = running.backend if running.backend in _names(running.device) else "auto"
        self.device = resolve_device(device or "auto")
        if world_size is None:  # one rank per GPU, or two CPU ranks
            import torch

            world_size = torch.cuda.device_count() if self.device == "cuda" else 2
        self.world_size, self.backend, self.strategy = world_size, backend, strategy
        self.timeout, self.refresh_interval = timeout, refresh_interval
        self._engines = available_engines()  # name -> None, or why it cannot run here

        wide = {"description_width": "initial"}
        dev_options, dev_reasons = device_options()
        self._controls = {
            "world_size": widgets.BoundedIntText(self.world_size, min=1, max=4096,
                                                 description="world size", style=wide,
                                                 layout=widgets.Layout(width="150px")),
            "device": widgets.Dropdown(options=dev_options, value=self.device,
                                       description="device", style=wide,
                                       layout=widgets.Layout(width="210px")),
            "backend": widgets.Dropdown(description="backend", style=wide,
                                        layout=widgets.Layout(width="260px")),
            "strategy": widgets.Dropdown(options=strategy_options(self.world_size),
                                         value=self.strategy, description="strategy", style=wide,
                                         layout=widgets.Layout(width="330px")),
            "timeout": widgets.BoundedFloatText(self.timeout, min=0.0, max=1e6,
                                                description="timeout (s)", style=wide,
                                                layout=widgets.Layout(width="160px")),
            "where": widgets.Dropdown(options=[n for n, why in self._engines.items() if not why],
                                      value=self.where, description="where", style=wide,
                                      layout=widgets.Layout(width="170px")),
        }
        for name, control in self._controls.items():
            control.add_class(f"nbdist-{name.replace('_', '-')}")
        self._device_note = reasons_html(dev_reasons, "devices") + reasons_html(
            [f"{n}: {why}" for n, why in self._engines.items() if why], "engines")
        self._notes = widgets.HTML()
        self._known_backends = None
        self._update_backend_options()
        self._controls["backend"].value = self.backend
        for name, control in self._controls.items():
            self.bind(control, name)

        self.buttons = {name: widgets.Button(description=name.title(), button_style=style,
                                             icon=icon)
                        for name, style, icon in (("start", "success", "play"),
                                                  ("restart", "warning", "refresh"),
                                                  ("stop", "danger", "stop"))}
        for name, button in self.buttons.items():
            button.add_class(f"nbdist-{name}")
        self.buttons["start"].on_click(lambda _: self._press("start"))
        self.buttons["restart"].on_click(lambda _: self._press("restart"))
        self.buttons["stop"].on_click(lambda _: self._press("stop"))
        self._table = widgets.HTML()
        self._table.add_class("nbdist-status-table")
        c = self._controls
        self.children = [
            widgets.HTML("<b>nbdist launcher</b>"),
            widgets.HBox([c["world_size"], c["device"], c["backend"]]),
            widgets.HBox([c["strategy"], c["timeout"], c["where"]]),
            self._notes,
            widgets.HBox(list(self.buttons.values())),
            self._table,
            self._feedback,
        ]
        self._lock = locks.make("panel")
        self._last_table = ""  # the table of the last refresh that worked
        self._closed = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._watch, name="nbdist-launcher-status",
                                        daemon=True)
        self._thread.start()

    # ---- validation ---------------------------------------------------------------------------
    @validate("device")
    def _check_device(self, proposal):
        try:
            return resolve_device(proposal["value"])
        except ValueError as err:
            raise TraitError(str(err)) from None

    @validate("backend")
    def _check_backend(self, proposal):
        try:
            resolve_backend(proposal["value"], self.device)
        except (ValueError, TypeError) as err:  # BackendError is a ValueError
            raise TraitError(str(err)) from None
        return proposal["value"]

    @validate("strategy")
    def _check_strategy(self, proposal):
        from ...strategies import get_strategy

        try:
            get_strategy(proposal["value"])
        except ValueError as err:
            raise TraitError(str(err)) from None
        return proposal["value"]

    @validate("where")
    def _check_where(self, proposal):
        engines = getattr(self, "_engines", None) or available_engines()
        why = engines.get(proposal["value"], "it is not an engine")
        if why:
            raise TraitError(f"the ranks cannot run on {proposal['value']!r}: {why}")
        return proposal["value"]

    @validate("timeout", "refresh_interval")
    def _check_seconds(self, proposal):
        if not proposal["value"] > 0:
            raise TraitError(f"{proposal['trait'].name} must be a positive number of seconds, "
                             f"got {proposal['value']!r}")
        return proposal["value"]

    @observe("device")
    def _device_changed(self, change) -> None:
        if not hasattr(self, "_controls"):
            return  # still in __init__
        self._update_backend_options()
        try:
            resolve_backend(self.backend, self.device)
        except ValueError:
            self.backend = "auto"

    @observe("world_size")
    def _world_size_changed(self, change) -> None:
        if hasattr(self, "_controls"):  # the mesh sizes in the strategy labels follow
            self.set_options(self._controls["strategy"], "strategy",
                             strategy_options(self.world_size))
            self._show_notes()

    @observe("strategy")
    def _strategy_changed(self, change) -> None:
        group = current_group()
        if hasattr(self, "_controls") and group is not None and group.state == "ready":
            self.action("pushing the strategy", lambda: group.push(strategy=self.strategy))
        self._show_notes()

    def _update_backend_options(self) -> None:
        options, reasons = backend_options(self.device)
        self._known_backends = tuple(registered_backends())
        self._backend_reasons = reasons
        control = self._controls["backend"]
        value = control.value if control.value in [v for _, v in options] else "auto"
        control.options = options
        control.value = value
        self._show_notes()

    def _show_notes(self) -> None:
        if not hasattr(self, "_controls"):
            return
        from ...strategies import available_strategies

        about = available_strategies().get(self.strategy, "")
        self._notes.value = (
            f"<div style='font-size:smaller;color:#444'><b>{html.escape(self.strategy)}</b>: "
            f"{html.escape(about)} (on the ranks: the variable <code>strategy</code>)</div>"
            + mesh_note(self.strategy, self.world_size) + reasons_html(self._backend_reasons, "backends") + self._device_note)

    # ---- actions ------------------------------------------------------------------------------
    def start(self) -> Group:
        """Start a group with the panel's options and make it the current group."""
        running = current_group()
        if running is not None and running.state != "stopped":
            raise NbdistError(f"a group is already running ({running!r}); press Restart to "
                              "change it, or Stop it first.")
        group = start(self.world_size, self.backend, self.device, self.timeout, on=self.where)
        use_group(group)
        group.push(strategy=self.strategy)
        self.refresh()
        return group

    def restart(self) -> Group:
        """Restart the current group with the panel's options (per-rank variables are lost)."""
        group = self.group
        group.restart(world_size=self.world_size, backend=self.backend, device=self.device,
                      timeout=self.timeout)
        group.push(strategy=self.strategy)
        self.refresh()
        return group

    def stop(self) -> None:
        """Stop the current group and detach it (``nbdist.current_group()`` is then ``None``)."""
        group = self.group
        group.stop()
        use_group(None)
        self.refresh()

    _VERBS = {"start": ("starting the group", "started"),
              "restart": ("restarting the group", "restarted"),
              "stop": ("stopping the group", "stopped")}

    def _press(self, name: str) -> None:
        doing, done = self._VERBS[name]
        for button in self.buttons.values():
            button.disabled = True
        try:
            self.action(doing, lambda: _outcome(getattr(self, name)(), done))
        finally:
            self.refresh()

    # ---- status -------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the current group's status now and redraw the table and the buttons."""
        with self._lock:
            if tuple(registered_backends()) != self._known_backends:
                self._update_backend_options()
            group = current_group()
            running = group is not None and group.state != "stopped"
            self.status = group.status() if running else None
            refusal = restart_refusal(group) if running else None
            self._table.value = self._last_table = self._render(group if running else None,
                                                                refusal)
            self.buttons["start"].disabled = running
            self.buttons["stop"].disabled = not running
            self.buttons["restart"].disabled = not running or bool(refusal)
            self.buttons["restart"].tooltip = refusal or ""

    def _render(self, group: Optional[Group], refusal: Optional[str] = None) -> str:
        if group is None or self.status is None:
            return ("<div class='nbdist-group' data-state='none'>no group is running: choose "
                    "the options and press <b>Start</b>.</div>")
        s = self.status
        rows = []
        remote = any(r.node for r in s.ranks)  # ranks torchrun/srun started: where they run
        for r in s.ranks:
            color = _STATE_COLORS.get(r.state, "#000")
            mem = f"{r.rss / 2**20:.0f} MiB" if r.rss is not None else "-"
            cells = [(str(r.rank), "rank"), (r.describe_state(), "state"), (str(r.pid or "-"),
                     "pid")] + ([(r.host, "host"), (r.node, "node")] if remote else []) + [
                (r.device, "device"), (mem, "memory"), (r.last_error[:120], "last-error")]
            rows.append("<tr>" + "".join(
                f"<td class='nbdist-col-{cls}'" + (f" data-state='{html.escape(r.state)}' "
                                               f"style='color:{color}'" if cls == "state" else "")
                + f">{html.escape(text)}</td>" for text, cls in cells) + "</tr>")
        head = "".join(f"<th style='text-align:left;padding-right:1em'>{c}</th>" for c in
                       ("rank", "state", "pid") + (("host", "node") if remote else ())
                       + ("device", "memory (RSS)", "last error"))
        note = (f"<div class='nbdist-restart-note' style='font-size:smaller;color:#444'>Restart "
                f"is off: {html.escape(refusal)}</div>" if refusal else "")
        job = (f"<div class='nbdist-job'>{html.escape(s.job)}</div>" if s.job else "")
        return (f"<div class='nbdist-group' data-state='{html.escape(s.state)}' "
                f"data-backend='{html.escape(s.backend)}'>group "
                f"<code>{group.id}</code>: <b>{html.escape(s.state)}</b>, world size "
                f"{s.world_size}, backend <code>{html.escape(s.backend)}</code>, device "
                f"{html.escape(s.device)}</div>{job}<table class='nbdist-ranks'><thead><tr>{head}"
                f"</tr></thead><tbody>{''.join(rows)}</tbody></table>{note}")

    def _watch(self) -> None:
        while not self._closed.wait(self.refresh_interval):
            try:
                self.refresh()
            except Exception as err:  # noqa: BLE001 -- shown under the table; the next one retries
                self._show_refresh_error(err)

    def _show_refresh_error(self, err: Exception) -> None:
        """Keep the last table read, with what went wrong under it (until a refresh succeeds)."""
        note = (f"<div class='nbdist-refresh-error' style='color:#b00020'>refreshing the status "
                f"failed: {html.escape(f'{type(err).__name__}: {err}')}; trying again every "
                f"{self.refresh_interval:g} s</div>")
        with self._lock:
            self._table.value = self._last_table + note

    def close(self) -> None:
        """Stop the status thread and close the panel (the group keeps running)."""
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        super().close()


def _outcome(group: Optional[Group], done: str) -> str:
    if group is None:
        return f"{done} the group"
    return (f"{done} {group.world_size} ranks (backend {group.backend}, device {group.device}); "
            "nbdist.current_group() and %%dist use this group")


def _names(device: str):
    return [name for _, name in backend_options(device)[0]]
