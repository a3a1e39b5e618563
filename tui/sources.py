"""After an answer: the most-read document regions with a snippet of their text."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.widgets import OptionList
from textual.widgets.option_list import Option


@dataclass(frozen=True)
class Source:
    region: int
    reads: int  # summed over layers and steps
    share: float  # reads / (layers × steps)
    fixed: bool  # read by every step in every layer (sink/window/dense), not chosen by routing
    snippet: str


class SourcesList(OptionList):
    """Highlighting an entry shows its region (the app listens for OptionHighlighted)."""

    DEFAULT_CSS = """
    SourcesList {
        height: 1fr;
        border: none;
        padding: 0;
        background: transparent;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.sources: list[Source] = []

    def set_sources(self, sources: list[Source], empty: str = "") -> None:
        self.sources = list(sources)
        self.clear_options()
        if not sources:
            if empty:
                self.add_option(Option(Text(empty, style="dim"), disabled=True))
            return
        for source in sources:
            label = Text(no_wrap=True, overflow="ellipsis")
            label.append(f"r{source.region:<4}", style="bold")
            label.append(f"{source.share:4.0%} ", style="cyan" if not source.fixed else "dim")
            label.append(source.snippet)
            self.add_option(Option(label, id=f"region-{source.region}"))

    def source_at(self, index: int | None) -> Source | None:
        if index is None or not 0 <= index < len(self.sources):
            return None
        return self.sources[index]


def rank_sources(reads, *, n_sink_regions: int, limit: int = 12) -> list[tuple[int, int, float, bool]]:
    """(region, reads, share, fixed) for the document regions an answer read, most-read first.

    Sink regions are left out; regions every step read in every layer (the window, or everything in
    dense mode) come after the ones routing chose.
    """
    if reads is None or reads.steps == 0:
        return []
    doc = min(reads.doc_regions, reads.acc.shape[1])
    acc = reads.acc[:, :doc]
    totals = acc.sum(axis=0)
    always = acc.min(axis=0) >= reads.steps
    denom = max(1, reads.n_layer * reads.steps)
    ranked = [
        (r, int(totals[r]), float(totals[r]) / denom, bool(always[r]))
        for r in range(n_sink_regions, doc)
        if totals[r] > 0
    ]
    ranked.sort(key=lambda item: (item[3], -item[1], item[0]))
    return ranked[:limit]
