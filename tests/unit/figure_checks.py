"""The readability checks of nbdist's figures, shared by the figure tests: what the drawn figure's
own bounding boxes say about overlapping texts, texts outside the figure or in another panel,
legends over data, and axes without units."""
import re

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.text import Text
from matplotlib.transforms import Bbox

SLACK = 0.5  # px: boxes that share an edge touch, they do not overlap


def _name(t: Text) -> str:
    ax = t.axes
    where = f" in {ax.get_title()!r}" if ax is not None and ax.get_title() else ""
    return f"{t.get_text()!r}{where}"


def _overlap(a: Bbox, b: Bbox) -> bool:
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > SLACK
            and min(a.y1, b.y1) - max(a.y0, b.y0) > SLACK)


def _drawn_texts(fig):
    """Draw ``fig`` and return its renderer and the Text artists actually drawn with their boxes
    (clipped where the text is clipped); tick labels beyond the axis limits are not drawn, so
    they do not count."""
    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    drawn = []
    original = Text.draw

    def recording(self, renderer):
        drawn.append(self)
        return original(self, renderer)

    Text.draw = recording
    try:
        fig.canvas.draw()
    finally:
        Text.draw = original
    renderer = fig.canvas.get_renderer()
    out = []
    for t in dict.fromkeys(drawn):
        if not t.get_visible() or not t.get_text().strip():
            continue
        box = t.get_window_extent(renderer)
        clip = t.get_clip_box() if t.get_clip_on() else None
        if clip is not None:
            box = Bbox.intersection(box, clip)
            if box is None:
                continue
        out.append((t, box))
    return renderer, out


def _data_paths(ax):
    """Display-space paths of what the Axes plots: lines, bar patches, bar collections."""
    for line in ax.get_lines():
        if line.get_visible():
            yield line, line.get_transform().transform_path(line.get_path()), False
    for patch in ax.patches:
        if patch.get_visible():
            yield patch, patch.get_transform().transform_path(patch.get_path()), True
    for coll in ax.collections:
        if coll.get_visible() and isinstance(coll, (PolyCollection, LineCollection)):
            for path in coll.get_paths():
                yield coll, coll.get_transform().transform_path(path), True


def layout_problems(fig):
    """What makes ``fig`` hard to read, as sentences: overlapping texts, texts outside the figure,
    texts reaching into a panel they don't belong to (a y-label over the next panel, a note
    spilling over), legends over plotted data. Empty when the figure is clean."""
    renderer, texts = _drawn_texts(fig)
    problems = []
    inside = fig.bbox.padded(1)
    for i, (a, box_a) in enumerate(texts):
        if not (inside.contains(box_a.x0, box_a.y0) and inside.contains(box_a.x1, box_a.y1)):
            problems.append(f"{_name(a)} leaves the figure (x {box_a.x0:.0f}..{box_a.x1:.0f}, "
                            f"y {box_a.y0:.0f}..{box_a.y1:.0f} in {fig.bbox.width:.0f} x "
                            f"{fig.bbox.height:.0f} px)")
        for b, box_b in texts[i + 1:]:
            if _overlap(box_a, box_b):
                problems.append(f"{_name(a)} overlaps {_name(b)}")
        for ax in fig.axes:
            if ax is not a.axes and a.axes is not None and _overlap(box_a, ax.bbox):
                problems.append(f"{_name(a)} reaches into the panel {ax.get_title()!r}")
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            for artist, path, filled in _data_paths(ax):
                clipped = Bbox.intersection(path.get_extents(), ax.bbox)
                if clipped is not None and path.intersects_bbox(box, filled=filled) and \
                        _overlap(clipped, box):
                    label = artist.get_label()
                    what = label if label and not label.startswith("_") else \
                        f"a {type(artist).__name__} at x {clipped.x0:.0f}..{clipped.x1:.0f} px"
                    problems.append(f"the legend ({', '.join(t.get_text() for t in legend.texts)})"
                                    f" covers {what} in {ax.get_title()!r}")
                    break
    return problems


def _is_number(text: str) -> bool:
    try:
        float(text.replace("\u2212", "-"))  # matplotlib's minus sign
    except ValueError:
        return False
    return True


_COUNTS = ("step",)  #: axis labels that count things: no unit to name


def axes_without_units(fig):
    """The axes whose tick labels are bare numbers and whose label names no unit, as
    ``"(s)"``, ``"(GB/s)"`` or ``"(ranks)"`` do; tick labels with units ("4 KiB") need none.
    A count ("step") has none, and neither has a scalar the user logged under a name nbdist can't
    know the unit of (the live view's "loss" panel: label and title are the scalar's name)."""
    out = []
    for ax in fig.axes:
        if not ax.axison:
            continue
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            ticks = [t.get_text() for t in axis.get_ticklabels() if t.get_text()]
            label = axis.get_label_text()
            if label in _COUNTS or (label and label == ax.get_title()):
                continue
            if ticks and all(map(_is_number, ticks)) and not re.search(r"\(.+\)", label):
                out.append(f"{name} axis {axis.get_label_text()!r} of {ax.get_title()!r}")
    return out
