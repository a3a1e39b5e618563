"""Routing settings and their defaults: the one place to change them.

No numpy, ctypes or engine import here, so the CLI can read the defaults for its --help without
loading anything. `routing.RouteConfig` validates them and `routing.resolve_route` resolves them; the CLI, session, evals, bench
and TUI all read these names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# routing modes: geometric is kvlocal's routing, full the dense reference, window and random the controls
MODES = ("full", "geometric", "window", "random")
DEFAULT_MODE = "geometric"

# regions routed per layer and KV head by a model without a calibrated route (MODEL_ROUTES below:
# the default model has one). 4: fewer lost look-alike facts at long range, more found no more
# (docs/experiments/uniform-route.md; its figures: BENCHMARKS.md §2, "The uniform route")
DEFAULT_TOP_K = 4
DEFAULT_REGION = 64  # tokens per region (the unit gathered)
DEFAULT_WINDOW = 128  # recent tokens always read (rounded up to regions)
DEFAULT_SINKS = 64  # first tokens always read (rounded up to regions)

# The KV cache keeps one mean key per block of this many cells (per layer and KV head); a region's
# score is its best block. Fixed when a context is created (llama_context_params.kv_centroid_block).
# 8 with the automatic shortlist below: half the fine centroid bytes of 4-token blocks, within noise of
# their accuracy (docs/experiments/uniform-route.md).
CENTROID_BLOCKS = (4, 8, 16, 32, 64, 128, 256)
DEFAULT_CENTROID_BLOCK = 8

# The type the centroids are kept in (llama_context_params.kv_centroid_type): f16, or q8_0 at 34
# bytes per 32 values instead of 64, so a routed step's centroid scan costs about half. f16 for a
# model without a calibrated route: on the uniform route q8_0 was not shown to answer as well
# (docs/experiments/uniform-route.md). The default model's route keeps q8_0 centroids: the bytes it
# saves pay for a wider shortlist (MODEL_ROUTES).
CENTROID_TYPES = ("f16", "q8_0")
DEFAULT_CENTROID_TYPE = "f16"

# Two-level scoring: with a centroid block finer than 64 cells (the engine's
# LLAMA_KV_CENT_COARSE_BLK) the cache also keeps one coarse centroid per 64 cells (the mean of its
# fine ones); a step scores the coarse ones, shortlists this many regions and ranks only those by
# their fine centroids. 0: one pass over every fine centroid. SHORTLIST_AUTO follows the document:
# an eighth of its regions, rounded up to a multiple of 16 (16 at 8k, 32 at 16k, 64 at 32k): a
# fixed shortlist lost long documents' needles in the coarse pass (docs/experiments/lab-tables.md, "The lab's
# tables that chose the defaults").
SHORTLIST_AUTO = -1
SHORTLIST_SHARE = 8
SHORTLIST_STEP = 16
DEFAULT_SHORTLIST = SHORTLIST_AUTO


def auto_shortlist(n_regions: int) -> int:
    """The shortlist SHORTLIST_AUTO means for a document of `n_regions` regions."""
    return SHORTLIST_STEP * max(1, math.ceil(n_regions / (SHORTLIST_SHARE * SHORTLIST_STEP)))


# Selection memory: a step's region scores become a softmax and a region keeps max(its share now,
# KEEP x what it had the step before). 0 selects afresh at every step.
DEFAULT_KEEP = 0.9

# How the question's tokens read the document: "dense" sends them as one batch that reads the whole
# cache once; "routed" as one batch whose queries choose QUESTION_TOP_K regions together, read once
# for the whole question; "steps" decodes them one by one through the route, as the answer is. The
# answer is always decoded step by step through the route. Dense is the default because the question
# is where routing lost look-alike facts (docs/experiments/uniform-route.md).
QUESTION_PASSES = ("dense", "routed", "steps")
# how a routed decode step's attention reads the selected regions (enum llama_kv_route_attn): auto is in
# place where the engine's CUDA kernel reads only the selected cells, a gather of their rows elsewhere.
# The gather stays the default: on a GPU in place was no faster (BENCHMARKS.md, "GPU")
ATTENTION_PATHS = ("auto", "gather", "in-place")
DEFAULT_ATTENTION = "gather"
DEFAULT_QUESTION = "dense"
DEFAULT_QUESTION_TOP_K = 32  # regions per layer and KV head that the question's batch reads

# Pins: the dense question pass also sums the attention its last queries give each region, and the
# answer's steps always read the DEFAULT_PIN regions with the most of it (of their top-k; with the
# selection memory and the dense question only): the answer steps then read the fact's region more
# often, for one more read of K in the question pass (docs/experiments/lab-tables.md, "The lab's tables that chose
# the defaults"; docs/experiments/uniform-route.md).
DEFAULT_PIN = 2

# Follow: a step also reads the region after each of its first DEFAULT_FOLLOW choices (the pins first),
# so that a value copied out of the end of a region goes on in the next (geometric routing with the
# selection memory; llama_kv_route_params.n_follow). 0: none.
DEFAULT_FOLLOW = 0

# Budgets per layer: "16-23=8" makes layers 16 to 23 route 8 regions at each single-token step and
# the others top-k (llama_kv_route_set_layer_top_k). The routing lab found the look-alike fact lost
# mostly in the last third of the default model's layers (docs/experiments/lab-tables.md), so the same bytes buy
# more there; layer numbers are a model's own, so a budget per layer is part of a model's route
# (MODEL_ROUTES below), and none for a model without one.
DEFAULT_LAYER_TOP_K = ""


def parse_layer_top_k(spec: str) -> tuple[tuple[int, int, int], ...]:
    """'16-23=8,0=2' -> ((16, 23, 8), (0, 0, 2)): layer ranges (inclusive) and their regions per step;
    ValueError, in words, for anything else."""
    parts = []
    for item in (p.strip() for p in spec.split(",")):
        layers, sep, k = item.partition("=")
        first, dash, last = layers.partition("-")
        try:
            first_i, last_i, k_i = int(first), int(last) if dash else int(first), int(k)
        except ValueError:
            raise ValueError(f"{item!r} is not LAYERS=K (e.g. 16-23=8 or 5=2)") from None
        if not sep or first_i < 0 or last_i < first_i:
            raise ValueError(f"{item!r} is not LAYERS=K with LAYERS a layer or a range FIRST-LAST (e.g. 16-23=8)")
        if not 1 <= k_i <= MAX_TOP_K:
            raise ValueError(f"{item!r}: a layer's regions must be between 1 and {MAX_TOP_K:,}")
        parts.append((first_i, last_i, k_i))
    return tuple(parts)



@dataclass(frozen=True)
class ModelRoute:
    """The decode route's budget as calibrated for one model: what a geometric route (and the controls,
    at the same budget) reads when --top-k and --layer-top-k are not given, and the type the session
    keeps its centroids in when --centroid-type is not given. `shortlist_floor`: the automatic
    shortlist is at least this many regions."""

    top_k: int = DEFAULT_TOP_K
    layer_top_k: str = DEFAULT_LAYER_TOP_K
    centroid_type: str = DEFAULT_CENTROID_TYPE
    shortlist_floor: int = 0

    def describe(self) -> str:
        text = f"top-{self.top_k}"
        if self.layer_top_k:
            text += f", layers {self.layer_top_k}"
        text += f", {self.centroid_type} centroids"
        if self.shortlist_floor:
            text += f", shortlist at least {self.shortlist_floor}"
        return text


# A model without a calibrated route: the uniform route above.
UNCALIBRATED_ROUTE = ModelRoute()

# Calibrated routes, by the model file's sha256 (so a local copy of a registry model gets its route
# too). Qwen2.5 Coder 1.5B Q4_K_M (the default model, 28 layers): the routing lab found the one-key
# fact lost in layers 19-23 (docs/experiments/lab-tables.md, "Where a route loses the fact"), so top-3 with 8 regions
# in those layers, Q8_0 centroids (half the scan's bytes) and a shortlist of at least 48
# (docs/experiments/default-model-route.md); how it answers against full attention and the controls:
# BENCHMARKS.md §1, "The default route against full attention and the controls".
MODEL_ROUTES: dict[str, ModelRoute] = {
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046": ModelRoute(
        top_k=3, layer_top_k="19-23=8", centroid_type="q8_0", shortlist_floor=48),
}


def model_route(sha256: str | None) -> ModelRoute:
    """The route calibrated for the model file with this sha256, or the uniform route."""
    return MODEL_ROUTES.get(sha256 or "", UNCALIBRATED_ROUTE)


# Text hints (kvlocal/hints.py): geometric routing also reads the HINTS regions whose text shares the
# question's rarest words (with the tokens that follow the word), in place of as many of its top-k
# choices. Off by default for one document (docs/experiments/hints-on-one-document.md).
DEFAULT_HINTS = 0

# What a set's answer reads (--focus): "hinted", the one document that holds the question's best hint
# (kvlocal/hints.py), as if it were asked alone: the answer's sequence sees the template's head and that
# document's cells (patch 0023), then the prompt's middle again and the question, and routes within them
# as one document does (its defaults); "set", every document. A question that hints nowhere reads the
# whole set. Hinted is the default: on hand-written questions about real manuals it answers what each
# manual alone answers, where the set's route below answers far fewer, and on planted look-alikes across
# documents it answers what each document alone answers with the default route (docs/experiments/set-focus.md).
FOCI = ("set", "hinted")
DEFAULT_FOCUS = "hinted"

# A set of several documents read whole (--focus set; `kvlocal ask DOC DOC... "question"`): facts that
# recur across the documents with one word changed defeat the default route and dense attention alike
# (the answers collapse onto one document's code), and a route that reads only the sentence of the
# question's rarest word answers them (docs/experiments/library-hints.md; BENCHMARKS.md §6, "Several
# documents"). So a set's geometric answers take LIBRARY_TOP_K, LIBRARY_HINTS and LIBRARY_QUESTION
# unless --top-k, --hints or --question-pass is given, and a question whose words hint nowhere in the
# set's text takes the single-document defaults instead (routing.resolve_route). One document keeps the
# defaults above: there the hinted route answered fewer look-alike facts than the default route
# (docs/experiments/hints-on-one-document.md).
LIBRARY_TOP_K = 1
LIBRARY_HINTS = 1
LIBRARY_QUESTION = "steps"
# A set's context keeps its centroids in this type unless --centroid-type is given, whatever the model's
# route says: the set's routes, focused and whole, were measured with F16 centroids (the
# single-document route of the default model with Q8_0 ones).
LIBRARY_CENTROID_TYPE = "f16"

# How a document is prefilled: "dense" reads every earlier cell for every ubatch; "routed" lets a
# ubatch that starts PREFILL_FROM or more tokens into the document read the sinks, the window before
# it, itself and the PREFILL_TOP_K regions per layer and KV head that its queries choose together
# (the engine's routed ubatch, on the decode route's geometry: 64-token regions, 64 sinks, a
# 128-token window, a shortlist of PREFILL_SHORTLIST_SHARE x top-k, no memory). A routed prefill
# writes other K/V bytes than a dense one, so its saved state is keyed apart. Dense stays the
# default. The prefill lab found a fact token's prefill attention diffuse: the error a routed ubatch
# hands on is set by the share of the document it reads (no selection rule does much better than
# the engine's), so look-alike facts need a large share of the regions; PREFILL_TOP_K 64 keeps them
# where smaller budgets load faster but lose them (docs/experiments/routed-prefill.md; BENCHMARKS.md
# §3, "Decode and prefill speed").
PREFILL_MODES = ("dense", "routed")
DEFAULT_PREFILL = "dense"
DEFAULT_PREFILL_TOP_K = 64
DEFAULT_PREFILL_FROM = 4096
DEFAULT_PREFILL_UBATCH = 512  # tokens per routed ubatch (at most the context's ubatch): one selection each
PREFILL_SHORTLIST_SHARE = 4

# -- bounds -----------------------------------------------------------------------------------------
# The largest values the CLI accepts (typer min/max: a usage error before any work) and RouteConfig
# validates (the core refuses them too). The engine takes these as 32-bit ints (the seed as uint32),
# so a value past them would wrap silently in ctypes.
MAX_CTX = 1_048_576  # context tokens (--ctx, --lengths); the model's trained context is checked later
MIN_CTX = 256  # the session's smallest context
MAX_THREADS = 256  # --threads: llama.cpp's thread pool, far more than any core count we target
MAX_TOP_K = 65_536  # regions routed per layer and KV head (0: sinks and window only)
MAX_REGION = 256  # tokens per region: a power of two that divides this
MAX_WINDOW = MAX_CTX  # recent tokens always read
MAX_SINKS = MAX_CTX  # first tokens always read
MAX_SHORTLIST = 65_536  # regions the coarse centroids shortlist
MAX_SEED = 2**32 - 1  # the engine's seed is a uint32
MAX_ANSWER_TOKENS = MAX_CTX  # --max-tokens, bench --tokens: an answer cannot outgrow the context
MAX_ANSWERS = 64  # answers one context decodes together (kvlocal.batch, kvlocal serve --batch)

# -- sizes the engine and the session fix (read by the KV estimate before any engine work) -----------
ANSWER_RESERVE = 768  # context tokens a session keeps free for a question and its answer
COARSE_BLOCK = 64  # cells per coarse centroid: the engine's LLAMA_KV_CENT_COARSE_BLK (patches/0003)
SET_LAYOUT_UNIT = 64  # cells a set's head and each body are padded to: a set's regions are at most this long
