"""The library: a set of documents as one KV cache, each document prefilled once on its own.

The set loader (`load_set`, docs/library.md) drives a Session through its public methods; it is no
session itself. Every document's body is prefilled alone after the shared template head, padded with
newlines to a whole number of LAYOUT_UNIT cells, and its cells alone are saved, keyed by its text as
a single document's state is (with the layout tag LAYOUT_TAG and no context size): adding a document
to a set costs its own prefill, and neither the order of a set nor which set it is forces one. A set
is assembled without recomputing anything: the head is decoded into the question's sequence (0);
each body's state is loaded into a staging sequence (1), moved to its place with the engine's
position shift, shared with sequence 0 and the staging sequence dropped, so the cells lie in load
order with no hole and every body starts on a region boundary. Decoding the prompt's middle then
applies the pending K-shifts (and rebuilds the region centroids): the set is ready, and the session
holds its DocumentLayout (kvlocal.layout).

Positions (kvlocal.layout.LAYOUTS): *consecutive* (each body after the one before, as one long document) while the
set fits the model's trained context; *parallel* beyond it: every body keeps the positions it was
prefilled at, right after the head, and the question follows the longest.

A set of one document is the single-document path (`Session.load_document`): today's tokens,
logits and saved state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvlocal import kvstate
from kvlocal.errors import CancelledError, ContextOverflowError, EngineError, ModelError, UsageError
from kvlocal.ingest import Document
from kvlocal.layout import DocumentLayout, DocumentSpan
from kvlocal.prompt import Segment
from kvlocal.route_settings import SET_LAYOUT_UNIT
from kvlocal.routing import PrefillConfig
from kvlocal.session import ANSWER_RESERVE, QUESTION_SEQ, STAGING_SEQ, LoadResult, PrefillProgress, Session

LAYOUT_UNIT = SET_LAYOUT_UNIT  # cells the head and each body are padded to: every body starts on a region boundary
LAYOUT_TAG = f"library-u{LAYOUT_UNIT}"  # a body state's prefill tag (the key's layout)
PAD_TEXT = "\n"  # the filler a head or body is padded with (one token)


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
    layout: str  # one of kvlocal.layout.LAYOUTS
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


# -- checks -------------------------------------------------------------------------------------

def check_composable(session: Session) -> None:
    """ModelError unless the session's model memory can be composed from per-document states:
    recurrent and hybrid models keep a state that is not per cell, and an iSWA model's sliding layers
    would see only the last document."""
    vocab = session.vocab
    name = session.model.path.name
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


def check_set_fits(session: Session, documents: Sequence[Document], max_kv: int | None) -> None:
    """ContextOverflowError, in one line, when a set of several documents is estimated (from its
    characters and the model's header, before anything is loaded) to need more KV cache than
    `max_kv`; one document is bounded by the model's trained context, as before."""
    from kvlocal.docset import check_kv_limit, estimate_kv

    if len(documents) > 1:
        check_kv_limit(estimate_kv(list(documents), session.model.info, session.kv_type,
                                   centroid_block=session.centroid_block,
                                   centroid_type=session.centroid_type_for(len(documents))), max_kv)


# -- loading a set --------------------------------------------------------------------------------

def load_set(
    session: Session,
    documents: Sequence[Document],
    *,
    progress: Callable[[PrefillProgress], None] | None = None,
    log: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
    use_cache: bool = True,
    prefill: PrefillConfig | None = None,
    layout: str | None = None,
) -> SetLoad:
    """Load `documents` into `session` as one cache. One document takes the single-document path.
    `layout` forces consecutive or parallel positions (None: consecutive while the set fits the
    trained context); given with one document, that document's cached body is assembled as a set's
    is (what `kvlocal eval --library` asks a fact of its document alone with). `log` gets a line as
    each document is prefilled or loaded."""
    if not documents:
        raise UsageError("no documents to load")
    if len(documents) == 1 and layout is None:
        return _load_single(session, documents[0], progress=progress, cancel=cancel, use_cache=use_cache,
                            prefill=prefill)
    if layout not in (None, "consecutive", "parallel"):
        raise UsageError(f"the layout must be consecutive or parallel (got {layout!r})")
    if prefill is not None and prefill.routed:
        raise UsageError("a routed prefill is for one document; a set's documents are prefilled densely",
                         setting="prefill")
    check_composable(session)
    start = time.perf_counter()
    session.start_set()  # the previous document or set is gone from here on, whatever happens
    planned = set_cells(session, documents, pages=True)
    layout, n_ctx = _set_layout(session, documents, planned, layout)
    # 1. every body's saved state, or its prefill (saved as it finishes: a later failure keeps it)
    keys = [session.state_key(doc.text.strip(), 0, LAYOUT_TAG, dense=True) for doc in documents]
    states, loads = _body_states(session, documents, planned, keys, use_cache, progress, log, cancel)
    if cancel is not None and cancel.is_set():
        raise CancelledError("cancelled: the set was not loaded")
    # 2. the set's context: head, then each body staged into place, then the middle
    ready_start = time.perf_counter()
    spans, position = _assemble(session, documents, planned, keys, states, layout, n_ctx)
    end = time.perf_counter()
    n_cells = len(planned.tokens)
    session.hold_prefix(position + len(planned.middle), DocumentLayout(layout, tuple(spans), tuple(planned.tokens)),
                        f"{len(documents)} documents")
    return SetLoad(tuple(loads), tuple(spans), layout, n_cells, session.n_prefix, n_ctx, end - start,
                   end - ready_start + sum(d.seconds for d in loads if d.cache_hit))


def _load_single(session: Session, doc: Document, **load) -> SetLoad:
    """A set of one document: the single-document path (Session.load_document) and its span."""
    result = session.load_document(doc.text, label=doc.source, pages=getattr(doc, "pages", ()), **load)
    loaded = BodyLoad(doc.source, result.n_tokens, result.cache_hit, result.seconds, result.saved,
                      result.rebuilt_reason)
    return SetLoad((loaded,), session.layout.spans, "single", result.n_tokens, result.n_tokens, result.n_ctx,
                   result.seconds, result.seconds if result.cache_hit else 0.0, single=result)


def _set_layout(session: Session, documents: Sequence[Document], planned: SetCells,
                layout: str | None) -> tuple[str, int]:
    """The set's layout (`layout`, or consecutive while the set fits the trained context) and its
    context size; ContextOverflowError where a document, or the set, does not fit."""
    head, bodies, n_body = planned.head, planned.bodies, planned.n_body
    trained, requested = session.trained_ctx, session.requested_ctx
    longest = max(len(b) for b in bodies)
    if len(head) + longest + ANSWER_RESERVE > trained:
        i = max(range(len(bodies)), key=lambda j: len(bodies[j]))
        raise ContextOverflowError(
            f"{documents[i].source} is {n_body[i]:,} tokens; with the prompt and room for a question and "
            f"answer it needs {len(head) + longest + ANSWER_RESERVE:,}, over the model's trained context "
            f"{trained:,}")
    n_cells = len(head) + sum(len(b) for b in bodies) + len(planned.middle)
    if layout is None:
        layout = "consecutive" if n_cells + ANSWER_RESERVE <= trained else "parallel"
    if layout == "consecutive" and n_cells + ANSWER_RESERVE > trained:
        raise ContextOverflowError(
            f"the set's {n_cells:,} tokens at consecutive positions need {n_cells + ANSWER_RESERVE:,} with room "
            f"for a question and answer, over the model's trained context {trained:,}")
    n_ctx = session.cells_for(n_cells)
    if requested is not None:
        if requested < n_cells + ANSWER_RESERVE:
            raise ContextOverflowError(
                f"the set is {n_cells:,} tokens and needs {n_cells + ANSWER_RESERVE:,} with room for a question "
                f"and answer, but the context holds {requested:,}", setting="ctx")
        n_ctx = max(n_ctx, requested)
    return layout, n_ctx


def _body_states(session: Session, documents: Sequence[Document], planned: SetCells, keys: list[kvstate.StateKey],
                 use_cache: bool, progress, log, cancel) -> tuple[list[bytes | None], list[BodyLoad]]:
    """Every body's state, its saved one or prefilled now (and saved as it finishes), and how each
    was readied."""
    bodies, n_body = planned.bodies, planned.n_body
    states: list[bytes | None] = [None] * len(documents)
    loads: list[BodyLoad] = []
    for i, doc in enumerate(documents):
        t0 = time.perf_counter()
        state, reason = (_saved_body(keys[i], bodies[i]) if use_cache else (None, None))
        if state is not None:
            states[i] = state  # loaded into the engine by _assemble
            loads.append(BodyLoad(doc.source, n_body[i], True, time.perf_counter() - t0))
            continue
        if log:
            log(f"document {i + 1}/{len(documents)} {doc.source}: prefilling {n_body[i]:,} tokens")
        state = session.prefill_state(planned.head + bodies[i], drop=len(planned.head), progress=progress,
                                      cancel=cancel)
        saved_to, note = (kvstate.save_noting(keys[i], np.array(bodies[i], np.int32), state, doc.source) if use_cache
                          else (None, None))
        states[i] = state
        loads.append(BodyLoad(doc.source, n_body[i], False, time.perf_counter() - t0, saved_to is not None,
                              kvstate.joined(reason, note)))
    return states, loads


def _assemble(session: Session, documents: Sequence[Document], planned: SetCells, keys: list[kvstate.StateKey],
              states: list[bytes | None], layout: str, n_ctx: int) -> tuple[list[DocumentSpan], int]:
    """A new context of two sequences holding the set: the head decoded into the question's sequence,
    each body's state staged and moved into place, the middle decoded after them. The spans, and the
    position the middle was decoded at. `states` are let go of as they are staged."""
    head, bodies = planned.head, planned.bodies
    context = session.open_set_context(n_ctx, len(documents))
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
        session.unload()
        raise CancelledError("interrupted: the set was not loaded") from None
    except RuntimeError as err:
        session.unload()
        raise EngineError(f"assembling the set failed: {err}") from None
    except BaseException:
        session.unload()
        raise
    return spans, position


def set_cells(session: Session, documents: Sequence[Document], *, pages: bool = False) -> SetCells:
    """The tokens a set's cache holds, in cell order, without loading anything: the padded
    template head, each body padded to LAYOUT_UNIT cells, the prompt's middle (and, with `pages`,
    where each document's pages start among its body's tokens)."""
    parts = session.prompt_parts()
    pad = session.tokenize(PAD_TEXT, bos=False)[-1]
    head = _padded(session.tokenize_prompt([Segment(parts.head, True)], bos=True), pad)
    middle = session.tokenize_prompt([Segment(parts.middle, True)], bos=False)
    bodies, n_body, page_tokens = [], [], []
    for doc in documents:
        tokens = session.tokenize(doc.text.strip(), bos=False)
        n_body.append(len(tokens))
        page_tokens.append(session.page_tokens(doc.text, getattr(doc, "pages", ()), tokens) if pages else ())
        bodies.append(_padded(tokens, pad))
    return SetCells(head, bodies, middle, n_body, page_tokens)


def _padded(tokens: list[int], pad: int) -> list[int]:
    """`tokens` padded with `pad` to a whole number of LAYOUT_UNIT cells."""
    return tokens + [pad] * (-len(tokens) % LAYOUT_UNIT)


def _saved_body(key: kvstate.StateKey, body: list[int]) -> tuple[bytes | None, str | None]:
    """A body's saved state when it is there and holds these tokens; else None and why it was dropped."""
    try:
        saved = kvstate.load_state(key)
    except (kvstate.StateCacheError, OSError) as err:
        return None, kvstate.discard_noting(key, f"saved state discarded: {err}")
    if saved is None:
        return None, None
    tokens, state = saved
    if list(tokens) != body:
        return None, kvstate.discard_noting(key, "saved state did not match the document tokens; rebuilt")
    return state, None


@dataclass
class SetCells:
    """A set's cache in cell order, before it is loaded (set_cells)."""

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


