"""One question's answer: the pieces as they are decoded, then its totals.

`Session.ask` returns an `Answer`. Iterate it for `AnswerPiece`s (the text of each token and what
its step read); once it is exhausted, `Answer.summary()` holds the totals. `ReadTotals` is the one
accumulator of read statistics: the summary is one (it also counts the regions each layer read),
and the TUI's live counters keep another (its heatmap keeps the regions).
"""

from __future__ import annotations

import codecs
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvlocal.routing import CHOSEN_FALLBACKS, ReadStats, Route


@dataclass
class AnswerPiece:
    """One generated token: its text (possibly empty while UTF-8 is incomplete) and what it read."""

    text: str
    token: int
    stats: ReadStats | None


class _Vocabulary(Protocol):
    def is_end_of_generation(self, token: int) -> bool: ...
    def detokenize(self, tokens: list[int]) -> bytes: ...


class AnswerText:
    """An answer's text as its tokens are sampled: each token's UTF-8 piece, and where the answer ends
    before a token (the model's end of generation, or a completion prompt's stop string)."""

    def __init__(self, vocabulary: _Vocabulary, stops: tuple[str, ...] | list[str] = ()) -> None:
        self.vocabulary = vocabulary
        self.stops = stops
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.recent = ""

    def accept(self, token: int) -> str | None:
        """The text `token` adds (possibly empty while UTF-8 is incomplete), or None where the answer ends."""
        if self.vocabulary.is_end_of_generation(token):
            return None
        text = self.decoder.decode(self.vocabulary.detokenize([token]))
        if self.stops and any(stop in self.recent + text for stop in self.stops):
            return None  # a completion prompt's answer ends where the next paragraph or question begins
        self.recent = (self.recent + text)[-32:]
        return text

    def finish(self) -> str:
        """What the decoder still holds (an incomplete character, replaced)."""
        return self.decoder.decode(b"", final=True)


@dataclass(kw_only=True)
class ReadTotals:
    """Read statistics summed over steps (a batch read at once counts as one step)."""

    steps: int = 0
    rows_read: int = 0
    rows_dense: int = 0
    bytes_read: int = 0
    bytes_meta: int = 0
    bytes_dense: int = 0
    fallback: str = ""  # why the engine last fell back to dense attention, if it did unasked
    layers: int = 0  # the layers whose KV the steps count (a hybrid model's attention layers only)
    layers_routed: int = 0  # of them, the most that one step routed

    @property
    def reduction(self) -> float:
        return self.bytes_dense / self.bytes_read if self.bytes_read else 1.0

    def add(self, stats: ReadStats) -> None:
        self.steps += 1
        self.rows_read += stats.rows_read
        self.rows_dense += stats.rows_dense
        self.bytes_read += stats.bytes_read
        self.bytes_meta += stats.bytes_meta
        self.bytes_dense += stats.bytes_dense
        self.layers = max(self.layers, stats.n_layer)
        self.layers_routed = max(self.layers_routed, stats.n_layer_routed)
        if stats.fallback not in CHOSEN_FALLBACKS:
            self.fallback = stats.fallback_reason


@dataclass
class AnswerSummary(ReadTotals):
    """The totals of a finished (or cancelled) answer."""

    text: str
    n_question_tokens: int
    n_answer_tokens: int
    decode_seconds: float
    route: Route  # the route the answer took, resolved (kvlocal.routing.resolve_route)
    context_full: bool = False  # the answer stopped because the context had no room left
    question_bytes_read: int = 0  # of bytes_read, what the question's tokens read
    question_bytes_dense: int = 0  # of bytes_dense, what they would have read densely
    region_reads: dict[tuple[int, int], int] = field(default_factory=dict)  # (layer, region) -> steps that read it
    model_layers: int = 0  # the model's layers (more than `layers` in a hybrid model)
    placement: str = ""  # which machine held which layers, when some were on RPC servers
    wire_sent: int = 0  # bytes the answer's steps sent to the RPC servers (and received from them)
    wire_received: int = 0
    focus: str = ""  # the document a focused answer read (--focus hinted), its label; "": the whole set

    def add(self, stats: ReadStats) -> None:
        super().add(stats)
        for li, layer in enumerate(stats.layers):
            for region in np.unique(stats.regions[li]):
                if region < 0:  # the padding of a layer with a smaller budget
                    continue
                key = (int(layer), int(region))
                self.region_reads[key] = self.region_reads.get(key, 0) + 1

    @property
    def hint_cells(self) -> tuple[int, ...]:
        """The cells whose regions the question's words hinted (the resolved route's)."""
        return self.route.hint_cells

    @property
    def answer_reduction(self) -> float:
        """The KV bytes reduction of the answer's steps alone (the question's read left out)."""
        read = self.bytes_read - self.question_bytes_read
        return (self.bytes_dense - self.question_bytes_dense) / read if read else 1.0

    @property
    def decode_rate(self) -> float:
        return self.n_answer_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


class Answer(Iterator[AnswerPiece]):
    """An answer being decoded: iterate for its pieces, then read `summary()`.

    `summary()` and `text()` decode whatever is left first. `close()` abandons the answer (the
    session is left ready for the next question); its summary is then not available.
    """

    def __init__(self, pieces: Generator[AnswerPiece, None, AnswerSummary]) -> None:
        self._pieces = pieces
        self._summary: AnswerSummary | None = None

    def __next__(self) -> AnswerPiece:
        try:
            return next(self._pieces)
        except StopIteration as end:  # a closed or exhausted generator: its value, or None once closed
            self._summary = self._summary or end.value
            raise StopIteration from None

    def close(self) -> None:
        self._pieces.close()

    def summary(self) -> AnswerSummary:
        for _ in self:
            pass
        if self._summary is None:
            raise RuntimeError("the answer was abandoned (closed) before it finished")
        return self._summary

    def text(self) -> str:
        return self.summary().text
