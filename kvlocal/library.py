"""The library: a set of documents as one KV cache, each document prefilled once on its own.

`Library` is a Session that also loads a set (docs/library.md). Every document's body is prefilled
alone after the shared template head, padded with newlines to a whole number of LAYOUT_UNIT cells,
and its cells alone are saved, keyed by its text as a single document's state is (with the layout
tag LAYOUT_TAG and no context size): adding a document to a set costs its own prefill, and neither
the order of a set nor which set it is forces one. A set is assembled without recomputing anything:
the head is decoded into the question's sequence (0); each body's state is loaded into a staging
sequence (1), moved to its place with the engine's position shift, shared with sequence 0 and the
staging sequence dropped, so the cells lie in load order with no hole and every body starts on a
region boundary. Decoding the prompt's middle then applies the pending K-shifts (and rebuilds the
region centroids): the set is ready.

Positions (LAYOUTS): *consecutive* (each body after the one before, as one long document) while the
set fits the model's trained context; *parallel* beyond it: every body keeps the positions it was
prefilled at, right after the head, and the question follows the longest.

A set of one document is the single-document path (`Session.load_document`): today's tokens,
logits and saved state. `SetReads` attributes what each answer step read to the documents.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvlocal import kvstate
from kvlocal.errors import CancelledError, ContextOverflowError, EngineError, ModelError, UsageError
from kvlocal.ingest import Document
from kvlocal.prompt import Segment, build_prompt
from kvlocal.routing import PrefillConfig, ReadStats
from kvlocal.session import ANSWER_RESERVE, CTX_ROUND, LoadResult, PrefillProgress, Session

LAYOUT_UNIT = 64  # cells a body is padded to: every body starts on a boundary of regions of up to 64
LAYOUT_TAG = f"library-u{LAYOUT_UNIT}"  # a body state's prefill tag (the key's layout)
LAYOUTS = ("single", "consecutive", "parallel")
QUESTION_SEQ, STAGING_SEQ = 0, 1
PAD_TEXT = "\n"  # the filler a head or body is padded with (one token)


@dataclass(frozen=True)
class DocumentSpan:
    """Where a document of the set sits in the assembled cache."""

    label: str
    start: int  # first cell of its body
    end: int  # one past its last cell, padding included
    n_tokens: int  # the body's own tokens (no padding)
    position: int  # the position of its first token
    # the cell where each page starts (page 1 first), for a document that has pages (a PDF); within a
    # few tokens (see Library._page_tokens); empty for the other kinds
    pages: tuple[int, ...] = ()

    def page_at(self, cell: int) -> int | None:
        """The page (1-based) of this document that holds `cell`; None without pages or outside the span.
        The padding after the body counts to the last page, as SetReads counts it."""
        if not self.pages or not self.start <= cell < self.end:
            return None
        return max(1, bisect.bisect_right(self.pages, cell))


@dataclass(frozen=True)
class BodyLoad:
    """How one document of the set was readied: its saved state loaded, or prefilled (and saved)."""

    label: str
    n_tokens: int
    cache_hit: bool
    seconds: float
    saved: bool = False
    rebuilt_reason: str | None = None

    @property
    def rate(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class SetLoad:
    """A loaded set: each document, the layout, and the time to ready the set from cached bodies."""

    documents: tuple[BodyLoad, ...]
    spans: tuple[DocumentSpan, ...]
    layout: str  # one of LAYOUTS
    n_cells: int  # cells of the prompt prefix (head, bodies, middle)
    n_positions: int  # positions it spans (fewer than cells in the parallel layout)
    n_ctx: int
    seconds: float  # everything: prefills of the missing bodies, loads and assembly
    ready_seconds: float  # state loads, shifts and the first decode (centroids rebuilt), no prefill
    single: LoadResult | None = None  # a set of one: the single-document path's own result

    @property
    def n_tokens(self) -> int:
        return sum(doc.n_tokens for doc in self.documents)

    @property
    def cache_hits(self) -> int:
        return sum(doc.cache_hit for doc in self.documents)


class Library(Session):
    """A Session that can also hold a set of documents (`load_set`); see the module docstring."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.spans: tuple[DocumentSpan, ...] = ()
        self.layout = ""
        self._cell_tokens: list[int] = []  # the prefix's tokens in cell order (for region text)

    @property
    def n_documents(self) -> int:
        return max(1, len(self.spans))

    def load_document(self, *args, **kwargs) -> LoadResult:
        """Session.load_document; the set held before (its spans and cell tokens) is gone with it."""
        self.spans, self.layout, self._cell_tokens = (), "", []
        return super().load_document(*args, **kwargs)

    # -- checks ---------------------------------------------------------------------------------

    def check_composable(self) -> None:
        """ModelError unless this model's memory can be composed from per-document states: recurrent
        and hybrid models keep a state that is not per cell, and an iSWA model's sliding layers would
        see only the last document."""
        vocab = self.vocab
        name = self.model.path.name
        if vocab.recurrent or vocab.hybrid:
            what = "recurrent" if vocab.recurrent else "hybrid (recurrent and attention)"
            raise ModelError(f"{name} keeps {what} memory: documents cached one by one cannot be joined into "
                             "one cache; ask one document at a time")
        # the vocabulary-only model has no hyperparameters loaded: the window is read from the header
        meta = vocab.metadata
        window = meta.get(f"{meta.get('general.architecture', '')}.attention.sliding_window", "0")
        if vocab.n_swa > 0 or _positive(window):
            raise ModelError(f"{name} has sliding-window layers: documents cached one by one cannot be joined "
                             "into one cache (those layers would see only the last one); ask one document at a time")

    # -- loading a set --------------------------------------------------------------------------

    def check_set_fits(self, documents: Sequence[Document], max_kv: int | None) -> None:
        """ContextOverflowError, in one line, when a set of several documents is estimated (from its
        characters and the model's header, before anything is loaded) to need more KV cache than
        `max_kv`; one document is bounded by the model's trained context, as before."""
        from kvlocal.docset import check_kv_limit, estimate_kv

        if len(documents) > 1:
            check_kv_limit(estimate_kv(list(documents), self.model.info, self.kv_type, centroid_block=self.centroid_block,
                                       centroid_type=self.centroid_type_for(len(documents))), max_kv)


    def load_set(
        self,
        documents: Sequence[Document],
        *,
        progress: Callable[[PrefillProgress], None] | None = None,
        log: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        use_cache: bool = True,
        prefill: PrefillConfig | None = None,
        layout: str | None = None,
    ) -> SetLoad:
        """Load `documents` as one cache. One document takes the single-document path. `layout`
        forces consecutive or parallel positions (None: consecutive while the set fits the trained
        context); given with one document, that document's cached body is assembled as a set's is
        (what `kvlocal eval --library` asks a fact of its document alone with). `log` gets a line as
        each document is prefilled or loaded."""
        if not documents:
            raise UsageError("no documents to load")
        if len(documents) == 1 and layout is None:
            return self._load_single(documents[0], progress=progress, cancel=cancel, use_cache=use_cache,
                                     prefill=prefill)
        if layout not in (None, "consecutive", "parallel"):
            raise UsageError(f"the layout must be consecutive or parallel (got {layout!r})")
        if prefill is not None and prefill.routed:
            raise UsageError("a routed prefill is for one document; a set's documents are prefilled densely",
                             setting="prefill")
        self.check_composable()
        start = time.perf_counter()
        # the previous document or set is gone from here on, whatever happens
        self.context = None
        self.n_prefix, self.n_prefix_cells, self.spans, self.layout, self._cell_tokens = 0, None, (), "", []
        self.parts = build_prompt("", self.chat_template, model_name=self.model.path.name)
        planned = self.set_cells(documents, pages=True)
        layout, n_ctx = self._set_layout(documents, planned, layout)
        # 1. every body's saved state, or its prefill (saved as it finishes: a later failure keeps it)
        keys = [self.state_key(doc.text.strip(), 0, LAYOUT_TAG, dense=True) for doc in documents]
        states, loads = self._body_states(documents, planned, keys, use_cache, progress, log, cancel)
        if cancel is not None and cancel.is_set():
            raise CancelledError("cancelled: the set was not loaded")
        # 2. the set's context: head, then each body staged into place, then the middle
        ready_start = time.perf_counter()
        spans, position = self._assemble(documents, planned, keys, states, layout, n_ctx)
        end = time.perf_counter()
        n_cells = len(planned.tokens)
        self.n_prefix = position + len(planned.middle)
        self.n_prefix_cells = n_cells
        self._prefix_state = None  # a set's models remove cells (check_composable)
        self._text_index = None
        self.spans = tuple(spans)
        self.layout = layout
        self.doc_label = f"{len(documents)} documents"
        self._cell_tokens = planned.tokens
        return SetLoad(tuple(loads), self.spans, layout, n_cells, self.n_prefix, n_ctx, end - start,
                       end - ready_start + sum(d.seconds for d in loads if d.cache_hit))

    def _load_single(self, doc: Document, **load) -> SetLoad:
        """A set of one document: the single-document path (Session.load_document), with its span."""
        result = self.load_document(doc.text, label=doc.source, **load)
        head = len(self.tokenize_prompt([Segment(self.parts.head, True)], bos=True))
        tokens = self.tokenize(self.parts.document, bos=False)  # the text stripped, as a set's body is
        body = len(tokens)
        pages = tuple(head + i for i in self._page_tokens(doc, tokens))
        self.spans = (DocumentSpan(doc.source, head, head + body, body, head, pages),)
        self.layout = "single"
        self._cell_tokens = []
        loaded = BodyLoad(doc.source, result.n_tokens, result.cache_hit, result.seconds, result.saved,
                          result.rebuilt_reason)
        return SetLoad((loaded,), self.spans, "single", result.n_tokens, result.n_tokens, result.n_ctx,
                       result.seconds, result.seconds if result.cache_hit else 0.0, single=result)

    def _set_layout(self, documents: Sequence[Document], planned: SetCells, layout: str | None) -> tuple[str, int]:
        """The set's layout (`layout`, or consecutive while the set fits the trained context) and its
        context size; ContextOverflowError where a document, or the set, does not fit."""
        head, bodies, n_body = planned.head, planned.bodies, planned.n_body
        longest = max(len(b) for b in bodies)
        if len(head) + longest + ANSWER_RESERVE > self.trained_ctx:
            i = max(range(len(bodies)), key=lambda j: len(bodies[j]))
            raise ContextOverflowError(
                f"{documents[i].source} is {n_body[i]:,} tokens; with the prompt and room for a question and "
                f"answer it needs {len(head) + longest + ANSWER_RESERVE:,}, over the model's trained context "
                f"{self.trained_ctx:,}")
        n_cells = len(head) + sum(len(b) for b in bodies) + len(planned.middle)
        if layout is None:
            layout = "consecutive" if n_cells + ANSWER_RESERVE <= self.trained_ctx else "parallel"
        if layout == "consecutive" and n_cells + ANSWER_RESERVE > self.trained_ctx:
            raise ContextOverflowError(
                f"the set's {n_cells:,} tokens at consecutive positions need {n_cells + ANSWER_RESERVE:,} with room "
                f"for a question and answer, over the model's trained context {self.trained_ctx:,}")
        n_ctx = -(-(n_cells + ANSWER_RESERVE) // CTX_ROUND) * CTX_ROUND
        if self.requested_ctx is not None:
            if self.requested_ctx < n_cells + ANSWER_RESERVE:
                raise ContextOverflowError(
                    f"the set is {n_cells:,} tokens and needs {n_cells + ANSWER_RESERVE:,} with room for a question "
                    f"and answer, but the context holds {self.requested_ctx:,}", setting="ctx")
            n_ctx = max(n_ctx, self.requested_ctx)
        return layout, n_ctx

    def _body_states(self, documents: Sequence[Document], planned: SetCells, keys: list[kvstate.StateKey],
                     use_cache: bool, progress, log, cancel) -> tuple[list[bytes | None], list[BodyLoad]]:
        """Every body's state, its saved one or prefilled now (and saved as it finishes), and how each
        was readied."""
        bodies, n_body = planned.bodies, planned.n_body
        states: list[bytes | None] = [None] * len(documents)
        loads: list[BodyLoad] = []
        for i, doc in enumerate(documents):
            t0 = time.perf_counter()
            state, reason = (self._saved_body(keys[i], bodies[i]) if use_cache else (None, None))
            if state is not None:
                states[i] = state  # loaded into the engine by _assemble
                loads.append(BodyLoad(doc.source, n_body[i], True, time.perf_counter() - t0))
                continue
            if log:
                log(f"document {i + 1}/{len(documents)} {doc.source}: prefilling {n_body[i]:,} tokens")
            state = self._prefill_body(planned.head, bodies[i], progress, cancel)
            saved, note = False, None
            if use_cache:
                try:
                    kvstate.save_state(keys[i], np.array(bodies[i], np.int32), state, label=doc.source)
                    saved = True
                except OSError as err:
                    note = f"could not save the KV state ({err.strerror or err}: {err.filename or ''}); continuing without it"
            states[i] = state
            reason = f"{reason}; {note}" if reason and note else (reason or note)
            loads.append(BodyLoad(doc.source, n_body[i], False, time.perf_counter() - t0, saved, reason))
        return states, loads

    def _assemble(self, documents: Sequence[Document], planned: SetCells, keys: list[kvstate.StateKey],
                  states: list[bytes | None], layout: str, n_ctx: int) -> tuple[list[DocumentSpan], int]:
        """A new context of two sequences holding the set: the head decoded into the question's sequence,
        each body's state staged and moved into place, the middle decoded after them. The spans, and the
        position the middle was decoded at. `states` are let go of as they are staged."""
        head, bodies = planned.head, planned.bodies
        self.context = None
        self.centroid_type = self.centroid_type_for(len(documents))
        self.context = context = self._open_context(n_ctx=n_ctx, n_seq_max=2)
        spans: list[DocumentSpan] = []
        try:
            context.decode(head)
            cell = position = len(head)
            for i, doc in enumerate(documents):
                state = states[i]
                states[i] = None  # what is staged need not stay in memory twice
                if not context.load_state(state, STAGING_SEQ):
                    kvstate.discard(keys[i])
                    raise EngineError(f"the saved state of {doc.source} did not load into the engine (it was "
                                      "discarded; asking again prefills it)")
                shift = position - len(head)
                if shift:
                    context.shift_sequence(STAGING_SEQ, shift)
                context.copy_sequence(STAGING_SEQ, QUESTION_SEQ)
                context.remove_positions(STAGING_SEQ)
                spans.append(DocumentSpan(doc.source, cell, cell + len(bodies[i]), planned.n_body[i], position,
                                          tuple(cell + t for t in planned.page_tokens[i])))
                cell += len(bodies[i])
                if layout == "consecutive":
                    position += len(bodies[i])
            if layout == "parallel":
                position = len(head) + max(len(b) for b in bodies)
            context.continue_at(position)  # the next position (not the cells, in the parallel layout)
            context.decode(planned.middle)  # applies every pending K-shift and rebuilds the centroids
        except KeyboardInterrupt:
            self.context = None
            raise CancelledError("interrupted: the set was not loaded") from None
        except RuntimeError as err:
            self.context = None
            raise EngineError(f"assembling the set failed: {err}") from None
        except BaseException:
            self.context = None
            raise
        return spans, position

    def set_cells(self, documents: Sequence[Document], *, pages: bool = False) -> SetCells:
        """The tokens a set's cache holds, in cell order, without loading anything: the padded
        template head, each body padded to LAYOUT_UNIT cells, the prompt's middle (and, with `pages`,
        where each document's pages start among its body's tokens)."""
        parts = build_prompt("", self.chat_template, model_name=self.model.path.name)
        head = self._padded(self.tokenize_prompt([Segment(parts.head, True)], bos=True))
        middle = self.tokenize_prompt([Segment(parts.middle, True)], bos=False)
        bodies, n_body, page_tokens = [], [], []
        for doc in documents:
            tokens = self.tokenize(doc.text.strip(), bos=False)
            n_body.append(len(tokens))
            page_tokens.append(self._page_tokens(doc, tokens) if pages else ())
            bodies.append(self._padded(tokens))
        return SetCells(head, bodies, middle, n_body, page_tokens)

    def _page_tokens(self, doc: Document, tokens: list[int]) -> tuple[int, ...]:
        """The index in `tokens` (`doc.text.strip()` tokenized) of the token where each of the
        document's pages starts; () for a document without pages.

        Found from the tokens' byte lengths (one piece per distinct token, from the vocabulary): the
        page's first byte lies in that token. Exact for a byte-level BPE vocabulary (Qwen's), whose
        pieces concatenate to the text; a token that reaches over a page break (the break's newlines
        merged with the next page's first word) is the next page's. Approximate by a few tokens where the
        pieces differ from the text (a leading-space vocabulary): enough to name the page a read lies in."""
        pages = getattr(doc, "pages", ())
        if not pages or not tokens:
            return ()
        text = doc.text
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
        sizes = self.vocab.piece_lengths(tokens)
        ends = np.cumsum(np.fromiter((sizes[t] for t in tokens), np.int64, len(tokens)))
        # token i holds bytes [ends[i-1], ends[i]): the first token ending past the page's first byte
        found = np.searchsorted(ends, np.array(starts, np.int64), side="right")
        return tuple(int(min(i, len(tokens))) for i in found)

    def _padded(self, tokens: list[int]) -> list[int]:
        pad = -len(tokens) % LAYOUT_UNIT
        return tokens + [self._pad_token()] * pad

    def _pad_token(self) -> int:
        return self.tokenize(PAD_TEXT, bos=False)[-1]

    def _saved_body(self, key: kvstate.StateKey, body: list[int]) -> tuple[bytes | None, str | None]:
        """A body's saved state when it is there and holds these tokens; else None and why it was dropped."""
        try:
            saved = kvstate.load_state(key)
        except (kvstate.StateCacheError, OSError) as err:
            return None, self._discard(key, f"saved state discarded: {err}")
        if saved is None:
            return None, None
        tokens, state = saved
        if list(tokens) != body:
            return None, self._discard(key, "saved state did not match the document tokens; rebuilt")
        return state, None

    @staticmethod
    def _discard(key: kvstate.StateKey, reason: str) -> str:
        try:
            kvstate.discard(key)
        except OSError as err:
            return f"{reason} (the stale entry could not be removed: {err.strerror or err})"
        return reason

    def _prefill_body(self, head: list[int], body: list[int], progress, cancel) -> bytes:
        """Prefill head + body in a single-sequence context; the state of the body's cells alone."""
        n_ctx = max(-(-(len(head) + len(body)) // CTX_ROUND) * CTX_ROUND, CTX_ROUND)
        if self.context is None or self.context.n_ctx < n_ctx:  # load_set dropped the set's context first
            self.context = None
            self.context = self._open_context(n_ctx=n_ctx)
        self._prefill(head + body, progress, cancel, PrefillConfig())
        self.context.remove_positions(0, 0, len(head))
        state = self.kv_state()
        self._clear_kv()
        return state

    # -- reading it back -------------------------------------------------------------------------

    def span_text(self, start: int, end: int) -> str:
        """The text of cells [start, end): the set's prefix by cell, then the question and answer."""
        if not self._cell_tokens:
            return super().span_text(start, end)
        n_cells = len(self._cell_tokens)
        tokens = self._cell_tokens[start:min(end, n_cells)]
        if end > n_cells and self.context is not None:  # question and answer: cells follow positions there
            offset = self.n_prefix - n_cells
            tokens += self.context.tokens(max(start, n_cells) + offset, min(end + offset, self.context.n_tokens))
        if not tokens:
            return ""
        return self.context.detokenize(tokens, special=True).decode("utf-8", errors="replace")

    def prefix_cell_tokens(self) -> list[int]:
        """The set's prefix in cell order (its cells do not follow positions in the parallel layout)."""
        return list(self._cell_tokens) if self._cell_tokens else super().prefix_cell_tokens()

    def document_at(self, cell: int) -> DocumentSpan | None:
        """The document whose body holds `cell` (None for the template head, the question and the answer)."""
        return span_at(self.spans, cell)

    def read_tally(self) -> SetReads:
        """An empty tally of the reads of the next answer, by document (feed it each step's ReadStats)."""
        return SetReads(self.spans, self.prefix_cells)


@dataclass
class SetCells:
    """A set's cache in cell order, before it is loaded (Library.set_cells)."""

    head: list[int]
    bodies: list[list[int]]  # each padded to a whole number of LAYOUT_UNIT cells
    middle: list[int]
    n_body: list[int]  # each body's own tokens, padding left out
    page_tokens: list[tuple[int, ...]]

    @property
    def tokens(self) -> list[int]:
        return self.head + [t for body in self.bodies for t in body] + self.middle

    @property
    def starts(self) -> list[int]:
        """The first cell of each body."""
        starts, cell = [], len(self.head)
        for body in self.bodies:
            starts.append(cell)
            cell += len(body)
        return starts


def _positive(value: str) -> bool:
    try:
        return float(value) > 0
    except ValueError:
        return False


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
    up to its count: the body's padding counts to the last page, as DocumentSpan.page_at says."""

    spans: Sequence[DocumentSpan]
    prefix_cells: int
    documents: list[int] = field(default_factory=list)
    pages: list[list[int]] = field(default_factory=list)
    head: int = 0
    rest: int = 0
    steps: int = 0
    routed_steps: int = 0

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
        if n_dense and stats.n_kv:
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
        head = max(0, min(hi, first) - lo)
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
