"""A shelf: several documents held side by side in one context, so that answers about each decode together.

`kvlocal serve --batch N` keeps the documents it was started with on a shelf (kvlocal.serve.scheduler):
each document's prompt prefix is loaded as `kvlocal ask` loads it (the same tokens, and the same saved
state, prefilled and saved where it is not cached yet), into its own sequence and its own run of whole
regions of the context (Session.open_shelf, Session.load_document(home=...)). A request about any of
them then joins the answers being decoded (kvlocal.batch): each answer's sequence shares its own
document's cells only, so it reads that document alone.

`plan_shelf` chooses, before anything loads, the documents that go on it: each within the model's
trained context, and together, with the answers' room, within the KV limit (estimated from their
characters, as a set's is). `open_shelf` gives each its place, `load_onto` loads one (the server:
while idle, or between the decode steps of other answers), `load_shelf` opens and loads them all.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvlocal.docset import TOKENS_PER_DOCUMENT, estimate_tokens, kv_bytes_per_token
from kvlocal.ingest import Document
from kvlocal.route_settings import ANSWER_RESERVE
from kvlocal.session import CTX_ROUND, LoadResult, Prefix, Session


@dataclass(frozen=True)
class ShelfPlace:
    """A document's place on an open shelf: its sequence and its run of cells, and its prompt's tokens."""

    seq: int
    document: Document
    first_cell: int
    run: int
    n_tokens: int


@dataclass(frozen=True)
class ShelfLoad:
    """A loaded shelf: each document's prefix (in the documents' order), and how it was readied."""

    prefixes: tuple[Prefix, ...]
    n_ctx: int
    n_tokens: int
    cache_hits: int
    seconds: float


def plan_shelf(session: Session, documents: Sequence[Document], max_kv: int | None) -> tuple[list[Document], list[str]]:
    """The documents, in order, that fit on a shelf of `session` (each within the model's trained
    context; all of them, with every answer's room, within `max_kv` bytes of KV cache, None: no limit,
    estimated from their characters), and a line for each left off."""
    per_token = kv_bytes_per_token(session.model.info, session.kv_type, centroid_block=session.centroid_block,
                                   centroid_type=session.centroid_type_for(1))
    chosen: list[Document] = []
    notes: list[str] = []
    tokens = session.answers * ANSWER_RESERVE
    for doc in documents:
        n = estimate_tokens(len(doc.text)) + TOKENS_PER_DOCUMENT
        if n + ANSWER_RESERVE > session.trained_ctx:
            notes.append(f"{doc.source}: about {n:,} tokens, more than the model's context {session.trained_ctx:,}")
        elif max_kv is not None and (tokens + n) * per_token > max_kv:
            notes.append(f"{doc.source}: the KV limit is reached without it")
        else:
            chosen.append(doc)
            tokens += n
    return chosen, notes


def open_shelf(session: Session, documents: Sequence[Document], *, region: int) -> tuple[ShelfPlace, ...]:
    """Open a shelf in `session` with a place for each of `documents` (its own sequence and run of whole
    regions of `region` cells, of every region size that divides CTX_ROUND or `region`), and the
    answers' room after them; nothing is loaded yet (load_onto)."""
    unit = math.lcm(CTX_ROUND, region)
    prompts = [session.tokenize_prompt(session.prompt_parts(doc.text).prefix_segments(), bos=True) for doc in documents]
    runs = [max(unit, -(-len(tokens) // unit) * unit) for tokens in prompts]
    n_ctx = -(-(sum(runs) + session.answers * ANSWER_RESERVE) // CTX_ROUND) * CTX_ROUND
    session.open_shelf(n_ctx, len(documents), sum(runs))
    firsts = itertools.accumulate(runs, initial=0)
    return tuple(ShelfPlace(seq, doc, first, run, len(tokens))
                 for seq, (doc, first, run, tokens) in enumerate(zip(documents, firsts, runs, prompts)))


def load_onto(session: Session, place: ShelfPlace, *, cancel: threading.Event | None = None,
              log: Callable[[str], None] | None = None, between: Callable[[], None] | None = None) -> LoadResult:
    """Load `place`'s document into its place of the session's shelf: its state from the cache, or
    prefilled (CancelledError when `cancel` is set between two ubatches; nothing is kept) and saved.
    `between`: work run between two of its prefill's ubatches (the other answers' decode steps)."""
    doc = place.document
    result = session.load_document(doc.text, label=doc.source, pages=getattr(doc, "pages", ()), cancel=cancel,
                                   home=(place.seq, place.first_cell, place.run), between=between)
    if log is not None:
        how = "from the cache" if result.cache_hit else "prefilled"
        log(f"shelf {place.seq + 1}/{session.shelf_places}: {doc.source}, {result.n_tokens:,} tokens {how} in "
            f"{result.seconds:.1f} s (cells {place.first_cell:,}-{place.first_cell + place.run:,})")
    return result


def load_shelf(session: Session, documents: Sequence[Document], *, region: int,
               cancel: threading.Event | None = None, log: Callable[[str], None] | None = None) -> ShelfLoad:
    """Open a shelf in `session` and load every one of `documents` onto it (open_shelf, load_onto).
    What is loaded stays loaded if a later document fails or `cancel` is set (CancelledError)."""
    start = time.perf_counter()
    places = open_shelf(session, documents, region=region)
    hits = sum(load_onto(session, place, cancel=cancel, log=log).cache_hit for place in places)
    return ShelfLoad(tuple(session.shelf[place.seq] for place in places), session.context.n_ctx,
                     sum(place.n_tokens for place in places), hits, time.perf_counter() - start)
