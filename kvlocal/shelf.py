"""A shelf: several documents held side by side in one context, so that answers about each decode together.

`kvlocal serve --batch N` keeps the documents it was started with on a shelf (kvlocal.serve.scheduler):
each document's prompt prefix is loaded as `kvlocal ask` loads it (the same tokens, and the same saved
state, prefilled and saved where it is not cached yet), into its own sequence and its own run of whole
regions of the context (Session.open_shelf, Session.load_document(home=...)). A request about any of
them then joins the answers being decoded (kvlocal.batch): each answer's sequence shares its own
document's cells only, so it reads that document alone.

`plan_shelf` chooses, before anything loads, the documents that go on it: each within the model's
trained context, and together, with the answers' room, within the KV limit (estimated from their
characters, as a set's is). `load_shelf` loads them.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvlocal.docset import TOKENS_PER_DOCUMENT, estimate_tokens, kv_bytes_per_token
from kvlocal.ingest import Document
from kvlocal.route_settings import ANSWER_RESERVE
from kvlocal.session import CTX_ROUND, Prefix, Session


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


def load_shelf(session: Session, documents: Sequence[Document], *, region: int,
               cancel: threading.Event | None = None, log: Callable[[str], None] | None = None) -> ShelfLoad:
    """Open a shelf in `session` and load `documents` onto it, each on its own run of whole regions of
    `region` cells (of every region size that divides CTX_ROUND or `region`). What is loaded stays
    loaded if a later document fails or `cancel` is set (CancelledError); each prefilled document's
    state is saved as it finishes."""
    start = time.perf_counter()
    unit = math.lcm(CTX_ROUND, region)
    prompts = [session.tokenize_prompt(session.prompt_parts(doc.text).prefix_segments(), bos=True) for doc in documents]
    runs = [max(unit, -(-len(tokens) // unit) * unit) for tokens in prompts]
    n_ctx = -(-(sum(runs) + session.answers * ANSWER_RESERVE) // CTX_ROUND) * CTX_ROUND
    session.open_shelf(n_ctx, len(documents))
    first, hits = 0, 0
    for seq, (doc, run) in enumerate(zip(documents, runs)):
        result = session.load_document(doc.text, label=doc.source, pages=getattr(doc, "pages", ()), cancel=cancel,
                                       home=(seq, first, run))
        hits += result.cache_hit
        if log is not None:
            how = "from the cache" if result.cache_hit else "prefilled"
            log(f"shelf {seq + 1}/{len(documents)}: {doc.source}, {result.n_tokens:,} tokens {how} in "
                f"{result.seconds:.1f} s (cells {first:,}-{first + run:,})")
        first += run
    return ShelfLoad(tuple(session.shelf[seq] for seq in range(len(documents))), n_ctx,
                     sum(len(t) for t in prompts), hits, time.perf_counter() - start)
