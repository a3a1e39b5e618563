"""The session layer: a model, one prefilled document, and questions asked of it.

The CLI, the TUI and the evaluation call only this module (and the set loader, kvlocal.library,
which drives a session). A session holds an engine context (kvlocal.engine.EngineContext) and the
prompt prefix it holds (`Prefix`: where it sits, and the layout of its documents,
kvlocal.layout.DocumentLayout), and drives the context: prefill in batches with progress and
cancellation, the saved KV state, and routed decoding that streams answer pieces together with the
engine's per-step read statistics.

A session that answers several questions together (`answers` > 1) may also hold a shelf: several
prefixes side by side in one context, each in its own sequence and its own run of cells
(`open_shelf`, then `load_document(..., home=...)` for each; kvlocal.shelf drives it), so that
answers about different documents decode in one batch (kvlocal.batch).
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvlocal import kvstate
from kvlocal.answer import Answer, AnswerPiece, AnswerSummary, AnswerText, ReadTotals
from kvlocal.engine import EngineContext, default_threads, exit_on_engine_abort, require_patched
from kvlocal.errors import CancelledError, ContextOverflowError, EngineError, UsageError
from kvlocal.ggml_types import TYPE_IDS as KV_TYPES
from kvlocal.hints import TextIndex, hint_cells
from kvlocal.layout import DocumentLayout, DocumentSpan, SetReads, page_starts, span_at
from kvlocal.models import ResolvedModel, resolve_model
from kvlocal.patchset import repo_kv_state_id
from kvlocal.prefill_clock import PrefillClock
from kvlocal.prompt import PromptParts, Segment, build_prompt
from kvlocal.route_settings import (
    ANSWER_RESERVE,
    DEFAULT_CENTROID_BLOCK,
    LIBRARY_CENTROID_TYPE,
    MAX_ANSWERS,
    MAX_THREADS,
    MIN_CTX,
    SET_LAYOUT_UNIT,
    ModelRoute,
    model_route,
)
from kvlocal.rpc import Placement, check_servers, describe_layers, server_gone, wire_bytes
from kvlocal.routing import (
    MODEL_ROUTE, PrefillConfig, ReadStats, Route, RouteConfig, RouteFacts, check_centroid_block, check_centroid_type,
    check_region_block, resolve_route,
)

CTX_ROUND = 256
# the sequences of a set's context: the set's own, in which questions are asked, and the one in which
# the library stages each document while it assembles the set and a focused answer (--focus hinted) is
# decoded afterwards
QUESTION_SEQ, STAGING_SEQ = 0, 1


@dataclass(frozen=True)
class PrefillProgress:
    done: int
    total: int
    elapsed: float
    prefill: str = "dense"  # PrefillConfig.mode
    remaining: float | None = None  # seconds left as the prefill's clock predicts them (kvlocal.prefill_clock)

    @property
    def rate(self) -> float:
        return self.done / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta(self) -> float:
        if self.remaining is not None:
            return self.remaining
        return (self.total - self.done) / self.rate if self.rate > 0 else float("inf")


@dataclass(frozen=True)
class LoadResult:
    n_tokens: int
    n_ctx: int
    cache_hit: bool
    seconds: float
    rebuilt_reason: str | None = None  # why a saved state was discarded (or could not be saved)
    saved: bool = False  # the prefilled state was written to the cache
    prefill: PrefillConfig = PrefillConfig()  # how the state was (or the saved one had been) prefilled
    reads: PrefillReads | None = None  # what this prefill's ubatches read (None for a cache hit)

    @property
    def rate(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(kw_only=True)
class PrefillReads(ReadTotals):
    """What the prefill's ubatches read, as the engine counted them (a step is a ubatch), against
    what reading every earlier cell would have cost."""

    ubatches_routed: int = 0

    @property
    def ubatches(self) -> int:
        return self.steps

    def add(self, stats: ReadStats) -> None:
        super().add(stats)
        self.ubatches_routed += stats.n_layer_routed > 0


MAX_TEMPERATURE = 10.0


@dataclass(frozen=True)
class AnswerFocus:
    """Where a focused answer (--focus hinted) is decoded: in STAGING_SEQ, which shares the set's
    template head and the cells of one document (`span`) and holds the prompt's middle decoded again
    right after that document, so that its question and answer read that document as if it were asked
    alone (the other documents are neither seen nor read)."""

    span: DocumentSpan
    head: int  # the template head's cells (the set's first)
    added: int  # the cells it took beside the set's: the middle's

    @property
    def n_cells(self) -> int:
        """The cells the sequence sees before its question: the head, the document, the middle."""
        return self.head + (self.span.end - self.span.start) + self.added

    @property
    def position(self) -> int:
        """Where its question starts: after the document's cells and the middle."""
        return self.span.position + (self.span.end - self.span.start) + self.added


class AnswerTokens:
    """Where an answer's tokens go: after the prefix in sequence 0, or after a focus in its sequence."""

    def __init__(self, context: EngineContext, focus: AnswerFocus | None) -> None:
        self.context, self.focus = context, focus
        self.position = focus.position if focus else 0

    def decode(self, tokens: Sequence[int]) -> None:
        if self.focus is None:
            self.context.decode(tokens)
            return
        self.context.feed_sequence(STAGING_SEQ, tokens, self.position)
        self.position += len(tokens)


