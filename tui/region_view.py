"""The text of one KV region (R context tokens) and how often the current answer read it."""

from __future__ import annotations

from rich.text import Text
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Static

EMPTY = "Select a region: focus the heatmap (tab) and use ← →, or click it."


class RegionView(Vertical):
    shown_region: int | None = None
    DEFAULT_CSS = """
    RegionView {
        height: 1fr;
    }
    RegionView > #region-title {
        height: auto;
        color: $text-muted;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    RegionView > VerticalScroll {
        height: 1fr;
    }
    """

    def compose(self):
        yield Static(Text(EMPTY), id="region-title")
        with VerticalScroll(id="region-scroll"):
            yield Static("", id="region-text")

    def show_empty(self, text: str = EMPTY) -> None:
        self.shown_region = None
        self.query_one("#region-title", Static).update(Text(text))
        self.query_one("#region-text", Static).update("")

    def show_region(
        self, region: int, region_size: int, text: str, *, reads: int, layers: int, n_layer: int, steps: int,
        where: str = "",
    ) -> None:
        start = region * region_size
        title = Text(no_wrap=True, overflow="ellipsis")
        title.append(f"region {region}", style="bold")
        title.append(f" · tokens {start:,}–{start + region_size - 1:,}")
        facts = [where] if where else []
        if steps:
            facts += [f"read {reads:,}×", f"{layers}/{n_layer} layers", f"{steps} steps"]
        if facts:
            title.append("\n" + " · ".join(facts))
        moved = region != self.shown_region
        self.shown_region = region
        self.query_one("#region-title", Static).update(title)
        self.query_one("#region-text", Static).update(Text(text or "(no text)"))
        if moved:
            self.query_one("#region-scroll", VerticalScroll).scroll_home(animate=False)
