"""What the panels share: the message area, button actions that report errors in the panel,
controls bound to validated traits, figures as PNG and the backend choices of a device."""
from __future__ import annotations

import base64
import contextlib
import html
import io
import re
from typing import Callable, List, Optional, Tuple

import ipywidgets as widgets
from traitlets import TraitError, Unicode, observe

from ...backends import backend_report, resolve_backend, resolve_device
from ...errors import GroupClosedError
from ...runtime.group import Group, current_group

UNAVAILABLE = "✗ unavailable"
"""What a backend's or a device's label in a dropdown ends with when it can't be used here."""


class Panel(widgets.VBox):
    """Base of nbdist's panels: a VBox with an ``error`` and a ``message`` line at the bottom.

    Buttons call the panel's public methods through :meth:`action`, which shows an exception in
    the panel (``error``) instead of letting it vanish into the kernel's log, and shows what the
    call printed (notes such as the threads per rank) as ``message``.
    """

    error = Unicode("", help="the last action's error, shown in red in the panel ('' if none)")
    message = Unicode("", help="the last action's outcome and notes, shown in the panel")

    def __init__(self, group: Optional[Group] = None, **kwargs):
        self._group = group
        self._quiet: set = set()  # traits whose control is being relabelled (set_options)
        self._feedback = widgets.HTML(layout=widgets.Layout(width="100%"))
        self._feedback.add_class("nbdist-feedback")
        super().__init__(**kwargs)

    # ---- the group ----------------------------------------------------------------------------
    @property
    def group(self) -> Group:
        """The panel's group: the one it was given, else the current group (at call time)."""
        group = self._group if self._group is not None else current_group()
        if group is None or group.state == "stopped":
            raise GroupClosedError("no nbdist group is running: start one with the launcher "
                               "(nbdist.ui.launcher()), %dist_start or nbdist.start().")
        return group

    # ---- feedback -----------------------------------------------------------------------------
    @observe("error", "message")
    def _show_feedback(self, change=None) -> None:
        parts = []
        if self.error:
            parts.append("<div class='nbdist-error' style='color:#b00020;white-space:pre-wrap;"
                         "'>" + html.escape(self.error) + "</div>")
        if self.message:
            parts.append("<div class='nbdist-message' style='color:#555;white-space:pre-wrap'>"
                         + html.escape(self.message) + "</div>")
        self._feedback.value = "".join(parts)

    def action(self, what: str, fn: Callable[[], Optional[str]]) -> bool:
        """Run ``fn`` for a button: its return value and printed notes become ``message``, an
        exception becomes ``error``; return whether it succeeded."""
        self.error = ""
        self.message = f"{what}…"
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                outcome = fn()
        except Exception as err:  # noqa: BLE001 -- shown in the panel, never swallowed
            self.message = printed.getvalue().strip()
            self.error = f"{what} failed: {type(err).__name__}: {err}"
            return False
        self.message = "\n".join(t for t in (outcome or "", printed.getvalue().strip()) if t)
        return True

    def bind(self, control: widgets.ValueWidget, trait: str) -> None:
        """Keep ``control.value`` and the trait ``trait`` equal. A value the trait's validation
        refuses is shown as ``error`` and the control goes back to the trait's value."""

        reverting = []

        def to_trait(change):
            if reverting or trait in self._quiet:
                return
            try:
                setattr(self, trait, change["new"])
            except TraitError as err:
                self.error = str(err)
                reverting.append(True)
                try:
                    control.value = getattr(self, trait)
                finally:
                    reverting.clear()
            else:
                self.error = ""

        def to_control(change):
            if control.value != change["new"]:
                control.value = change["new"]

        control.observe(to_trait, "value")
        self.observe(to_control, trait)

    def set_options(self, control: widgets.Dropdown, trait: str, options) -> None:
        """Give a bound dropdown new ``options`` (new labels, say) and keep the trait's value: the
        trait never sees the dropdown pass through its first option on the way."""
        self._quiet.add(trait)
        try:
            control.options = options
            control.value = getattr(self, trait)
        finally:
            self._quiet.discard(trait)

    # ---- a page without the widget ------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs):
        """The widget, with what it shows now as text and static HTML: a page that cannot run
        the widget (a saved notebook on GitHub or nbviewer, an export without widget state)
        shows the panel's text, tables and figures as they were, instead of an empty output or
        a repr of its children (issue 35). The mesh panel writes its own."""
        data = super()._repr_mimebundle_(**kwargs)
        if data is not None:
            data["text/plain"] = self._static_text()
            data["text/html"] = self._static_html()
        return data

    def _static_text(self) -> str:
        """``nbdist <title>: <the last action's outcome or error>``, on one line."""
        title = next((_plain(c.value) for c in _leaves(self) if isinstance(c, widgets.HTML)
                      and c.value), type(self).__name__)
        said = " ".join((self.error or self.message).split())
        return f"{title}: {said}" if said else title

    def _static_html(self) -> str:
        parts = []
        for child in _leaves(self):
            if isinstance(child, widgets.HTML) and child.value:
                parts.append(child.value)
            elif isinstance(child, widgets.Image) and child.value:
                png = base64.b64encode(child.value).decode("ascii")
                parts.append(f"<img src='data:image/png;base64,{png}' alt='a figure of the "
                             "panel' style='max-width:100%'>")
        return ("<div class='nbdist-panel-static'>" + "".join(parts) + "<div style='font-size:"
                "smaller;color:#555'>(the panel's controls need a running kernel)</div></div>")

    def close(self) -> None:
        """Close the panel and every widget in it."""
        for child in _descendants(self):
            child.close()
        super().close()