@dataclass
class Prefix:
    """A prompt prefix the context holds (template head, documents, middle), in sequence `seq`:
    its positions, its documents' layout, and what the session derived from it. A shelf's prefix
    starts at cell `first_cell` of the context and keeps its tokens (`tokens`, in cell order); the one
    prefix of a session otherwise starts at cell 0 and its tokens are the context's record."""

    seq: int = 0
    n_prefix: int = 0
    layout: DocumentLayout = field(default_factory=DocumentLayout)
    label: str = ""
    first_cell: int = 0
    run: int = 0  # the cells kept for it on a shelf (its tokens and padding to whole regions); 0 elsewhere
    tokens: tuple[int, ...] = ()
    # the document's state, kept where a question cannot be dropped by removing its cells (a model
    # with recurrent layers: their state is not per cell); Session._rewind restores it
    state: bytes | None = None
    text_index: TextIndex | None = None  # its words by cell, for text hints (built on use)
    focused: bool = False  # STAGING_SEQ holds a focused answer's cells (Session._rewind drops them)

    @property
    def cells(self) -> int:
        """KV cells the prefix holds: its positions, unless a library placed documents side by side."""
        n_cells = self.layout.n_cells
        return self.n_prefix if n_cells is None else n_cells

    @property
    def n_documents(self) -> int:
        return max(1, len(self.layout.spans))


def _on_prefix(name: str) -> property:
    """A Session attribute that is the current prefix's `name`."""
    return property(lambda self: getattr(self.prefix, name), lambda self, value: setattr(self.prefix, name, value))


