"""Where the loaded prefix's documents sit in the KV cache, and what an answer read of each.

A session holds one `DocumentLayout`: its kind (one of LAYOUTS), a span per document (the cells of
its body, the position of its first token, where its pages start), and, for a set whose cells do not
follow positions, the prefix's tokens in cell order. `SetReads` attributes what each answer step read
to the documents (and their pages) by those spans.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvlocal.routing import ReadStats

LAYOUTS = ("single", "consecutive", "parallel")


@dataclass(frozen=True)
class DocumentSpan:
    """Where a document of the set sits in the assembled cache."""

    label: str
    start: int  # first cell of its body
    end: int  # one past its last cell, padding included
    n_tokens: int  # the body's own tokens (no padding)
    position: int  # the position of its first token
    # the cell where each page starts (page 1 first), for a document that has pages (a PDF); within a
    # few tokens (see page_starts); empty for the other kinds
    pages: tuple[int, ...] = ()

    def page_at(self, cell: int) -> int | None:
        """The page (1-based) of this document that holds `cell`; None without pages or outside the span.
        The padding after the body counts to the last page, as SetReads counts it."""
        if not self.pages or not self.start <= cell < self.end:
            return None
        return max(1, bisect.bisect_right(self.pages, cell))


@dataclass(frozen=True)
class DocumentLayout:
    """The loaded prefix's documents: `kind` ("" while nothing is loaded, else one of LAYOUTS), each
    document's span, and a set's prefix tokens in cell order (empty for one document, whose cells
    follow its positions)."""

    kind: str = ""
    spans: tuple[DocumentSpan, ...] = ()
    cell_tokens: tuple[int, ...] = ()

    @property
    def n_cells(self) -> int | None:
        """Cells the prefix holds where they do not follow positions (a set), else None."""
        return len(self.cell_tokens) if self.cell_tokens else None


def page_starts(text: str, pages: Sequence[int], tokens: Sequence[int], piece_lengths: dict[int, int]) -> tuple[int, ...]:
    """The index in `tokens` (`text.strip()` tokenized) of the token where each page starts (`pages`:
    each page's first character in `text`), from the tokens' byte lengths (`piece_lengths`, one per
    distinct token, from the vocabulary): the page's first byte lies in that token.

    Exact for a byte-level BPE vocabulary (Qwen's), whose pieces concatenate to the text; a token that
    reaches over a page break (the break's newlines merged with the next page's first word) is the next
    page's. Approximate by a few tokens where the pieces differ from the text (a leading-space
    vocabulary): enough to name the page a read lies in."""
    body = text.strip()
    lead = len(text) - len(text.lstrip())
    # each page's start as a byte offset in the body's UTF-8
    starts: list[int] = []
    char = byte = 0
    for offset in pages:
        at = min(max(offset - lead, char), len(body))
        byte += len(body[char:at].encode())
        char = at
        starts.append(byte)
    ends = np.cumsum(np.fromiter((piece_lengths[t] for t in tokens), np.int64, len(tokens)))
    # token i holds bytes [ends[i-1], ends[i]): the first token ending past the page's first byte
    found = np.searchsorted(ends, np.array(starts, np.int64), side="right")
    return tuple(int(min(i, len(tokens))) for i in found)


def span_at(spans: Sequence[DocumentSpan], cell: int) -> DocumentSpan | None:
    starts = [s.start for s in spans]
    i = bisect.bisect_right(starts, cell) - 1
    return spans[i] if i >= 0 and cell < spans[i].end else None


@dataclass
class SetReads:
    """KV rows (one cell of one KV head) that answer steps read, by where they sit: each document,
    the template head before the first one, and the rest (the middle, the question and the answer).
    The parts add up to `total`, which is the engine's own `rows_read` summed over the steps.

    A document with pages also has its rows by page (`pages[i][j]`: page j + 1 of document i), which add
    up to its count: the body's padding counts to the last page, as DocumentSpan.page_at says.

    `origin`: the prefix's first cell (a shelf's prefix starts further on); the head is its cells
    before the first document, and the cells before `origin` (other prefixes') count to the rest."""

    spans: Sequence[DocumentSpan]
    prefix_cells: int
    documents: list[int] = field(default_factory=list)
    pages: list[list[int]] = field(default_factory=list)
    head: int = 0
    rest: int = 0
    steps: int = 0
    routed_steps: int = 0
    origin: int = 0

    def __post_init__(self) -> None:
        self.documents = [0] * len(self.spans)
        self.pages = [[0] * len(span.pages) for span in self.spans]
        # each paged document's page boundaries: page j is cells [bounds[j], bounds[j + 1])
        self._bounds = [[span.start, *span.pages[1:], span.end] if span.pages else [] for span in self.spans]

    @property
    def total(self) -> int:
        return self.head + sum(self.documents) + self.rest

    def add(self, stats: ReadStats | None) -> None:
        """Count one step: the regions each routed layer and KV head gathered, and every cell of its
        view (`n_kv`) for the layers that attended densely."""
        if stats is None:
            return
        self.steps += 1
        n_dense = max(0, stats.n_layer - stats.n_layer_routed)
        if n_dense and stats.seen is not None:  # a shelf's answer: its prefix's cells and its own
            first, prefix_cells, own_cells = stats.seen
            self._add_cells(first, first + prefix_cells, n_dense * stats.n_head_kv)
            self.rest += n_dense * stats.n_head_kv * own_cells
        elif n_dense and stats.n_kv:
            self._add_cells(0, stats.n_kv, n_dense * stats.n_head_kv)
        if stats.n_layer_routed and stats.regions.size:
            self.routed_steps += 1
            R = stats.region_size
            regions, counts = np.unique(stats.regions.ravel(), return_counts=True)
            regions, counts = regions[regions >= 0], counts[regions >= 0]  # -1: a smaller layer budget's padding
            for region, count in zip(regions.tolist(), counts.tolist()):
                self._add_cells(region * R, (region + 1) * R, count)

    def _add_cells(self, lo: int, hi: int, times: int) -> None:
        """Count cells [lo, hi) read `times` times, split at the parts' boundaries."""
        spans = self.spans
        first = spans[0].start if spans else self.prefix_cells
        head = max(0, min(hi, first) - max(lo, self.origin))
        in_docs = 0
        for i, span in enumerate(spans):
            cells = max(0, min(hi, span.end) - max(lo, span.start))
            if not cells:
                continue
            self.documents[i] += times * cells
            in_docs += cells
            if span.pages:
                self._add_pages(i, max(lo, span.start), min(hi, span.end), times)
        self.head += times * head
        # the rest: the middle, the question and the answer, and the empty cells of a padded view
        self.rest += times * (hi - lo - head - in_docs)

    def _add_pages(self, i: int, lo: int, hi: int, times: int) -> None:
        """Count cells [lo, hi) of document i's span by page."""
        bounds, counts = self._bounds[i], self.pages[i]
        j = max(0, bisect.bisect_right(bounds, lo) - 1)
        while j < len(counts) and bounds[j] < hi:
            cells = max(0, min(hi, bounds[j + 1]) - max(lo, bounds[j]))
            counts[j] += times * cells
            j += 1

    def top_pages(self, i: int, limit: int = 3) -> list[int]:
        """The most-read pages (1-based, in page order) of document i: those read at least half as
        much as its most-read page, at most `limit`; [] for a document without pages or one page."""
        counts = self.pages[i]
        if len(counts) < 2 or not max(counts):
            return []
        ranked = sorted(range(len(counts)), key=lambda j: (-counts[j], j))
        most = counts[ranked[0]]
        return sorted(j + 1 for j in ranked[:limit] if 2 * counts[j] >= most)

    def shares(self) -> list[tuple[str, float]]:
        """(document, share of the reads that fell in documents), most-read first."""
        in_docs = sum(self.documents)
        if not in_docs:
            return []
        ranked = sorted(zip((s.label for s in self.spans), self.documents), key=lambda item: -item[1])
        return [(label, n / in_docs) for label, n in ranked if n]

    def describe(self, limit: int = 8, *, pages: int = 3, rest: bool = True, basename: bool = False) -> str:
        """One line: the documents the reads came from, most-read first, with the most-read pages of
        those that have pages (when routing chose what to read), then (`rest`) the shares of the
        template head and of the question and answer. `basename`: documents by file name, not path."""
        in_docs = sum(self.documents)
        if not self.steps or not in_docs:
            return "reads by document: none"
        ranked = sorted((i for i, n in enumerate(self.documents) if n), key=lambda i: -self.documents[i])
        parts = []
        for i in ranked[:limit]:
            label = self.spans[i].label
            part = f"{os.path.basename(label) or label if basename else label} {self.documents[i] / in_docs:.0%}"
            top = self.top_pages(i, pages) if self.routed_steps and pages else []
            if top:
                part += f" (most on {'p.' if len(top) == 1 else 'pp.'} {', '.join(map(str, top))})"
            parts.append(part)
        if len(ranked) > limit:
            parts.append(f"{len(ranked) - limit} more")
        note = "" if self.routed_steps else " (dense: every step read every document)"
        line = f"reads by document: {', '.join(parts)}{note}"
        if not rest:
            return line
        total = max(1, self.total)
        return (f"{line}; of all rows read, the template head {self.head / total:.0%}, the question and answer "
                f"{self.rest / total:.0%}")
