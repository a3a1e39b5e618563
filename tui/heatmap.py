"""The KV-read heatmap: regions of the context (x) by layers (y), bucketed to the space available.

Two shadings: amber cells are read by the latest decode step, blue cells by earlier steps of the
answer (brighter = read by more steps). The row under the map marks the selected region; arrow keys
or a click select one, and the widget posts `RegionSelected`.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.events import Click
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from kvlocal.tui.live import ReadMap

NOW = "#ffb000"
UNREAD_DOC = "#2b3240"
UNREAD_TAIL = "#40342b"  # question and answer tokens (after the document)
SHADES = ("#1b3d66", "#1f5a8f", "#2878b8", "#3996d6", "#58b4ec", "#8fd3ff")
AXIS = "#5c6370"
CURSOR = "#ffd75f"


def bucket_starts(n_items: int, n_slots: int) -> np.ndarray:
    """First item of each slot: slots share items when items < slots, and hold several when more."""
    if n_items <= 0 or n_slots <= 0:
        return np.zeros(0, np.int64)
    return (np.arange(n_slots, dtype=np.int64) * n_items) // n_slots


def bucket_ends(starts: np.ndarray, n_items: int) -> np.ndarray:
    ends = np.empty_like(starts)
    if starts.size:
        ends[:-1] = np.maximum(starts[1:], starts[:-1] + 1)
        ends[-1] = n_items
    return ends


@lru_cache(maxsize=256)
def _style(fg: str | None, bg: str | None) -> Style:
    return Style(color=fg, bgcolor=bg)


def cell_colour(now: bool, value: float, tail: bool) -> str:
    if now:
        return NOW
    if value <= 0:
        return UNREAD_TAIL if tail else UNREAD_DOC
    level = min(len(SHADES) - 1, int(value * (len(SHADES) - 1) + 0.999))
    return SHADES[level]


class KvHeatmap(Widget, can_focus=True):
    """Regions × layers; see the module docstring."""

    BINDINGS = [
        Binding("left", "move(-1)", "Region ←", show=False),
        Binding("right", "move(1)", "Region →", show=False),
        Binding("shift+left", "move_bucket(-1)", show=False),
        Binding("shift+right", "move_bucket(1)", show=False),
        Binding("home", "move_to(0)", show=False),
        Binding("end", "move_to(-1)", show=False),
    ]

    DEFAULT_CSS = """
    KvHeatmap {
        height: auto;
        min-height: 2;
    }
    """

    selected: reactive[int | None] = reactive(None)

    class RegionSelected(Message):
        def __init__(self, heatmap: KvHeatmap, region: int) -> None:
            super().__init__()
            self.heatmap = heatmap
            self.region = region

        @property
        def control(self) -> KvHeatmap:
            return self.heatmap

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.reads: ReadMap | None = None
        self._grid: list[Strip] | None = None
        self._grid_size: Size | None = None

    # -- data ---------------------------------------------------------------------------------------

    def set_reads(self, reads: ReadMap | None) -> None:
        """Show `reads` (a snapshot the widget may keep); None clears the map."""
        resized = (self.reads is None) != (reads is None) or (
            reads is not None and self.reads is not None and reads.n_layer != self.reads.n_layer
        )
        self.reads = reads
        self._grid = None
        if reads is not None and self.selected is not None and self.selected >= max(reads.extent, 1):
            self.selected = reads.extent - 1
        self.refresh(layout=resized)

    @property
    def extent(self) -> int:
        return self.reads.extent if self.reads is not None else 0

    def select(self, region: int) -> None:
        if self.extent:
            self.selected = max(0, min(self.extent - 1, region))

    def watch_selected(self, region: int | None) -> None:
        self._grid = None
        self.refresh()
        if region is not None:
            self.post_message(self.RegionSelected(self, region))

    # -- keys and mouse -----------------------------------------------------------------------------

    def action_move(self, delta: int) -> None:
        if self.selected is None:
            self.select(0 if delta > 0 else self.extent - 1)
        else:
            self.select(self.selected + delta)

    def action_move_bucket(self, delta: int) -> None:
        width = max(1, self.content_size.width)
        step = max(1, -(-self.extent // width))
        self.action_move(delta * max(step, 8))

    def action_move_to(self, region: int) -> None:
        self.select(region if region >= 0 else self.extent - 1)

    def on_click(self, event: Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or not self.extent:
            return
        starts = bucket_starts(self.extent, self.content_size.width)
        if 0 <= offset.x < len(starts):
            ends = bucket_ends(starts, self.extent)
            col = offset.x
            # a click on a column that holds several regions selects the most-read of them
            lo, hi = int(starts[col]), int(ends[col])
            region = lo
            if self.reads is not None and hi - lo > 1:
                region = lo + int(np.argmax(self.reads.acc[:, lo:hi].sum(axis=0)))
            self.select(region)
            self.focus()

    # -- layout and rendering -----------------------------------------------------------------------

    def _rows_per_line(self, grid_lines: int) -> int:
        n_layer = self.reads.n_layer if self.reads is not None else 1
        return 1 if n_layer <= grid_lines else 2

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        n_layer = self.reads.n_layer if self.reads is not None else 2
        lines = n_layer if n_layer <= 4 else -(-n_layer // 2)
        return lines + 1  # and the axis line

    def render_line(self, y: int) -> Strip:
        size = self.content_size
        if self._grid is None or self._grid_size != size:
            self._grid = self._render_grid(size)
            self._grid_size = size
        return self._grid[y] if 0 <= y < len(self._grid) else Strip.blank(size.width)

    def _render_grid(self, size: Size) -> list[Strip]:
        width, height = size.width, size.height
        if width <= 0 or height <= 0:
            return []
        grid_lines = max(1, height - 1)
        reads = self.reads
        if reads is None or reads.extent <= 0:
            blank = Strip([Segment(" " * width)])
            message = "no document loaded" if reads is None else ""
            first = Strip([Segment(message.center(width)[:width], Style(color=AXIS, dim=True))])
            return [first] + [blank] * (height - 1)

        extent = reads.extent
        starts_x = bucket_starts(extent, width)
        steps = max(reads.steps, 1)
        acc = reads.acc[:, :extent]
        now = reads.now[:, :extent].astype(np.uint8)

        per_line = self._rows_per_line(grid_lines)
        n_rows = min(reads.n_layer, grid_lines * per_line)
        starts_y = bucket_starts(reads.n_layer, n_rows)

        acc_b = np.maximum.reduceat(np.maximum.reduceat(acc, starts_y, axis=0), starts_x, axis=1) / steps
        now_b = np.maximum.reduceat(np.maximum.reduceat(now, starts_y, axis=0), starts_x, axis=1) > 0
        tail = starts_x >= reads.doc_regions

        colours = [
            [cell_colour(bool(now_b[r, c]), float(acc_b[r, c]), bool(tail[c])) for c in range(width)]
            for r in range(n_rows)
        ]
        lines: list[Strip] = []
        if per_line == 1:
            for row in colours:
                lines.append(Strip(_merge([(" ", _style(None, bg)) for bg in row])))
        else:
            for r in range(0, n_rows, 2):
                top = colours[r]
                bottom = colours[r + 1] if r + 1 < n_rows else None
                segs = [("▀", _style(top[c], bottom[c] if bottom else None)) for c in range(width)]
                lines.append(Strip(_merge(segs)))
        while len(lines) < grid_lines:
            lines.append(Strip.blank(width))
        lines.append(self._axis(starts_x, extent, width))
        return lines[:height]

    def _axis(self, starts_x: np.ndarray, extent: int, width: int) -> Strip:
        chars = ["─"] * width
        for c in range(0, width, 10):
            chars[c] = "┴" if c else "└"
        segs = [(ch, _style(AXIS, None)) for ch in chars]
        if self.selected is not None:
            ends = bucket_ends(starts_x, extent)
            cols = np.flatnonzero((starts_x <= self.selected) & (ends > self.selected))
            cursor = Style(color=CURSOR, bold=True)
            for c in cols:
                segs[int(c)] = ("▲", cursor)
        return Strip(_merge(segs))


def _merge(cells: list[tuple[str, Style]]) -> list[Segment]:
    """Join runs of equally styled cells into one segment each."""
    segments: list[Segment] = []
    run: list[str] = []
    style: Style | None = None
    for text, cell_style in cells:
        if cell_style is not style and run:
            segments.append(Segment("".join(run), style))
            run = []
        style = cell_style
        run.append(text)
    if run:
        segments.append(Segment("".join(run), style))
    return segments