class Session:
    """A loaded model with (at most) one document prefilled into its KV cache."""

    def __init__(
        self,
        model: str | None = None,
        *,
        n_ctx: int | None = None,
        threads: int | None = None,
        kv_type: str = "f16",
        n_batch: int = 512,
        centroid_block: int = DEFAULT_CENTROID_BLOCK,
        centroid_type: str | None = None,
        model_progress: Callable[[int, int, str], None] | None = None,
        placement: Placement | None = None,
        answers: int = 1,
    ) -> None:
        if kv_type not in KV_TYPES:
            raise UsageError(f"unknown KV cache type {kv_type!r}; choose one of {', '.join(KV_TYPES)}")
        check_centroid_block(centroid_block)
        if centroid_type is not None:
            check_centroid_type(centroid_type)
        if threads is not None and not 1 <= threads <= MAX_THREADS:
            raise UsageError(f"the thread count must be between 1 and {MAX_THREADS} (got {threads})", setting="threads")
        if not 1 <= answers <= MAX_ANSWERS:
            raise UsageError(f"answers decoded together must be between 1 and {MAX_ANSWERS} (got {answers})",
                             setting="answers")
        # answers decoded together (kvlocal.batch): each its own sequence beside the document's, with
        # its own answer room in the context's cells
        self.answers = answers
        self.engine = require_patched()
        # layers and their KV on RPC servers (kvlocal.rpc): each probed now, so that an unreachable one
        # or another protocol is one line before any loading
        self.placement = placement
        if placement is not None:
            check_servers(placement)
            exit_on_engine_abort(lambda detail: server_gone(detail, placement.servers))
        self.model: ResolvedModel = resolve_model(model, progress=model_progress)
        self.kv_type = kv_type
        self.n_batch = n_batch
        self.centroid_block = centroid_block
        # the route calibrated for this model file (route_settings.MODEL_ROUTES): a route that follows
        # the model takes its budget, and a document's centroids its type unless `centroid_type` is given
        self.calibrated_route: ModelRoute = model_route(self.model.sha256)
        self.given_centroid_type = centroid_type
        self.centroid_type = self.centroid_type_for(1)  # the type of the current context's centroids
        self.threads = threads or default_threads()
        self.requested_ctx = n_ctx
        self.trained_ctx = int(self.model.info.context_length or 0) or 32768
        if n_ctx is not None and not MIN_CTX <= n_ctx <= self.trained_ctx:
            raise UsageError(f"the context size must be between {MIN_CTX} and the model's trained context {self.trained_ctx}",
                             setting="ctx")
        # the model's vocabulary and header (no weights): what tokenizes, and what the model is
        self.vocab: EngineContext | None = self._open_context(vocab_only=True)
        self.chat_template = self.vocab.metadata.get("tokenizer.chat_template")
        self.context: EngineContext | None = None  # the model with the loaded document's KV cache
        self.parts: PromptParts | None = None
        self.prefix = Prefix()  # the prefix loaded (or being loaded)
        # a shelf's prefixes by sequence (open_shelf); empty: the session holds one prefix, in sequence 0
        self.shelf: dict[int, Prefix] = {}
        self._homes = 1  # sequences that hold prefixes; the answers decoded together take the next ones
        self.shelf_places = 0  # the open shelf's places, loaded or not (open_shelf); 0: no shelf
        self._shelf_cells = 0  # the cells they take, from the first (the answers' cells follow)
        self._lock = threading.Lock()

    # the current prefix's facts, as the session's own (a set's cells need not follow positions)
    n_prefix = _on_prefix("n_prefix")
    layout = _on_prefix("layout")
    doc_label = _on_prefix("label")
    _prefix_state = _on_prefix("state")
    _text_index = _on_prefix("text_index")

    def centroid_type_for(self, n_documents: int) -> str:
        """The type a context of `n_documents` documents keeps its centroids in: the one given, else for
        one document the model's route's and for a set of several LIBRARY_CENTROID_TYPE (the type the
        set's route was measured with)."""
        if self.given_centroid_type is not None:
            return self.given_centroid_type
        return self.calibrated_route.centroid_type if n_documents < 2 else LIBRARY_CENTROID_TYPE

    # -- engine objects -------------------------------------------------------------------

    def _open_context(self, *, vocab_only: bool = False, n_ctx: int = 512, n_seq_max: int = 1) -> EngineContext:
        """An engine context of this session's model and settings (EngineContext.open)."""
        if not vocab_only and self.answers > 1:
            n_seq_max = max(n_seq_max, self._homes + self.answers)  # the documents' sequences and one per answer
        return EngineContext.open(self.model.path, vocab_only=vocab_only, n_ctx=n_ctx, n_seq_max=n_seq_max,
                                  n_batch=self.n_batch, threads=self.threads, kv_type=self.kv_type,
                                  centroid_block=self.centroid_block, centroid_type=self.centroid_type,
                                  rpc_servers=[str(e) for e in self.placement.servers] if self.placement else (),
                                  rpc_shares=self.placement.shares if self.placement else ())

    def _wire_bytes(self) -> tuple[int, int]:
        """(sent, received) bytes over the RPC servers' connections so far; (0, 0) without servers."""
        return wire_bytes(self.placement.servers) if self.placement else (0, 0)

    def layer_placement(self) -> str:
        """Which machine holds which layers (and their KV) of the loaded context; '' when all are here."""
        if self.placement is None or self.context is None or not self.context.layer_devices:
            return ""
        return describe_layers(self.context.layer_devices, self.context.device_labels)

    @property
    def prefix_cells(self) -> int:
        """KV cells the loaded prefix holds: its positions, unless a library placed documents side by side."""
        return self.prefix.cells

    @property
    def answer_seqs(self) -> range:
        """The sequences of the answers decoded together (kvlocal.batch): after the prefixes' own."""
        return range(self._homes, self._homes + self.answers)

    @property
    def resident_cells(self) -> int:
        """The cells the prefixes take at the front of the context: the answers' cells follow them."""
        if self.shelf_places:
            return self._shelf_cells
        return self.prefix_cells

    def tokenize(self, text: str, *, bos: bool, special: bool = False) -> list[int]:
        """Token ids of `text`; control-token spellings in it stay plain text unless `special`."""
        return self.vocab.tokenize(text, bos=bos, special=special)

    def tokenize_prompt(self, segments: list[Segment], *, bos: bool) -> list[int]:
        """Token ids of prompt segments: only the chat template's own segments may yield control tokens."""
        tokens: list[int] = []
        for i, segment in enumerate(segments):
            tokens += self.tokenize(segment.text, bos=bos and i == 0, special=segment.template)
        return tokens

    # -- documents ------------------------------------------------------------------------

    def choose_ctx(self, n_tokens: int) -> int:
        needed = n_tokens + ANSWER_RESERVE
        if self.requested_ctx is not None:
            limit = self.requested_ctx
        else:
            limit = self.trained_ctx
        if needed > limit:
            larger = limit < self.trained_ctx
            hint = f"; a larger context (up to {self.trained_ctx:,}) would hold it" if larger else " (the model's trained context)"
            raise ContextOverflowError(
                f"the document is {n_tokens:,} tokens and needs {needed:,} with room for a question and answer, "
                f"but the context holds {limit:,}{hint}", setting="ctx" if larger else None)
        if self.requested_ctx is not None:
            return self.requested_ctx
        cells = self.cells_for(n_tokens)
        return min(self.trained_ctx, cells) if self.answers == 1 else cells

    def state_ctx(self, n_tokens: int) -> int:
        """The context size a document's saved state is keyed by: the one `kvlocal ask` takes for a
        prefix of `n_tokens` by default (one answer, no --ctx), whatever context it is loaded into. A
        prefill writes the same K/V bytes whatever the context's size (only the cells it uses are read),
        so `ask`, `ask --ctx N` and `serve --batch N` share one saved state."""
        return min(self.trained_ctx, self.cells_for(n_tokens, answers=1))

    def cells_for(self, n_cells: int, answers: int | None = None) -> int:
        """The context's cells for a prefix of `n_cells`: the answer room of one answer, or of each
        of `answers` (None: the session's) decoded together (each sequence has its own positions: the
        trained context bounds positions, not cells), rounded up."""
        needed = n_cells + ANSWER_RESERVE * (self.answers if answers is None else answers)
        return -(-needed // CTX_ROUND) * CTX_ROUND

    def state_key(self, text: str, n_ctx: int, prefill_tag: str = "dense", *,
                  dense: bool | None = None) -> kvstate.StateKey:
        # an engine built from this checkout is keyed by what decides its prefilled K/V bytes (the
        # pin and the patches not marked `Prefill-KV: unchanged`), so a routing-only rebuild keeps
        # the saved states; any other engine by its whole build id. A routed prefill's K/V depend on
        # the routing code too (the patches marked unchanged are so for a dense prefill only): its
        # state is keyed by the whole build id as well. `dense`: the state was prefilled densely
        # whatever its tag says (a library body's layout tag)
        dense = prefill_tag == "dense" if dense is None else dense
        current = self.engine.current and self.engine.repo_patchset and dense
        kv_state = repo_kv_state_id() if current else None
        return kvstate.StateKey(
            text_sha256=hashlib.sha256(text.encode()).hexdigest(),
            model_sha256=self.model.sha256,
            engine_build=f"kvstate:{kv_state}" if kv_state else self.engine.build_id or "",
            n_ctx=n_ctx,
            type_k=self.kv_type,
            type_v=self.kv_type,
            template_hash=self.parts.template_hash,
            prefill=prefill_tag,
        )

    def prefill_tag(self, prefill: PrefillConfig, n_tokens: int | None = None) -> str:
        """The prefill as a state key records it; a document of `n_tokens` that no ubatch of `prefill`
        routes is keyed as the dense prefill it equals (None: whatever the document's length)."""
        if n_tokens is not None and not prefill.routes_any(n_tokens, self.n_batch):
            return "dense"
        return prefill.state_tag(self.centroid_block, self.n_batch, self.centroid_type)

    def prompt_parts(self, text: str = "") -> PromptParts:
        """The prompt around `text` (empty: a set's template head, middle and question suffix)."""
        return build_prompt(text, self.chat_template, model_name=self.model.path.name)

    def load_document(
        self,
        text: str,
        *,
        label: str = "",
        pages: Sequence[int] = (),
        progress: Callable[[PrefillProgress], None] | None = None,
        cancel: threading.Event | None = None,
        use_cache: bool = True,
        prefill: PrefillConfig | None = None,
        home: tuple[int, int, int] | None = None,
        between: Callable[[], None] | None = None,
    ) -> LoadResult:
        """Prefill the document (or restore its saved state). Ctrl-C / cancel leaves nothing behind.
        `pages`: where each page starts in `text` (a PDF's), for the layout's span. `prefill` says how
        its ubatches read the cache (dense by default); a routed prefill's state is saved and found
        under its own key. `home`: (sequence, first cell, cells) of the shelf (open_shelf) it goes to,
        beside the shelf's other documents; without it, it replaces what the session holds. `between`
        (with `home`): work run between two ubatches of its prefill (a server's decode steps of the
        other sequences); the prefill sets its route again after it."""
        prefill = prefill or PrefillConfig()
        if home is not None:
            return self._load_home(text, label, pages, progress, cancel, use_cache, prefill, home, between)
        if between is not None:
            raise UsageError("only a shelf's document is prefilled between other work (home=...)")
        self.parts = self.prompt_parts(text)
        tokens = self.tokenize_prompt(self.parts.prefix_segments(), bos=True)
        n_ctx = self.choose_ctx(len(tokens))
        self.centroid_type = self.centroid_type_for(1)
        if self.shelf or self._homes != 1:  # a shelf's context: its sequences and cells are the shelf's
            self.unload()
        if self.context is None or self.context.n_ctx != n_ctx or self.context.centroid_type != self.centroid_type:
            self.context = None  # freed before the next one is made
            self.context = self._open_context(n_ctx=n_ctx)
        self.prefix = Prefix(label=label)
        layout = self._single_layout(label, text, pages, tokens)
        tag = self.prefill_tag(prefill, len(tokens))
        if tag == "dense":
            prefill = PrefillConfig()  # no ubatch of it would route: it is the dense prefill, and says so
        key = self.state_key(text, self.state_ctx(len(tokens)), tag)
        result = self._load_prefix(tokens, key, n_ctx, label, progress, cancel, use_cache, prefill)
        self.layout = layout
        return result

    def _load_home(self, text: str, label: str, pages: Sequence[int],
                   progress: Callable[[PrefillProgress], None] | None, cancel: threading.Event | None,
                   use_cache: bool, prefill: PrefillConfig, home: tuple[int, int, int],
                   between: Callable[[], None] | None = None) -> LoadResult:
        """load_document into sequence `home[0]` of the shelf, in cells [home[1], home[1] + home[2]):
        the same tokens, state key and saved state as the document loaded alone."""
        seq, first, run = home
        if self.context is None or seq not in range(self._homes) or seq in self.shelf or first + run > self._shelf_cells:
            raise UsageError(f"sequence {seq} at cells {first:,}-{first + run:,} is not a free place of the shelf "
                             "(open_shelf first)")
        tokens = self.tokenize_prompt(self.prompt_parts(text).prefix_segments(), bos=True)
        if len(tokens) > run:
            raise ContextOverflowError(f"the document is {len(tokens):,} tokens; its place on the shelf holds {run:,}")
        self.choose_ctx(len(tokens))  # the positions of its prefix, question and answer fit the model
        tag = self.prefill_tag(prefill, len(tokens))
        if tag == "dense":
            prefill = PrefillConfig()
        layout = self._single_layout(label, text, pages, tokens)
        self.prefix = Prefix(seq=seq, label=label, first_cell=first, run=run)
        self.context.keep_cells(seq, first, first + run)
        key = self.state_key(text, self.state_ctx(len(tokens)), tag)
        try:
            result = self._load_prefix(tokens, key, self.context.n_ctx, label, progress, cancel, use_cache, prefill,
                                       between)
        except BaseException:
            self.context.keep_cells(seq)
            self.prefix = Prefix()
            raise
        spans = tuple(replace(s, start=s.start + first, end=s.end + first, pages=tuple(p + first for p in s.pages))
                      for s in layout.spans)
        self.layout = replace(layout, spans=spans)
        self.prefix.tokens = tuple(tokens)
        self.shelf[seq] = self.prefix
        return replace(result, n_ctx=self.context.n_ctx)

    def open_shelf(self, n_ctx: int, n_prefixes: int, prefix_cells: int) -> None:
        """Drop what is loaded, its context included, and open a context of `n_ctx` cells for a shelf of
        `n_prefixes` documents side by side in its first `prefix_cells` cells (each its own sequence
        and run of them; load_document(home=...) fills them) and the session's answers decoded
        together after them, whichever of the documents are loaded. UsageError for a model whose memory cannot be
        laid out so (recurrent state or sliding-window layers) or a session of one answer."""
        if self.answers < 2:
            raise UsageError("a shelf serves answers decoded together (Session(answers=N), N > 1)")
        if not 1 <= n_prefixes <= MAX_ANSWERS:
            raise UsageError(f"a shelf holds between 1 and {MAX_ANSWERS} documents (got {n_prefixes})")
        if not 0 < prefix_cells < n_ctx:
            raise UsageError(f"a shelf's documents take between 1 and {n_ctx - 1:,} of its cells (got {prefix_cells:,})")
        self.unload()
        self.parts = self.prompt_parts()
        self.centroid_type = self.centroid_type_for(1)
        self._homes = self.shelf_places = n_prefixes
        self._shelf_cells = prefix_cells
        self.context = self._open_context(n_ctx=n_ctx)
        if self.state_rewinds or self.context.n_swa > 0:
            self.unload()
            raise UsageError(f"{self.model.path.name} keeps memory that is not per cell (recurrent state or "
                             "sliding-window layers): it holds one document at a time")

    def _single_layout(self, label: str, text: str, pages: Sequence[int], tokens: list[int]) -> DocumentLayout:
        """The layout of one document whose prompt prefix is `tokens`: its span between the template's
        head and middle, with the cells where its pages start."""
        head = len(self.tokenize_prompt([Segment(self.parts.head, True)], bos=True))
        middle = len(self.tokenize_prompt([Segment(self.parts.middle, True)], bos=False))
        body = tokens[head : len(tokens) - middle]  # the document's own tokens (its text stripped)
        starts = tuple(head + i for i in self.page_tokens(text, pages, body))
        return DocumentLayout("single", (DocumentSpan(label, head, head + len(body), len(body), head, starts),))

    def page_tokens(self, text: str, pages: Sequence[int], tokens: list[int]) -> tuple[int, ...]:
        """The index in `tokens` (`text.strip()` tokenized) of the token where each page starts (`pages`:
        the offset in `text` of each); () without pages (kvlocal.layout.page_starts)."""
        if not pages or not tokens:
            return ()
        return page_starts(text, pages, tokens, self.vocab.piece_lengths(tokens))

    def _load_prefix(self, tokens: list[int], key: kvstate.StateKey, n_ctx: int, label: str,
                     progress: Callable[[PrefillProgress], None] | None, cancel: threading.Event | None,
                     use_cache: bool, prefill: PrefillConfig, between: Callable[[], None] | None = None) -> LoadResult:
        """Restore the prompt prefix `tokens` from the state saved under `key`, or prefill it (and save
        it; `between`: see load_document)."""
        start = time.perf_counter()
        rebuilt = None
        if use_cache:
            try:
                saved = kvstate.load_state(key)
            except (kvstate.StateCacheError, OSError) as err:
                rebuilt = kvstate.discard_noting(key, f"saved state discarded: {err}")
                saved = None
            if saved is not None:
                saved_tokens, state = saved
                if list(saved_tokens) == tokens and self.restore_state(state):
                    self._mark_tokens(tokens)
                    self._keep_prefix_state(state)
                    return LoadResult(len(tokens), n_ctx, True, time.perf_counter() - start, prefill=prefill)
                rebuilt = kvstate.discard_noting(key, "saved state did not match the document tokens or engine; rebuilt")
        reads = self._prefill(tokens, progress, cancel, prefill, between)
        state = self._compact_swa_cache()
        seconds = time.perf_counter() - start
        if use_cache:
            state = state or self.kv_state()
        self._keep_prefix_state(state)
        saved_to = None
        if use_cache:
            saved_to, note = kvstate.save_noting(key, np.array(tokens, np.int32), state, label)
            rebuilt = kvstate.joined(rebuilt, note)
        return LoadResult(len(tokens), n_ctx, False, seconds, rebuilt, saved=saved_to is not None, prefill=prefill,
                          reads=reads)

    def _prefill(
        self,
        tokens: list[int],
        progress: Callable[[PrefillProgress], None] | None,
        cancel: threading.Event | None,
        prefill: PrefillConfig,
        between: Callable[[], None] | None = None,
    ) -> PrefillReads:
        context = self.context
        self._clear_kv()
        clock = PrefillClock()
        reads = PrefillReads()
        dense, routed = Route(mode="full"), prefill.route()
        if prefill.routed:
            check_region_block(routed.region, self.centroid_block)
        try:
            context.apply_route(dense)
            routing = False
            for i, end, routes in prefill.ubatches(len(tokens), self.n_batch):
                if cancel is not None and cancel.is_set():
                    raise CancelledError("cancelled: the document was not loaded")
                # a routed ubatch reads the sinks, the window before it, itself and the regions its
                # queries choose; the others (and every ubatch of a dense prefill) read every earlier cell.
                # The routed ubatches follow the dense ones, so the route is set once, at the first
                if routes and not routing:
                    context.apply_route(routed, batch_top_k=prefill.top_k)
                    routing = True
                if self.shelf or self._homes != 1:
                    context.feed_sequence(self.prefix.seq, tokens[i:end], i)
                else:
                    context.decode(tokens[i:end])
                stats = context.read_stats(with_regions=False)
                if stats:
                    reads.add(stats)
                elapsed = clock.mark(end)
                if progress:
                    progress(PrefillProgress(end, len(tokens), elapsed, prefill.mode, clock.eta(len(tokens))))
                if between is not None and end < len(tokens):
                    between()  # other sequences' work, under their own route
                    context.apply_route(routed if routing else dense, batch_top_k=prefill.top_k if routing else 0)
        except KeyboardInterrupt:
            self._clear_kv()
            raise CancelledError("interrupted: the document was not loaded and nothing was saved") from None
        except CancelledError:
            self._clear_kv()
            raise
        except RuntimeError as err:
            self._clear_kv()
            raise EngineError(f"prefill failed: {err}") from None
        finally:
            context.apply_route(dense)  # the next document's prefill and answer set their own
        self.n_prefix = len(tokens)
        return reads

    def _compact_swa_cache(self) -> bytes | None:
        """In an iSWA model, the prefilled state reloaded, so that the sliding-window layers' cache holds
        its window packed at the front: as a state restored from the cache does. Otherwise their dense
        view spans every cell the prefill ever used (masked but read), and a fresh document would read
        more, and count a larger dense baseline, than the same document restored. Returns the state."""
        if self.context.n_swa <= 0:
            return None
        n_prefix, n_tokens = self.n_prefix, self.context.n_tokens
        state = self.kv_state()
        if not self.restore_state(state):
            raise EngineError("could not reload the prefilled state of a sliding-window model")
        self.n_prefix = n_prefix
        self.context.continue_at(n_tokens)
        return state

    def _clear_kv(self) -> None:
        if self._homes != 1 or self.shelf:
            self.context.remove_positions(self.prefix.seq)  # a shelf's: its other documents stay
        else:
            self.context.clear()
        self.n_prefix = 0
        self.layout = DocumentLayout()

    @property
    def state_rewinds(self) -> bool:
        """Whether a question is dropped by restoring the document's state rather than by removing its
        cells: a recurrent or hybrid model, whose recurrent layers keep one state per sequence."""
        model = self.context if self.context is not None else self.vocab
        return model.recurrent or model.hybrid

    def _keep_prefix_state(self, state: bytes | None) -> None:
        """Keep the document's state in memory for _rewind where removing cells cannot drop a question."""
        self._prefix_state = (state or self.kv_state()) if self.state_rewinds else None

    def span_text(self, start: int, end: int, prefix: Prefix | None = None) -> str:
        """The text of cells [start, end): the prefix (a set's by cell), then the question and answer,
        whose cells follow positions. A shelf's `prefix`: its own cells only."""
        if self.context is None:
            return ""
        cells = self.layout.cell_tokens
        if prefix is not None and prefix.tokens:
            lo, hi = max(0, start - prefix.first_cell), max(0, end - prefix.first_cell)
            tokens = list(prefix.tokens[lo:hi])
        elif not cells:
            tokens = self.context.tokens(start, max(start, min(end, self.context.n_tokens)))
        else:
            tokens = list(cells[start:min(end, len(cells))])
            if end > len(cells):
                offset = self.n_prefix - len(cells)
                tokens += self.context.tokens(max(start, len(cells)) + offset, min(end + offset, self.context.n_tokens))
        if not tokens:
            return ""
        return self.context.detokenize(tokens, special=True).decode("utf-8", errors="replace")

    def kv_bytes(self) -> int:
        """Bytes of KV state the current sequence holds (what a saved state stores)."""
        return self.context.state_size()

    @property
    def n_layer(self) -> int:
        return int(self.model.info.n_layer or 0)

    def _mark_tokens(self, tokens: list[int]) -> None:
        if not self.shelf and self._homes == 1:  # a shelf's prefix keeps its own tokens
            self.context.mark_tokens(tokens)
        self.n_prefix = len(tokens)

    def kv_state(self) -> bytes:
        """The KV state of the prefix's sequence (what a saved state stores)."""
        return self.context.state(self.prefix.seq)

    def restore_state(self, state: bytes) -> bool:
        """Empty the prefix's sequence (the context, but for a shelf's other documents) and load
        `state` (from kv_state or the cache) into it; whether the engine took it. The prefix is then
        unset: the caller says what the cells hold."""
        self._clear_kv()
        return self.context.load_state(state, self.prefix.seq)

    # -- what the set loader (kvlocal.library) asks of a session --------------------------

    def start_set(self) -> None:
        """Drop what is loaded, its context included, and take the prompt without a document: a set is
        about to be loaded."""
        self.unload()
        self.parts = self.prompt_parts()

    def prefill_state(self, tokens: list[int], *, drop: int, progress: Callable[[PrefillProgress], None] | None = None,
                      cancel: threading.Event | None = None) -> bytes:
        """Prefill `tokens` densely in a context of one sequence (the one held, where it has room), and
        the state of its cells past the first `drop` positions; the context is left empty."""
        n_ctx = max(-(-len(tokens) // CTX_ROUND) * CTX_ROUND, CTX_ROUND)
        if self.context is None or self.context.n_ctx < n_ctx:  # start_set dropped the set's context first
            self.context = None
            self.context = self._open_context(n_ctx=n_ctx)
        self._prefill(tokens, progress, cancel, PrefillConfig())
        self.context.remove_positions(0, 0, drop)
        state = self.kv_state()
        self._clear_kv()
        return state

    def open_set_context(self, n_ctx: int, n_documents: int) -> EngineContext:
        """A fresh context of `n_ctx` cells for a set of `n_documents`: two sequences (the question's
        and a staging one) in one unified cache, centroids of the set's type. The one held is freed first."""
        self.context = None
        self.centroid_type = self.centroid_type_for(n_documents)
        self.context = self._open_context(n_ctx=n_ctx, n_seq_max=2)
        return self.context

    def hold_prefix(self, n_prefix: int, layout: DocumentLayout, label: str) -> None:
        """The context now holds a prompt prefix of `n_prefix` positions laid out as `layout`, on a model
        whose memory is per cell (a question is dropped by removing its cells): questions are asked of it."""
        self.prefix = Prefix(n_prefix=n_prefix, layout=layout, label=label)

    # -- questions ------------------------------------------------------------------------

    @property
    def n_documents(self) -> int:
        """Documents the loaded prefix holds (a set may hold several)."""
        return self.prefix.n_documents

    def prefix_cell_tokens(self, prefix: Prefix | None = None) -> list[int]:
        """The tokens of the prefix (template head, documents, middle) in cell order (None: the current one)."""
        prefix = prefix or self.prefix
        if prefix.layout.cell_tokens:
            return list(prefix.layout.cell_tokens)
        if prefix.tokens:
            return list(prefix.tokens)
        return self.context.tokens(0, prefix.n_prefix)

    def document_at(self, cell: int) -> DocumentSpan | None:
        """The document whose body holds `cell` (None for the template head, the question and the answer)."""
        return span_at(self.layout.spans, cell)

    def read_tally(self, prefix: Prefix | None = None) -> SetReads:
        """An empty tally of the reads of the next answer about `prefix` (None: the current one), by
        document (feed it each step's ReadStats)."""
        prefix = prefix or self.prefix
        return SetReads(prefix.layout.spans, prefix.first_cell + prefix.cells, origin=prefix.first_cell)

    def token_pieces(self, tokens: Sequence[int]) -> list[bytes]:
        """Each token's bytes, control tokens spelled out (what a text index reads)."""
        pieces = {t: self.vocab.detokenize([t], special=True) for t in set(tokens)}
        return [pieces[t] for t in tokens]

    def resolve_answer_route(self, question: str, asked: RouteConfig | Route | None = None,
                             n_documents: int | None = None, prefix: Prefix | None = None,
                             focus: AnswerFocus | None = None) -> Route:
        """The route an answer to `question` takes over the loaded documents (resolve_route with the
        prefix's cells and the question's hints), as `ask` resolves it. A shelf's `prefix`: as `ask`
        resolves it for that document alone, its hints at the prefix's own cells. A `focus`: as one
        document of the cells it sees, its hints within that document; without one the route's focus
        is the set's (what the answer read)."""
        prefix = prefix or self.prefix
        asked = asked or MODEL_ROUTE
        if focus is not None:
            facts = RouteFacts(1, focus.n_cells, self._hint_finder(question, prefix, focus.span))
            return replace(resolve_route(asked, self.calibrated_route, facts), focus="hinted")
        facts = RouteFacts(n_documents or prefix.n_documents, prefix.cells, self._hint_finder(question, prefix))
        route = replace(resolve_route(asked, self.calibrated_route, facts), focus="set")
        if prefix.first_cell and route.hint_cells:
            route = replace(route, hint_cells=tuple(c + prefix.first_cell for c in route.hint_cells))
        return route

    def _answer_focus(self, question: str, asked: RouteConfig | Route) -> DocumentSpan | None:
        """The document a focused answer to `question` reads (`asked.focus` "hinted"): the one of a set
        of several that holds its best hint; None where the answer reads the whole set (and where the
        staging sequence is an answer's: answers decoded together)."""
        if asked.focus != "hinted" or self.n_documents < 2 or self.answers > 1:
            return None
        if asked.region > SET_LAYOUT_UNIT:
            return None  # the set's route refuses it (resolve_route): a region would hold two documents' cells
        skip = -(-asked.sinks // asked.region)
        cells = self._hint_finder(question, self.prefix)(1, asked.region, skip)
        return self.document_at(cells[0]) if cells else None

    def _enter_focus(self, span: DocumentSpan) -> AnswerFocus:
        """Give STAGING_SEQ the set's template head and `span`'s cells, and decode the prompt's middle
        into it after them (densely, as the set's was)."""
        spans, cell_tokens = self.layout.spans, self.layout.cell_tokens
        head, middle = spans[0].start, list(cell_tokens[spans[-1].end:])
        context = self.context
        self.prefix.focused = True
        context.share_cells(QUESTION_SEQ, STAGING_SEQ, 0, head)
        context.share_cells(QUESTION_SEQ, STAGING_SEQ, span.start, span.end)  # whatever the layout's positions
        end = span.position + (span.end - span.start)
        if middle:
            context.apply_route(Route(mode="full"))
            context.feed_sequence(STAGING_SEQ, middle, end)
        return AnswerFocus(span, head, len(middle))

    def rewind(self) -> None:
        """Drop the previous question and answer of the document's own sequence (kvlocal.batch starts so;
        a shelf's sequences hold their documents only)."""
        if self.shelf:
            return
        with self._lock:
            self._rewind()

    def _hint_finder(self, question: str, prefix: Prefix, within: DocumentSpan | None = None):
        """The question's hints in `prefix` (RouteFacts.find_hints): its text indexed on first use;
        those of the places in the document `within` only, where it is given."""
        def find(n: int, region: int, skip_regions: int) -> list[int]:
            if prefix.text_index is None:
                prefix.text_index = TextIndex.of(self.token_pieces(self.prefix_cell_tokens(prefix)))
            cells = hint_cells(prefix.text_index, question, n, region, skip_regions=skip_regions)
            if within is None:
                return cells
            # a hint is a pair: the cell of the word, the cell its sentence ends at
            pairs = [cells[i : i + 2] for i in range(0, len(cells), 2)]
            return [c for pair in pairs if within.start <= pair[0] < within.end for c in pair]
        return find

    def _rewind(self) -> None:
        """Drop the previous question and answer, keep the document."""
        if self.prefix.focused:
            self.context.remove_positions(STAGING_SEQ)
            self.prefix.focused = False
        if self._prefix_state is not None:
            # recurrent layers: their state after the answer cannot be cut back, so the document's
            # state (attention cells and recurrent state) is restored as a saved one is
            if self.context.n_tokens == self.n_prefix:
                return
            n_prefix, layout = self.n_prefix, self.layout
            if not self.restore_state(self._prefix_state):
                raise EngineError("could not restore the document's state after the previous answer")
            self.n_prefix, self.layout = n_prefix, layout
            self.context.continue_at(n_prefix)
            return
        self.context.truncate(self.n_prefix)

    def _step(self, into: AnswerTokens, token: int, want_regions: bool) -> ReadStats | None:
        into.decode([token])
        return self.context.read_stats(with_regions=want_regions)

    def _read_question(self, into: AnswerTokens, q_tokens: list[int], route: Route, summary: AnswerSummary,
                       want_regions: bool) -> None:
        """Feed the question's tokens as `route.question` says, adding what they read to `summary`."""
        if route.question == "steps":
            for token in q_tokens:
                stats = self._step(into, token, want_regions)
                if stats:
                    summary.add(stats)
            return
        self.context.apply_route(route, batch_top_k=route.question_batch_top_k)
        try:
            for i in range(0, len(q_tokens), self.n_batch):
                into.decode(q_tokens[i : i + self.n_batch])
                stats = self.context.read_stats(with_regions=want_regions)
                if stats:
                    summary.add(stats)
        finally:
            self.context.apply_route(route)  # the answer's steps, and the next document's prefill, as usual

    def ask(
        self,
        question: str,
        *,
        route: RouteConfig | Route | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        seed: int = 0,
        want_regions: bool = False,
        cancel: threading.Event | None = None,
        n_documents: int | None = None,
    ) -> Answer:
        """The answer, decoded as it is iterated: an AnswerPiece per token; `summary()` afterwards.
        `route`: the options asked (None: MODEL_ROUTE), or a Route resolved before (route_for), perhaps
        tuned; the answer takes it as resolve_route resolves it for this model, the loaded documents
        and the question. `n_documents`: resolve it as for a set of that many (None: those loaded; the
        library eval asks a concatenation as its set).

        The question's tokens read the document as `route.question` says: in one batch routed to
        `route.question_top_k` regions (read once for all of them), in one dense batch, or token by
        token through the route. Every answer token is decoded on its own through the route. Setting
        `cancel` ends the answer after the current token (its summary holds what was decoded).
        """
        asked = route or MODEL_ROUTE
        return Answer(self._decode_answer(question, asked, n_documents or self.n_documents, max_tokens, temperature,
                                          seed, want_regions, cancel))

    def route_for(self, route: RouteConfig | Route | None = None) -> Route:
        """The route the next answer takes as far as it is known before the question (resolve_route
        without the document's cells and the question's hints): `route` (None: MODEL_ROUTE) on this
        model over the documents loaded."""
        return resolve_route(route or MODEL_ROUTE, self.calibrated_route, RouteFacts(self.n_documents))

    def _decode_answer(self, question: str, asked: RouteConfig | Route, n_documents: int, max_tokens: int,
                       temperature: float, seed: int, want_regions: bool, cancel: threading.Event | None,
                       ) -> Generator[AnswerPiece, None, AnswerSummary]:
        if self.shelf:
            raise UsageError("the session holds a shelf of documents: its answers decode through kvlocal.batch")
        if self.context is None or self.n_prefix == 0:
            raise UsageError("no document is loaded")
        check_ask_settings(question, max_tokens, temperature, seed)
        check_region_block(asked.region, self.centroid_block)
        context = self.context
        with self._lock:
            self._rewind()
            span = self._answer_focus(question, asked)
            focus = self._enter_focus(span) if span is not None else None
            route = self.resolve_answer_route(question, asked, n_documents, focus=focus)
            context.set_hints(route.hint_cells)
            context.apply_route(route)
            into = AnswerTokens(context, focus)
            q_tokens = self.tokenize_prompt(self.parts.question_segments(question), bos=False)
            used = self.prefix_cells + (focus.added if focus else 0)
            room = context.n_ctx - used - len(q_tokens)
            if room < 1:
                raise ContextOverflowError(
                    f"the question ({len(q_tokens):,} tokens) does not fit in the {context.n_ctx - used:,} "
                    f"tokens of context left after the document; a larger context leaves more room", setting="ctx")
            capped = room < max_tokens
            max_tokens = min(max_tokens, room)
            summary = AnswerSummary("", len(q_tokens), 0, 0.0, route, model_layers=self.n_layer,
                                    placement=self.layer_placement(), focus=focus.span.label if focus else "")
            self._read_question(into, q_tokens, route, summary, want_regions)
            summary.question_bytes_read, summary.question_bytes_dense = summary.bytes_read, summary.bytes_dense
            rng = np.random.default_rng(seed)
            answer_text = AnswerText(context, self.parts.stops)
            pieces: list[str] = []
            wire = self._wire_bytes()
            start = time.perf_counter()
            try:
                for _ in range(max_tokens):
                    if cancel is not None and cancel.is_set():
                        break
                    token = _sample(context.last_logits(), temperature, rng)
                    text = answer_text.accept(token)
                    if text is None:
                        break
                    stats = self._step(into, token, want_regions)
                    if stats:
                        summary.add(stats)
                    summary.n_answer_tokens += 1
                    pieces.append(text)
                    yield AnswerPiece(text, token, stats)
            except KeyboardInterrupt:
                pieces.append(answer_text.finish())
                summary.text = "".join(pieces)
                summary.decode_seconds = time.perf_counter() - start
                raise
            tail = answer_text.finish()
            if tail:
                pieces.append(tail)
                yield AnswerPiece(tail, -1, None)
            summary.decode_seconds = time.perf_counter() - start
            summary.wire_sent, summary.wire_received = (b - a for a, b in zip(wire, self._wire_bytes()))
            summary.text = "".join(pieces)
            summary.context_full = capped and summary.n_answer_tokens == max_tokens
            return summary

    def plain_loop(self, question: str, n_tokens: int) -> tuple[int, float]:
        """Dense decoding of `n_tokens` answer tokens by llama.cpp's own loop (EngineContext.greedy_loop_seconds)
        after the question read densely: (tokens, seconds), the reference for kvlocal's decode loop."""
        if self.context is None or self.n_prefix == 0:
            raise UsageError("no document is loaded")
        context = self.context
        with self._lock:
            self._rewind()
            context.apply_route(Route(mode="full"))
            q_tokens = self.tokenize_prompt(self.parts.question_segments(question), bos=False)
            for i in range(0, len(q_tokens), self.n_batch):
                context.decode(q_tokens[i : i + self.n_batch])
            return context.greedy_loop_seconds(int(np.argmax(context.last_logits())), n_tokens)

    def answer(self, question: str, **kwargs) -> AnswerSummary:
        """ask() without streaming: the finished answer's summary."""
        return self.ask(question, **kwargs).summary()

    def unload(self) -> None:
        """Free the context and its KV cache (the next load_document starts as a new process would)."""
        with self._lock:
            self.context = None
            self.prefix = Prefix()
            self.shelf = {}
            self._homes = 1
            self.shelf_places = self._shelf_cells = 0

    def close(self) -> None:
        self.context = None
        self.vocab = None


def check_ask_settings(question: str, max_tokens: int, temperature: float, seed: int) -> None:
    """UsageError unless the question and the answer settings make sense (the CLI checks them before any work)."""
    if not question.strip():
        raise UsageError("the question is empty")
    if max_tokens < 1:
        raise UsageError(f"the answer must be allowed at least 1 token (got {max_tokens})", setting="max_tokens")
    if not (math.isfinite(temperature) and 0 <= temperature <= MAX_TEMPERATURE):
        raise UsageError(f"the temperature must be between 0 (greedy) and {MAX_TEMPERATURE:g} (got {temperature})",
                         setting="temperature")
    if not 0 <= seed < 2**32:
        raise UsageError(f"the sampling seed must be between 0 and {2**32 - 1} (got {seed})", setting="seed")


def _sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    scaled = (logits - logits.max()) / temperature
    probs = np.exp(scaled)
    probs /= probs.sum()
    return int(rng.choice(len(probs), p=probs))
