"""Several answers about the loaded documents, decoded together.

An `AnswerBatch` holds up to `Session.answers` answers at once. Each answer is its own sequence of
the context: the document's cells (sequence 0) are shared with it, its question is read into it,
and every `step()` decodes one token of every open answer in one llama_decode, the engine routing
each sequence over the cells it sees (patch 0017): the documents' and its own question and answer,
never another answer's. Answers join between steps and leave when they end (their cells dropped).

Each answer's steps route as `Session.ask` routes them alone (patches 0012, 0017): its own selection memory,
the pins of its own question and its own hints, whichever answers decode beside it. Each answer also
keeps to its own cells (patch 0018): a run of whole regions after the documents', so that no region
mixes answers, and an answer reads the regions, and gets the text, it gets decoded in a batch of its own.

On a session holding a shelf (Session.open_shelf: several documents side by side, each in its own
sequence and cells), each answer names the shelf's prefix it is about: its sequence shares that
prefix's cells only, so answers about different documents decode in one batch and each reads its own
document alone. The engine takes one route for a batch; an answer whose route sets the engine
otherwise than the open answers' (other than its hinted cells, which are its own, as its pins and
selection memory are) waits (`can_take`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, fields

import numpy as np

from kvlocal.answer import AnswerPiece, AnswerSummary, AnswerText
from kvlocal.engine import SequenceStep
from kvlocal.errors import ContextOverflowError, UsageError
from kvlocal.routing import ReadStats, Route, RouteConfig
from kvlocal.session import Prefix, Session, _sample, check_ask_settings


@dataclass
class _Open:
    """One answer being decoded: its sequence, where it goes on, and what it has so far."""

    seq: int
    prefix: Prefix  # what it is about
    route: Route
    pos: int
    cells: tuple[int, int]  # the cells kept for it, [start, end): its question and its most answer tokens
    max_tokens: int
    temperature: float
    rng: np.random.Generator
    cancel: threading.Event | None
    summary: AnswerSummary
    logits: np.ndarray
    want_regions: bool
    started: float
    text: AnswerText
    pieces: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Step:
    """What one step gave an answer: a piece (None when it ended before decoding one), and its
    summary once it has ended (its sequence is free again)."""

    answer: int  # the handle `add` returned
    piece: AnswerPiece | None
    summary: AnswerSummary | None = None


class AnswerBatch:
    """Answers decoded together over the session's loaded documents (see the module's docstring)."""

    def __init__(self, session: Session, route: RouteConfig | Route | None = None) -> None:
        if session.context is None or (session.n_prefix == 0 and not session.shelf):
            raise UsageError("no document is loaded")
        if session.answers < 2:
            raise UsageError("the session decodes one answer at a time (Session(answers=N) for more)")
        if session.state_rewinds:
            raise UsageError("a model with recurrent layers keeps one state per sequence: it answers one question at a time")
        self.session = session
        self.context = session.context
        self.asked = route
        self.open: dict[int, _Open] = {}
        self._free = list(reversed(session.answer_seqs))  # sequence ids after the documents'
        session.rewind()  # the documents' sequence holds them only, shared as they are with each answer

    def _cells_for(self, n_cells: int, region: int) -> tuple[int, int] | None:
        """The first run of whole regions of `region` cells after the documents' that holds `n_cells`
        and no open answer's cells; None when the context has none."""
        size = -(-n_cells // region) * region
        start = -(-self.session.resident_cells // region) * region
        for lo, hi in sorted(a.cells for a in self.open.values()):
            if start + size <= lo:
                break
            start = max(start, -(-hi // region) * region)
        return (start, start + size) if start + size <= self.context.n_ctx else None

    def can_take(self, question_tokens: int, max_tokens: int, route: Route | None = None) -> bool:
        """Whether an answer of a question of `question_tokens` and `max_tokens` fits now (a free
        sequence and cells), and its `route` (resolve_route's, where known) sets the engine as the open
        answers' does."""
        region = self.session.route_for(self.asked).region
        if route is not None and not self.takes_route(route):
            return False
        return bool(self._free) and self._cells_for(question_tokens + max_tokens, region) is not None

    def takes_route(self, route: Route) -> bool:
        """Whether an answer taking `route` decodes beside the open answers as it would alone: the
        engine's settings (top-k and the pin count included) are one for a batch, but for each answer's
        hinted cells."""
        return all(_shared(a.route) == _shared(route) for a in self.open.values())

    def route_of(self, question: str, prefix: Prefix | None = None) -> Route:
        """The route an answer to `question` about `prefix` (None: the session's) takes."""
        return self.session.resolve_answer_route(question, self.asked, prefix=prefix)

    def question_tokens(self, question: str) -> list[int]:
        session = self.session
        return session.tokenize_prompt(session.parts.question_segments(question), bos=False)

    def add(self, question: str, *, max_tokens: int = 256, temperature: float = 0.0, seed: int = 0,
            want_regions: bool = False, cancel: threading.Event | None = None, prefix: Prefix | None = None) -> int:
        """Read `question` into a free sequence (one batch, as the route's `question` says) and open its
        answer about `prefix` (a shelf's; None: the session's prefix); the handle it returns names the
        answer in `step()`'s results. ContextOverflowError when no sequence or too few cells are free
        (an answer ending frees them); UsageError for a route the open answers' cannot decode beside."""
        session, context = self.session, self.context
        check_ask_settings(question, max_tokens, temperature, seed)
        if prefix is None:
            if session.shelf:
                raise UsageError("the session holds a shelf: an answer names the document it is about")
            prefix = session.prefix
        elif session.shelf.get(prefix.seq) is not prefix:
            raise UsageError("that document is not on the session's shelf")
        q_tokens = self.question_tokens(question)
        route = self.route_of(question, prefix)
        if not self.takes_route(route):
            raise UsageError("the answer's route sets the engine otherwise than the open answers' (takes_route)")
        cells = self._cells_for(len(q_tokens) + max_tokens, route.region) if self._free else None
        if cells is None:
            raise ContextOverflowError(f"no room for another answer: {len(self.open)} open in {context.n_ctx:,} cells")
        seq = self._free.pop()
        summary = AnswerSummary("", len(q_tokens), 0, 0.0, route, model_layers=session.n_layer,
                                placement=session.layer_placement())
        try:
            context.keep_cells(seq, *cells)
            context.set_hints(route.hint_cells, seq=seq)
            context.copy_sequence(prefix.seq, seq)
            logits = self._read_question(seq, prefix, q_tokens, route, summary, want_regions)
        except BaseException:
            # the sequence and its cells are free again (Ctrl-C or an engine error while reading)
            context.remove_positions(seq)
            context.keep_cells(seq)
            self._free.append(seq)
            raise
        summary.question_bytes_read, summary.question_bytes_dense = summary.bytes_read, summary.bytes_dense
        self.open[seq] = _Open(seq, prefix, route, prefix.n_prefix + len(q_tokens), cells, max_tokens,
                               temperature, np.random.default_rng(seed), cancel, summary, logits, want_regions,
                               time.perf_counter(), AnswerText(context, session.parts.stops))
        return seq

    def _read_question(self, seq: int, prefix: Prefix, q_tokens: list[int], route: Route, summary: AnswerSummary,
                       want_regions: bool) -> np.ndarray:
        context, pos = self.context, prefix.n_prefix
        if route.question == "steps":
            context.apply_route(route)
            for i, token in enumerate(q_tokens):
                logits = context.decode_sequence(seq, [token], pos + i)
                self._count(summary, context.read_stats(with_regions=want_regions), seq, prefix, i + 1)
            return logits
        context.apply_route(route, batch_top_k=route.question_batch_top_k)
        try:
            logits = context.decode_sequence(seq, q_tokens, pos)
            self._count(summary, context.read_stats(with_regions=want_regions), seq, prefix, len(q_tokens))
        finally:
            context.apply_route(route)
        return logits

    def _count(self, summary: AnswerSummary, stats: ReadStats | None, seq: int, prefix: Prefix,
               own_cells: int) -> ReadStats | None:
        """Add sequence `seq`'s share of `stats` to `summary`; on a shelf, as counted over the cells it
        sees (its prefix's and its `own_cells`: ReadStats.seen_by)."""
        own = stats.sequences.get(seq, stats) if stats is not None and stats.sequences else stats
        if own is not None and self.session.shelf:
            own = own.seen_by(prefix.first_cell, prefix.cells, own_cells)
        if own is not None:
            summary.add(own)
        return own

    def resume(self) -> None:
        """Set the engine's route to the open answers' again, after other work used the context between
        two steps (a shelf document's prefill ubatch: Session.load_document's `between`)."""
        if self.open:
            self.context.apply_route(next(iter(self.open.values())).route)

    def step(self) -> list[Step]:
        """One token of every open answer, decoded in one batch. An answer that ends (its end token,
        a stop, its most tokens, or its `cancel` set) comes back with its summary and leaves the batch."""
        results: list[Step] = []
        steps: list[tuple[_Open, int, str]] = []
        for answer in list(self.open.values()):
            token, text = self._next_token(answer)
            if token is None:
                summary, tail = self._finish(answer)
                results.append(Step(answer.seq, AnswerPiece(tail, -1, None) if tail else None, summary))
            else:
                steps.append((answer, token, text))
        if not steps:
            return results
        logits = self.context.decode_steps([SequenceStep(a.seq, token, a.pos) for a, token, _ in steps])
        stats = self.context.read_stats(with_regions=any(a.want_regions for a, _, _ in steps))
        for (answer, token, text), answer_logits in zip(steps, logits):
            own = self._count(answer.summary, stats, answer.seq, answer.prefix, answer.pos + 1 - answer.prefix.n_prefix)
            answer.logits, answer.pos = answer_logits, answer.pos + 1
            answer.summary.n_answer_tokens += 1
            answer.pieces.append(text)
            results.append(Step(answer.seq, AnswerPiece(text, token, own)))
        return results

    def _next_token(self, answer: _Open) -> tuple[int | None, str]:
        """The answer's next token and its text, or (None, '') where the answer ends before it."""
        if answer.summary.n_answer_tokens >= answer.max_tokens or (answer.cancel is not None and answer.cancel.is_set()):
            return None, ""
        token = _sample(answer.logits, answer.temperature, answer.rng)
        text = answer.text.accept(token)
        return (None, "") if text is None else (token, text)

    def _finish(self, answer: _Open) -> tuple[AnswerSummary, str]:
        """The ended answer's summary and the text its decoder still held; its sequence freed."""
        tail = answer.text.finish()
        summary = answer.summary
        summary.text = "".join(answer.pieces) + tail
        summary.decode_seconds = time.perf_counter() - answer.started
        del self.open[answer.seq]
        self.context.remove_positions(answer.seq)
        self.context.keep_cells(answer.seq)
        self._free.append(answer.seq)
        return summary, tail

    def close(self) -> None:
        """End every open answer (their cells dropped; the documents' stay)."""
        for answer in list(self.open.values()):
            self._finish(answer)



# not one per batch: the hinted cells are set per sequence (set_hints), and the focus is not the engine's (a
# batch's answers are each about one document of a shelf); the rest is (apply_route)
_NOT_SHARED = frozenset({"hint_cells", "focus"})


def _shared(route: Route) -> tuple:
    """What of `route` the engine takes for a whole batch: all but an answer's own hinted cells (and its focus)."""
    return tuple(getattr(route, f.name) for f in fields(route) if f.name not in _NOT_SHARED)
