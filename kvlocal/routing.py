"""Routing settings and per-step KV read statistics: plain values. The engine applies the settings
and counts the statistics (kvlocal.engine.EngineContext.apply_route, .read_stats)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum

import numpy as np

from kvlocal.errors import UsageError
from kvlocal.route_settings import (
    SET_LAYOUT_UNIT,
    ATTENTION_PATHS,
    CENTROID_BLOCKS,
    CENTROID_TYPES,
    DEFAULT_ATTENTION,
    DEFAULT_HINTS,
    DEFAULT_LAYER_TOP_K,
    DEFAULT_KEEP,
    DEFAULT_MODE,
    DEFAULT_PIN,
    DEFAULT_FOLLOW,
    DEFAULT_FOCUS,
    FOCI,
    DEFAULT_PREFILL,
    DEFAULT_PREFILL_FROM,
    DEFAULT_PREFILL_TOP_K,
    DEFAULT_PREFILL_UBATCH,
    DEFAULT_QUESTION,
    DEFAULT_QUESTION_TOP_K,
    DEFAULT_REGION,
    DEFAULT_SHORTLIST,
    SHORTLIST_AUTO,
    auto_shortlist,
    DEFAULT_SINKS,
    DEFAULT_TOP_K,
    DEFAULT_WINDOW,
    LIBRARY_HINTS,
    LIBRARY_QUESTION,
    LIBRARY_TOP_K,
    MAX_CTX,
    MAX_REGION,
    MAX_SEED,
    MAX_SHORTLIST,
    MAX_SINKS,
    MAX_TOP_K,
    MAX_WINDOW,
    ModelRoute,
    PREFILL_MODES,
    PREFILL_SHORTLIST_SHARE,
    QUESTION_PASSES,
    parse_layer_top_k,
)


class RouteMode(IntEnum):
    """enum llama_kv_route_mode (LLAMA_KV_ROUTE_<name>); tests/test_engine_header.py checks it against llama.h."""

    FULL = 0
    GEOMETRIC = 1
    WINDOW = 2
    RANDOM = 3


MODE_NAMES = {mode.name.lower(): mode for mode in RouteMode}


class RouteAttention(IntEnum):
    """enum llama_kv_route_attn (LLAMA_KV_ROUTE_ATTN_<name>): how a decode step reads its regions;
    checked against llama.h like RouteMode."""

    ATTN_AUTO = 0
    ATTN_GATHER = 1
    ATTN_IN_PLACE = 2


ATTENTION_CODES = dict(zip(ATTENTION_PATHS, RouteAttention))


class Fallback(IntEnum):
    """enum llama_kv_route_fallback (LLAMA_KV_ROUTE_<name>): why a ubatch was not routed; checked
    against llama.h like RouteMode."""

    OK = 0
    MODE_FULL = 1
    NO_CENTROIDS = 2
    V_TRANS = 3
    MODEL_FEATURE = 4
    NOT_SUPPORTED = 5
    BATCH_DENSE = 6
    MULTI_SEQ = 7


FALLBACK_REASONS = {
    Fallback.OK: "",
    Fallback.MODE_FULL: "dense mode",
    Fallback.NO_CENTROIDS: "the KV cache keeps no region centroids (several streams, MLA, or a centroid block of 0)",
    Fallback.V_TRANS: "the V cache is transposed (flash attention is off)",
    Fallback.MODEL_FEATURE: "the model uses ALiBi, learned sinks, a KQ bias or logit soft-capping",
    Fallback.NOT_SUPPORTED: ("the model's attention does not use the standard KV cache (e.g. recurrent memory, "
                             "or hybrid memory with sliding-window layers)"),
    Fallback.BATCH_DENSE: "a batch of several tokens read densely",
    Fallback.MULTI_SEQ: "a batch held tokens of several sequences",
}
# fallbacks that are a choice, not a limit of the model or the cache: not reported as a fallback
CHOSEN_FALLBACKS = (Fallback.OK, Fallback.MODE_FULL, Fallback.BATCH_DENSE)


def check_centroid_block(centroid_block: int) -> None:
    """UsageError unless the block is one the engine keeps centroids for (0: no centroids, every step dense)."""
    if centroid_block != 0 and centroid_block not in CENTROID_BLOCKS:
        raise UsageError(f"the centroid block must be one of {', '.join(map(str, CENTROID_BLOCKS))} tokens "
                         f"(got {centroid_block})", setting="centroid_block")


def check_centroid_type(centroid_type: str) -> None:
    """UsageError unless the engine can keep centroids in this type."""
    if centroid_type not in CENTROID_TYPES:
        raise UsageError(f"the centroid type must be one of {', '.join(CENTROID_TYPES)} (got {centroid_type!r})",
                         setting="centroid_type")


def check_region_block(region: int, centroid_block: int) -> None:
    """A region is scored from whole centroid blocks: UsageError unless the block divides it (0: no centroids)."""
    check_centroid_block(centroid_block)
    if centroid_block and region % centroid_block:
        raise UsageError(f"a region of {region} tokens must be a multiple of the centroid block ({centroid_block})",
                         setting="region")


def _check_settings(route: RouteConfig) -> None:
    """UsageError, naming the setting, unless every setting of `route` that is given (not None) is one
    the engine can follow. The engine takes these as 32-bit ints: a bigger value would wrap in ctypes, not fail."""
    if route.mode not in MODE_NAMES:
        raise UsageError(f"unknown route mode {route.mode!r}; choose one of {', '.join(MODE_NAMES)}", setting="route")
    if route.region <= 0 or route.region & (route.region - 1) or MAX_REGION % route.region:
        raise UsageError(f"the region size must be a power of two that divides {MAX_REGION} (got {route.region})",
                         setting="region")
    if route.attention not in ATTENTION_PATHS:
        raise UsageError(f"the attention path must be one of {', '.join(ATTENTION_PATHS)} (got {route.attention!r})",
                         setting="attention")
    if route.focus not in FOCI:
        raise UsageError(f"the focus must be one of {', '.join(FOCI)} (got {route.focus!r})", setting="focus")
    if route.question is not None and route.question not in QUESTION_PASSES:
        raise UsageError(f"the question pass must be one of {', '.join(QUESTION_PASSES)} (got {route.question!r})",
                         setting="question_pass")
    for setting, words, value, top in (
        ("top_k", "the regions routed per step (top-k)", route.top_k, MAX_TOP_K),
        ("question_top_k", "the regions a routed question reads", route.question_top_k, MAX_TOP_K),
        ("window", "the window", route.window, MAX_WINDOW),
        ("sinks", "the sink tokens", route.sinks, MAX_SINKS),
        ("pin", "the pinned regions", route.pin, MAX_TOP_K),
        ("follow", "the regions read after the first choices", route.follow, MAX_TOP_K),
        ("hints", "the hinted regions", route.hints, MAX_TOP_K),
    ):
        if value is not None and not 0 <= value <= top:
            raise UsageError(f"{words} must be between 0 and {top:,} (got {value})", setting=setting)
    if not 0 <= route.seed <= MAX_SEED:
        raise UsageError(f"the random route's seed must be between 0 and {MAX_SEED} (got {route.seed})", setting="seed")
    if not (route.shortlist == SHORTLIST_AUTO or 0 <= route.shortlist <= MAX_SHORTLIST):
        raise UsageError(f"the shortlist must be between 0 and {MAX_SHORTLIST:,}, or auto (got {route.shortlist})",
                         setting="shortlist")
    if not (math.isfinite(route.keep) and 0 <= route.keep < 1):
        raise UsageError(f"the selection memory's keep must be at least 0 and below 1 (got {route.keep})",
                         setting="keep")
    if route.layer_top_k:
        try:
            parse_layer_top_k(route.layer_top_k)
        except ValueError as exc:
            raise UsageError(f"--layer-top-k: {exc}", setting="layer_top_k") from None
        if route.top_k is not None and route.top_k < 1:
            raise UsageError("budgets per layer need a top-k of at least 1 for the other layers", setting="layer_top_k")


@dataclass(frozen=True)
class RouteConfig:
    """The route as it was asked for (the command line's options, the TUI's keys, an eval's grid): how
    decode steps read the KV cache. Window and sinks are in tokens, rounded up to regions. A setting
    left None was not given: the model's calibrated route and the documents decide it (resolve_route;
    DEFAULT_ROUTE gives none of them)."""

    mode: str = DEFAULT_MODE
    region: int = DEFAULT_REGION
    top_k: int | None = DEFAULT_TOP_K  # None: the model's, or a set's LIBRARY_TOP_K
    window: int = DEFAULT_WINDOW
    sinks: int = DEFAULT_SINKS
    seed: int = 0
    shortlist: int = DEFAULT_SHORTLIST  # regions the coarse pass shortlists (0: one level; SHORTLIST_AUTO: by document)
    keep: float = DEFAULT_KEEP  # selection memory: decay per step of a region's remembered share (0: none)
    question: str | None = DEFAULT_QUESTION  # how the question's tokens read the document: routed, dense or steps
    question_top_k: int = DEFAULT_QUESTION_TOP_K  # regions the question's routed batch reads
    pin: int = DEFAULT_PIN  # regions the dense question pass pins for the answer (0: none)
    follow: int = DEFAULT_FOLLOW  # first choices whose next region a step also reads (0: none)
    hints: int | None = DEFAULT_HINTS  # regions the question's rarest words hint (kvlocal/hints.py; 0: none)
    layer_top_k: str | None = DEFAULT_LAYER_TOP_K  # e.g. "16-23=8": those layers' regions per step, the others top_k
    attention: str = DEFAULT_ATTENTION  # how a step reads its regions: auto, gather or in-place (ATTENTION_PATHS)
    focus: str = DEFAULT_FOCUS  # what a set's answer reads: every document, or the hinted one (FOCI)

    def __post_init__(self) -> None:
        _check_settings(self)


# no setting given: a set takes its own route, the model its calibrated budget (the command line's defaults)
DEFAULT_ROUTE = RouteConfig(top_k=None, question=None, hints=None, layer_top_k=None)
# the budget not given: the model's calibrated one (what Session.ask takes without a route)
MODEL_ROUTE = RouteConfig(top_k=None, layer_top_k=None)


@dataclass(frozen=True)
class Route(RouteConfig):
    """The route an answer takes, resolved (resolve_route): every setting given, what the engine is told
    (EngineContext.apply_route, .set_hints) and the answer's summary describes. `shortlist` is
    SHORTLIST_AUTO and `hint_cells` empty while the document or the question is not known yet (a route
    shown before the question); the engine then takes the automatic shortlist for the cells it holds."""

    shortlist_floor: int = 0  # an automatic shortlist is at least this many regions (the model's route)
    hint_cells: tuple[int, ...] = ()  # the cells the question's rare words hint (kvlocal/hints.py)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("top_k", "question", "hints", "layer_top_k"):
            if getattr(self, name) is None:
                raise ValueError(f"a resolved route has every setting; {name} is None (resolve_route gives it)")
        if not 0 <= self.shortlist_floor <= MAX_SHORTLIST:
            raise UsageError(f"the shortlist's floor must be between 0 and {MAX_SHORTLIST:,} (got {self.shortlist_floor})",
                             setting="shortlist")

    @property
    def pins(self) -> int:
        """Regions the answer's steps read by the dense question's attention: `pin`, at most top-k,
        where it can act (geometric routing with the selection memory and the dense question), else 0."""
        if self.route_mode != RouteMode.GEOMETRIC or not self.keep or self.question != "dense":
            return 0
        return min(self.pin, self.top_k)

    @property
    def follows(self) -> int:
        """First choices whose next region the answer's steps also read: `follow`, at most top-k, where it
        can act (geometric routing with the selection memory), else 0."""
        if self.route_mode != RouteMode.GEOMETRIC or not self.keep:
            return 0
        return min(self.follow, self.top_k)

    @property
    def hinted(self) -> int:
        """Matches of the question's words whose regions the answer reads (geometric routing only)."""
        return self.hints if self.route_mode == RouteMode.GEOMETRIC else 0

    def layer_budgets(self, n_layer: int) -> list[int]:
        """The regions each of a model's `n_layer` layers routes per single-token step: top-k, or
        what layer_top_k gives it ([] when it gives none); UsageError for a layer the model lacks."""
        if not self.layer_top_k:
            return []
        budgets = [self.top_k] * n_layer
        for first, last, k in parse_layer_top_k(self.layer_top_k):
            if last >= n_layer:
                raise UsageError(f"--layer-top-k {self.layer_top_k}: the model has layers 0-{n_layer - 1}",
                                 setting="layer_top_k")
            budgets[first : last + 1] = [k] * (last - first + 1)
        return budgets

    @property
    def route_mode(self) -> RouteMode:
        return MODE_NAMES[self.mode]

    @property
    def question_batch_top_k(self) -> int:
        """Regions a batch of question tokens routes to (0: the batch reads densely)."""
        return self.question_top_k if self.question == "routed" else 0

    def shortlist_at(self, n_cells: int) -> int:
        """The shortlist over a cache of `n_cells` cells: the one set, or the automatic one for them."""
        if self.shortlist != SHORTLIST_AUTO:
            return self.shortlist
        return max(self.shortlist_floor, auto_shortlist(-(-n_cells // self.region)))

    def describe(self) -> str:
        within = ", within the document of the question's best hint" if self.focus == "hinted" else ""
        if self.route_mode == RouteMode.FULL:
            return "full (dense attention)" + within
        text = f"{self.mode}: top-{self.top_k} regions of {self.region} tokens + {self.sinks} sink + {self.window} window tokens"
        if self.layer_top_k:
            text += f" (layers {self.layer_top_k})"
        if self.route_mode == RouteMode.GEOMETRIC and self.shortlist == SHORTLIST_AUTO:
            text += ", shortlist by document"
        elif self.route_mode == RouteMode.GEOMETRIC and self.shortlist:
            text += f", shortlist {self.shortlist}"
        if self.route_mode == RouteMode.GEOMETRIC and self.keep:
            text += f", keep {self.keep:g}"
        if self.pins:
            text += f", {self.pins} pinned by the question"
        if self.follows:
            text += f", the next region of the first {self.follows} read too"
        if self.hinted:
            text += f", {self.hinted} hinted by the question's rarest words"
        if self.attention != DEFAULT_ATTENTION:
            text += f", attention {self.attention}"
        text += within
        text += "; " + self.describe_question()
        return text

    def describe_question(self) -> str:
        if self.question == "steps":
            return "question decoded token by token through the same route"
        if self.question == "dense" or self.route_mode == RouteMode.FULL:
            return "question read in one dense pass"
        return f"question read in one pass over top-{self.question_top_k} regions"


# (n, region, skip_regions) -> the cells the question's rare words hint (kvlocal.hints.hint_cells)
HintFinder = Callable[[int, int, int], Sequence[int]]


@dataclass(frozen=True)
class RouteFacts:
    """What a route depends on besides the options and the model: the documents loaded, the cells the
    prompt prefix holds (None: no document yet) and how to find the question's hints (None: no
    question yet)."""

    n_documents: int = 1
    n_cells: int | None = None
    find_hints: HintFinder | None = None


def resolve_route(asked: RouteConfig | Route, calibrated: ModelRoute, facts: RouteFacts = RouteFacts()) -> Route:
    """The route an answer takes, once: the options `asked` (a Route: one resolved before, perhaps
    tuned, taken as it is), with what was not given taken from the model's `calibrated` route and from
    the documents, then the facts of the document and the question.

    - A set of several documents read whole (focus "set") answers with the library route (route_settings:
      LIBRARY_TOP_K, LIBRARY_HINTS, LIBRARY_QUESTION) where geometric routing asked for none of top-k,
      hints and the question pass; a question that gets no hint there takes the route one document would.
      (A focused answer is resolved as one document: Session.resolve_answer_route.)
    - Where top-k and the budgets per layer were not given, the model's calibrated route sets them,
      and the floor of an automatic shortlist.
    - An automatic shortlist follows the prefix's cells; the hinted cells are found, and top-k is raised
      to the regions they name where it is smaller (a hint whose sentence runs on into the next region
      names both, and the engine reads hints in place of top-k choices), the pins as they were."""
    if isinstance(asked, Route):
        route, unhinted = asked, None
    else:
        route, unhinted = _asked_route(asked, calibrated, facts.n_documents)
    if facts.n_documents < 2:
        route = replace(route, focus="set")  # one document: nothing to focus on
    if facts.n_documents > 1 and route.region > SET_LAYOUT_UNIT:
        raise UsageError(f"a set of documents is laid out in {SET_LAYOUT_UNIT}-cell units, so its regions are at most "
                         f"{SET_LAYOUT_UNIT} tokens (got --region {route.region})", setting="region")
    if facts.find_hints is not None:
        skip = -(-route.sinks // route.region)
        cells = tuple(facts.find_hints(route.hinted, route.region, skip)) if route.hinted else ()
        route = replace(unhinted if unhinted is not None and not cells else route, hint_cells=cells)
    if facts.n_cells is not None:
        route = replace(route, shortlist=route.shortlist_at(facts.n_cells))
        n_regions = _hinted_regions(route, facts.n_cells)
        if n_regions > route.top_k:
            route = replace(route, top_k=n_regions, pin=route.pins)
    return route


def _asked_route(asked: RouteConfig, calibrated: ModelRoute, n_documents: int) -> tuple[Route, Route | None]:
    """The route of the options over `n_documents` documents on a model whose route is `calibrated`,
    and, where it is a set's library route, the route a question without hints takes instead."""
    settings = {f.name: getattr(asked, f.name) for f in fields(RouteConfig)}
    layers = DEFAULT_LAYER_TOP_K if asked.layer_top_k is None else asked.layer_top_k
    settings.update(top_k=DEFAULT_TOP_K if asked.top_k is None else asked.top_k, layer_top_k=layers,
                    question=DEFAULT_QUESTION if asked.question is None else asked.question,
                    hints=DEFAULT_HINTS if asked.hints is None else asked.hints)
    own = Route(**settings)
    if asked.top_k is None and asked.layer_top_k is None:
        floor = calibrated.shortlist_floor if asked.shortlist == SHORTLIST_AUTO else 0
        own = replace(own, top_k=calibrated.top_k, layer_top_k=calibrated.layer_top_k, shortlist_floor=floor)
    follows_set = asked.focus == "set" and asked.top_k is None and asked.hints is None and asked.question is None
    if not follows_set or n_documents < 2 or own.route_mode != RouteMode.GEOMETRIC:
        return own, None
    library = Route(**{**settings, "top_k": LIBRARY_TOP_K, "hints": LIBRARY_HINTS, "question": LIBRARY_QUESTION})
    return library, own


def _hinted_regions(route: Route, n_cells: int) -> int:
    """The regions of the hinted cells the engine can read in place of a top-k choice: past the sinks,
    and before the window (which takes the prefix's last `route.window` cells and what follows them;
    a hint there is read anyway)."""
    first = -(-route.sinks // route.region)
    end = n_cells - route.window
    regions = {c // route.region for c in route.hint_cells}
    return len({r for r in regions if r >= first and r * route.region < end})


@dataclass(frozen=True)
class PrefillConfig:
    """How a document's ubatches read the cache while it is prefilled: all densely, or, from
    `start` tokens on, each routed to `top_k` regions per layer and KV head (with the sinks, the
    window before it and itself), chosen by its queries together."""

    mode: str = DEFAULT_PREFILL
    top_k: int = DEFAULT_PREFILL_TOP_K
    start: int = DEFAULT_PREFILL_FROM  # document tokens before the first routed ubatch
    ubatch: int = DEFAULT_PREFILL_UBATCH  # tokens per routed ubatch: its queries choose one set of regions

    def __post_init__(self) -> None:
        if self.mode not in PREFILL_MODES:
            raise UsageError(f"the prefill must be one of {', '.join(PREFILL_MODES)} (got {self.mode!r})",
                             setting="prefill")
        if not 1 <= self.top_k <= MAX_TOP_K:
            raise UsageError(f"the regions a routed prefill reads per ubatch must be between 1 and {MAX_TOP_K:,} "
                             f"(got {self.top_k})", setting="prefill_top_k")
        if not 0 <= self.start <= MAX_CTX:
            raise UsageError(f"the routed prefill's start must be between 0 and {MAX_CTX:,} tokens "
                             f"(got {self.start})", setting="prefill_from")
        if not 1 <= self.ubatch <= MAX_CTX:
            raise UsageError(f"the routed prefill's ubatch must be between 1 and {MAX_CTX:,} tokens "
                             f"(got {self.ubatch})", setting="prefill_ubatch")

    @property
    def routed(self) -> bool:
        return self.mode == "routed"

    def route(self) -> Route:
        """The route a routed ubatch follows (a one-token last ubatch decodes through it as a step): the
        coarse centroids shortlist PREFILL_SHORTLIST_SHARE x top-k regions, their fine ones choose."""
        shortlist = min(MAX_SHORTLIST, PREFILL_SHORTLIST_SHARE * self.top_k)
        return Route(mode="geometric", top_k=self.top_k, shortlist=shortlist, keep=0.0)

    def routes_at(self, pos: int) -> bool:
        """Whether the ubatch whose first token sits at `pos` is routed."""
        return self.routed and pos >= self.start

    def ubatches(self, n_tokens: int, n_batch: int) -> list[tuple[int, int, bool]]:
        """(first, end, routed) of every ubatch of a document of `n_tokens` tokens: dense ones of
        `n_batch` tokens, routed ones (from the start on) of the routed ubatch size, at most `n_batch`."""
        out, pos = [], 0
        while pos < n_tokens:
            routed = self.routes_at(pos)
            end = min(n_tokens, pos + (min(self.ubatch, n_batch) if routed else n_batch))
            out.append((pos, end, routed))
            pos = end
        return out

    def routes_any(self, n_tokens: int, n_batch: int) -> bool:
        """Whether any ubatch of a document of `n_tokens` tokens is routed (a document no longer than
        the start is prefilled exactly as a dense prefill would)."""
        return any(routed for _, _, routed in self.ubatches(n_tokens, n_batch))

    def state_tag(self, centroid_block: int, n_batch: int, centroid_type: str = "f16") -> str:
        """What the saved state's key (and an eval row) records of this prefill: "dense", or every
        routed setting that shapes the K/V bytes, the centroid block and type and the ubatch size
        included (they decide which regions are chosen, and which ubatches)."""
        if not self.routed:
            return "dense"
        r = self.route()
        return (f"routed:top{self.top_k}:from{self.start}:region{r.region}:sinks{r.sinks}:window{r.window}"
                f":shortlist{r.shortlist}:block{centroid_block}:ubatch{n_batch}"
                + (f":routed-ubatch{self.ubatch}" if self.ubatch < n_batch else "")
                + (f":centroids-{centroid_type}" if centroid_type != "f16" else ""))

    def describe(self) -> str:
        if not self.routed:
            return "dense"
        size = f" of {self.ubatch} tokens" if self.ubatch != DEFAULT_PREFILL_UBATCH else ""
        return f"routed (top-{self.top_k} regions per ubatch{size} from token {self.start:,})"


@dataclass
class ReadStats:
    """What one decode step read from the KV cache, as counted by the engine from the gathered rows."""

    mode: RouteMode
    fallback: int
    n_layer: int
    n_layer_routed: int
    n_head_kv: int
    n_kv: int
    region_size: int
    n_sel: int
    rows_read: int
    rows_dense: int
    bytes_kv: int
    bytes_meta: int
    bytes_dense: int
    layers: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # [n_layer_routed]
    # [layer, head, n_sel]; -1 after the regions of a layer that read fewer than n_sel (budgets per layer)
    regions: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0), np.int32))
    # a ubatch of one step of each of several sequences: what each read, by sequence id (the totals
    # above sum them; the regions are each sequence's own)
    sequences: dict[int, ReadStats] = field(default_factory=dict)
    # where the sequence sees only part of the view (a shelf, see seen_by): its prefix's first cell,
    # the prefix's cells and its own cells after them (its question and answer so far); None: all of it
    seen: tuple[int, int, int] | None = None

    def seen_by(self, first_cell: int, prefix_cells: int, own_cells: int) -> ReadStats:
        """This step of a sequence that sees, of the view's n_kv cells, only a prefix's `prefix_cells`
        from `first_cell` and `own_cells` of its own (a shelf's answer: the other documents' cells are
        masked out for it, and neither dense attention nor a layer that attends densely reads them): the
        dense figures and the dense layers' reads counted over the cells it sees, as the engine counts
        them over the view."""
        cells = prefix_cells + own_cells
        if self.n_kv <= cells or not self.rows_dense:
            return self
        per_row = self.bytes_dense // self.rows_dense  # the engine's K + V bytes of one cell of one KV head
        unseen = (self.n_kv - cells) * self.n_head_kv
        n_dense = max(0, self.n_layer - self.n_layer_routed)
        return replace(self, rows_dense=self.rows_dense - unseen * self.n_layer,
                       bytes_dense=self.bytes_dense - unseen * self.n_layer * per_row,
                       rows_read=self.rows_read - unseen * n_dense, bytes_kv=self.bytes_kv - unseen * n_dense * per_row,
                       seen=(first_cell, prefix_cells, own_cells))

    @property
    def bytes_read(self) -> int:
        return self.bytes_kv + self.bytes_meta

    @property
    def reduction(self) -> float:
        return self.bytes_dense / self.bytes_read if self.bytes_read else 1.0

    @property
    def fallback_reason(self) -> str:
        return FALLBACK_REASONS.get(self.fallback, f"fallback code {self.fallback}")