def _descendants(box: widgets.Box) -> List[widgets.Widget]:
    out = []
    for child in box.children:
        if isinstance(child, widgets.Box):
            out.extend(_descendants(child))
        out.append(child)
    return out


def _leaves(box: widgets.Box) -> List[widgets.Widget]:
    """The widgets in ``box`` that are not boxes, in the order they are shown."""
    return [w for w in _descendants(box) if not isinstance(w, widgets.Box)]


def _plain(markup: str) -> str:
    """An HTML title as text: 'nbdist launcher' for '<b>nbdist launcher</b>'."""
    return html.unescape(re.sub(r"<[^>]+>", "", markup)).strip()


def backend_options(device: str) -> Tuple[List[Tuple[str, str]], List[str]]:
    """Dropdown options ``(label, name)`` for the backends on ``device``, and one line per
    unusable backend with the reason (from :func:`nbdist.backends.backend_report`)."""
    try:
        auto = resolve_backend("auto", device).backend
    except ValueError:
        auto = None
    options = [(f"auto → {auto}" if auto else "auto", "auto")]
    reasons = []
    builtin = {"gloo", "nccl", "mpi", "ucc", "xccl"}
    for name, usable, reason in backend_report(device):
        custom = "" if name in builtin else " (custom)"
        options.append((f"{name}{custom}" if usable else f"{name}{custom} {UNAVAILABLE}", name))
        if not usable:
            reasons.append(f"{name}: {reason}")
    return options, reasons


def device_options() -> Tuple[List[Tuple[str, str]], List[str]]:
    """Dropdown options for the devices (cpu; cuda labelled unavailable where it is) and the
    reasons for the unusable ones."""
    options, reasons = [], []
    for device in ("cpu", "cuda"):
        try:
            resolve_device(device)
        except ValueError as err:
            options.append((f"{device} {UNAVAILABLE}", device))
            reasons.append(f"{device}: {err}")
        else:
            options.append((device, device))
    return options, reasons


def reasons_html(reasons: List[str], what: str = "backends") -> str:
    """The "backends not available here" note under a dropdown, one reason per line."""
    if not reasons:
        return ""
    items = "".join(f"<li>{html.escape(r)}</li>" for r in reasons)
    return ("<details class='nbdist-unavailable' style='font-size:smaller;color:#666'>"
            f"<summary>{what} not available here ({len(reasons)})</summary><ul>{items}</ul>"
            "</details>")


def figure_png(draw: Callable, figsize: Tuple[float, float], ncols: int = 1) -> bytes:
    """Draw with ``draw(ax)`` on a new figure (outside pyplot: nothing is shown twice by the
    inline backend; constrained layout, as :mod:`nbdist.ui.plots.style` makes them) and return it
    as PNG bytes."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=90, layout="constrained")
    axes = fig.subplots(1, ncols)
    draw(axes)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def image() -> widgets.Image:
    """An empty PNG image widget for a figure, hidden while it has none (an empty image shows as
    a broken one)."""
    img = widgets.Image(format="png", layout=widgets.Layout(max_width="100%", display="none",
                                                            align_self="flex-start"))
    img.add_class("nbdist-figure")
    img.observe(lambda change: setattr(img.layout, "display", None if change["new"] else "none"),
                "value")
    return img
