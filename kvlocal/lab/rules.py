"""The routing lab's replay: selection rules scored against exact attention, offline, in numpy.

Inputs are the dense model's real queries and keys of one layer and KV head (see capture):
`q` [steps, group, dim] (the query heads that share the KV head), `keys` [cells, dim] and the
position of each step. Every rule ranks the candidate regions (neither sinks nor window) of each
step; the metrics compare what it selects with the exact softmax attention of those steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvlocal.route_settings import DEFAULT_REGION, DEFAULT_SINKS, DEFAULT_WINDOW

NEG = -np.inf
PINNED = 1e30  # the score question_pin_rule gives a pinned region (above every share)


@dataclass(frozen=True)
class Geometry:
    """Region layout of the routed decode (the engine's plan, llama-kv-cache.cpp route_plan)."""

    region: int = DEFAULT_REGION
    sinks: int = DEFAULT_SINKS
    window: int = DEFAULT_WINDOW

    def fixed_and_candidates(self, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """Region ids every head reads (sinks, window) and the ones routing chooses from, for a
        token at `pos` that sees cells 0..pos."""
        return self.chunk_fixed_and_candidates(pos, pos + 1)

    def chunk_fixed_and_candidates(self, first: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The same for a ubatch of cells [first, end): the window reaches `window` cells before its
        first token, and the regions that hold the ubatch are read too."""
        n_used = (end - 1) // self.region + 1
        n_sink = -(-self.sinks // self.region)
        n_win = max(1, -(-(self.window + end - first - 1) // self.region))
        ids = np.arange(n_used)
        fixed = (ids < n_sink) | (ids >= n_used - n_win)
        return ids[fixed], ids[~fixed]


@dataclass
class Head:
    """One (layer, KV head) of one probe: its steps' queries and every key they may see."""

    q: np.ndarray  # [steps, group, dim] F32, post-RoPE
    keys: np.ndarray  # [cells, dim] F32, cell i at position i
    pos: np.ndarray  # [steps] position of each step's token
    scale: float
    n_question: int = 0  # the first n_question steps read the question, the rest the answer
    _cache: dict = field(default_factory=dict, repr=False)

    def logits(self) -> np.ndarray:
        """[steps, group, cells] with -inf where a step does not see the cell (computed once)."""
        if "logits" not in self._cache:
            lg = np.einsum("sgd,td->sgt", self.q, self.keys) * np.float32(self.scale)
            visible = np.arange(self.keys.shape[0])[None, :] <= self.pos[:, None]
            self._cache["logits"] = np.where(visible[:, None, :], lg, np.float32(NEG))
        return self._cache["logits"]

    def probs(self) -> np.ndarray:
        """Exact softmax attention of every step and query head (computed once)."""
        if "probs" not in self._cache:
            lg = self.logits()
            p = np.exp(lg - lg.max(axis=-1, keepdims=True))
            self._cache["probs"] = p / p.sum(axis=-1, keepdims=True)
        return self._cache["probs"]


# A rule returns region scores [steps, n_regions] (higher = read first; -inf = never) and the number
# of key-sized rows it scanned per step (the metadata a routed step reads, in K rows of one head).
RuleResult = tuple[np.ndarray, np.ndarray]
Rule = Callable[[Head, Geometry, np.ndarray], RuleResult]


def _pad_cells(keys: np.ndarray, multiple: int, edge: bool = False) -> np.ndarray:
    """The keys padded to a multiple of `multiple` cells: with zeros, or (edge) the last key repeated."""
    n = -(-keys.shape[0] // multiple) * multiple
    if n == keys.shape[0]:
        return keys
    return np.pad(keys, ((0, n - keys.shape[0]), (0, 0)), mode="edge" if edge else "constant")


# Bytes of one key-sized row of metadata per stored type, as a share of an F16 key row: F16 keeps 2
# bytes a value; Q8_0 keeps blocks of 32 int8 values with one F16 scale (34 bytes per 32 values).
ROW_SHARE = {"f16": 1.0, "q8_0": 34 / 64}


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Round-trip through ggml's Q8_0 (per 32 values: an F16 scale amax/127 and int8 values)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    d = (np.abs(blocks).max(axis=-1, keepdims=True) / 127.0).astype(np.float16).astype(np.float32)
    q = np.round(np.divide(blocks, d, out=np.zeros_like(blocks), where=d > 0))
    return (q * d).reshape(x.shape)


def stored(x: np.ndarray, kind: str) -> np.ndarray:
    """`x` as the engine keeps its centroids: rounded through F16 or Q8_0."""
    return quantize_q8_0(x) if kind == "q8_0" else x.astype(np.float16).astype(np.float32)


def _cell_blocks(keys: np.ndarray, block: int, n_regions: int, region: int, edge: bool = False) -> np.ndarray:
    """[n_regions*region/block, block, dim]: the keys of every block of the first n_regions regions
    (padded as _pad_cells pads)."""
    return _pad_cells(keys, region, edge)[: n_regions * region].reshape(-1, block, keys.shape[1])


def block_means(keys: np.ndarray, block: int, n_regions: int, region: int, kind: str = "f16") -> np.ndarray:
    """[n_regions*region/block, dim] mean key of every block, stored as the engine keeps them (F16 or Q8_0)."""
    return stored(_cell_blocks(keys, block, n_regions, region).mean(axis=1), kind)


def _region_max(block_scores: np.ndarray, per_region: int) -> np.ndarray:
    """[steps, group, n_blocks] -> [steps, n_regions]: best block of the region, best query head."""
    s, g, nb = block_scores.shape
    return block_scores.reshape(s, g, nb // per_region, per_region).max(axis=(1, 3))


def _n_regions(head: Head, geo: Geometry) -> int:
    return int(head.pos.max()) // geo.region + 1


def _block_rule(block: int, kind: str, rows: int,
                score: Callable[[Head, Geometry, int], np.ndarray]) -> Rule:
    """A rule that scores every `block` cells by score(head, geo, n_regions) -> [steps, group, n_blocks]
    from `rows` key-sized rows a block stored as `kind`, and gives a region its best block for its best
    query head (the scan counts those rows of every block)."""

    def rule(head: Head, geo: Geometry, cand: np.ndarray) -> RuleResult:
        n_reg = _n_regions(head, geo)
        sc = _region_max(score(head, geo, n_reg), geo.region // block)
        scan = np.full(len(head.pos), rows * n_reg * geo.region // block * ROW_SHARE[kind])
        return sc, scan

    return rule


def mean_rule(block: int, kind: str = "f16") -> Rule:
    """Mean key of every `block` cells, raw q.c, max over the region's blocks and the group (the
    engine's one-pass scoring). `kind`: the type the means are stored in (the scan counts its bytes)."""

    def score(head: Head, geo: Geometry, n_reg: int) -> np.ndarray:
        return np.einsum("sgd,bd->sgb", head.q, block_means(head.keys, block, n_reg, geo.region, kind))

    return _block_rule(block, kind, 1, score)


def block_bounds(keys: np.ndarray, block: int, n_regions: int, region: int, kind: str = "f16"
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel max and min key of every `block` cells ([n_regions*region/block, dim] each), stored
    as `kind`; cells past the last key repeat it, so a partly filled block is bounded by its own keys
    (the blocks they fill lie in the window, never a candidate)."""
    blocks = _cell_blocks(keys, block, n_regions, region, edge=True)
    return stored(blocks.max(axis=1), kind), stored(blocks.min(axis=1), kind)


def bound_rule(block: int, kind: str = "f16") -> Rule:
    """Quest's bound: per `block` cells, the per-channel max and min key; a query scores the block by
    sum_d max(q_d kmax_d, q_d kmin_d) = relu(q).kmax - relu(-q).kmin, an upper bound of every q.k in
    it; max over the region's blocks and the group. Scan: two key rows per block, stored as `kind`."""

    def score(head: Head, geo: Geometry, n_reg: int) -> np.ndarray:
        kmax, kmin = block_bounds(head.keys, block, n_reg, geo.region, kind)
        qp, qn = np.maximum(head.q, 0), np.maximum(-head.q, 0)
        return np.einsum("sgd,bd->sgb", qp, kmax) - np.einsum("sgd,bd->sgb", qn, kmin)

    return _block_rule(block, kind, 2, score)


def block_variances(keys: np.ndarray, block: int, n_regions: int, region: int, kind: str = "f16") -> np.ndarray:
    """Per-channel variance of the keys of every `block` cells, stored as `kind` (zero-padded as block_means)."""
    k = _cell_blocks(keys, block, n_regions, region)
    return stored(np.maximum((k * k).mean(axis=1) - k.mean(axis=1) ** 2, 0), kind)


def spread_rule(block: int, kind: str = "f16") -> Rule:
    """The mean key raised by the keys' spread: a block scores q.mean + (scale/2) sum_d q_d^2 var_d, so
    that at the attention's scale it is the log of the block's expected attention mass when its keys are
    Gaussian per channel (RetroInfer's log-normal correction, used to rank rather than to estimate).
    Scan: a mean and a variance row per block."""

    def score(head: Head, geo: Geometry, n_reg: int) -> np.ndarray:
        mean = block_means(head.keys, block, n_reg, geo.region, kind)
        var = block_variances(head.keys, block, n_reg, geo.region, kind)
        return np.einsum("sgd,bd->sgb", head.q, mean) + 0.5 * head.scale * np.einsum("sgd,bd->sgb", head.q ** 2, var)

    return _block_rule(block, kind, 2, score)


def channel_rule(r: int) -> Rule:
    """SparQ's approximate scores, max-pooled per region: each step keeps the `r` channels where the
    KV head's query heads weigh most (the largest sum of |q| over the group), scores every key on those
    channels only (read from a channel-major F16 copy of K: r/dim of K's bytes), and a region takes its
    best key for its best query head."""

    def rule(head: Head, geo: Geometry, cand: np.ndarray) -> RuleResult:
        n_reg = _n_regions(head, geo)
        n = n_reg * geo.region
        keys = stored(_pad_cells(head.keys, geo.region)[:n], "f16")
        visible = np.arange(n)[None, :] <= head.pos[:, None]  # [steps, cells]
        sc = np.empty((len(head.pos), n_reg), np.float32)
        for i, q in enumerate(head.q):  # q: [group, dim]
            ch = np.argsort(-np.abs(q).sum(axis=0), kind="stable")[:r]
            s = np.where(visible[i], q[:, ch] @ keys[:, ch].T, np.float32(NEG))  # [group, cells]
            sc[i] = s.reshape(s.shape[0], n_reg, geo.region).max(axis=(0, 2))
        return sc, np.full(len(head.pos), n * r / head.keys.shape[1])

    return rule


def token_max_rule(head: Head, geo: Geometry, cand: np.ndarray) -> RuleResult:
    """Reference: exact q.k of every cell, max over the region and the group (reads all of K)."""
    n_reg = _n_regions(head, geo)
    lg = head.logits()
    lg = np.concatenate([lg, np.full(lg.shape[:2] + (n_reg * geo.region - lg.shape[2],), NEG)], axis=2) \
        if lg.shape[2] < n_reg * geo.region else lg[:, :, : n_reg * geo.region]
    return _region_max(lg, geo.region), np.full(len(head.pos), n_reg * geo.region)


def unscaled(rule: Rule) -> Rule:
    """A rule whose scores are logits (already at the attention's scale) brought back to raw q.k, as the
    selection memory's softmax expects."""

    def wrapped(head: Head, geo: Geometry, cand: np.ndarray) -> RuleResult:
        sc, scan = rule(head, geo, cand)
        return sc / np.float32(head.scale), scan

    return wrapped


def two_level_rule(coarse: int, fine: int, shortlist: int, kind: str = "f16") -> Rule:
    """Coarse means (one per `coarse` cells) shortlist `shortlist` regions; fine means (one per `fine`
    cells) rank only the shortlisted regions. Scan: all coarse means + the shortlist's fine means,
    both stored as `kind`."""
    coarse_rule, fine_rule = mean_rule(coarse, kind), mean_rule(fine, kind)

    def rule(head: Head, geo: Geometry, cand: np.ndarray) -> RuleResult:
        n_reg = _n_regions(head, geo)
        sc0, _ = coarse_rule(head, geo, cand)
        sc0 = np.where(cand, sc0, NEG)
        sc1, _ = fine_rule(head, geo, cand)
        keep = np.zeros_like(cand)
        for i in range(len(head.pos)):
            n_short = min(shortlist, int(cand[i].sum()))
            keep[i, np.argsort(-sc0[i], kind="stable")[:n_short]] = True
        scan = n_reg * geo.region // coarse + np.minimum(shortlist, cand.sum(axis=1)) * (geo.region // fine)
        return np.where(keep, sc1, NEG), scan * ROW_SHARE[kind]

    return rule


def softmax_over(sc: np.ndarray, cand: np.ndarray, scale: float) -> np.ndarray:
    """Per step (row), the softmax of the candidates' scores at the attention's scale (0 elsewhere);
    `cand` is [steps, regions], or [1, regions] for candidates every row shares."""
    z = np.where(cand, sc * scale, NEG)
    z = z - z.max(axis=1, keepdims=True)
    p = np.where(cand, np.exp(z), 0.0)
    return p / p.sum(axis=1, keepdims=True)


def persistent_rule(rule: Rule, gamma: float,
                    answer_start: Callable[[Head, Geometry, np.ndarray], np.ndarray] | None = None) -> Rule:
    """Selections that persist over the steps (the engine's selection memory): each step's region
    scores become a softmax over the candidates (at the attention's scale), and a region keeps gamma
    times its previous value when that is larger, r_s = max(p_s, gamma * r_(s-1)); a region a step
    found stays chosen for a while. With `answer_start` (head, geo, the first answer step's
    candidates -> memory), the memory is replaced by what it returns before the first answer step."""

    def wrapped(head: Head, geo: Geometry, cand: np.ndarray) -> RuleResult:
        sc, scan = rule(head, geo, cand)
        p = softmax_over(sc, cand, head.scale)
        run = np.zeros_like(p)
        prev = np.zeros(p.shape[1])
        for i in range(p.shape[0]):
            if answer_start is not None and head.n_question and i == head.n_question:
                prev = answer_start(head, geo, cand[i])
            prev = np.maximum(p[i], gamma * prev) * cand[i]
            run[i] = prev
        return np.where(cand, run, NEG), scan

    return wrapped


def question_pin_rule(rule: Rule, pins: int) -> Rule:
    """Regions the question found stay read for the answer (the engine's pins): every step first
    reads the `pins` regions with the most exact attention mass summed over the question steps
    before it (what a dense question pass knows), then fills the rest of its budget by the rule's
    own scores."""

    def wrapped(head: Head, geo: Geometry, cand: np.ndarray) -> RuleResult:
        sc, scan = rule(head, geo, cand)
        ev = region_mass(head.probs(), geo.region, _n_regions(head, geo)).sum(axis=1) * cand
        acc = np.zeros(ev.shape[1])
        out = np.array(sc, dtype=np.float64)
        for i in range(ev.shape[0]):
            if i > 0 and pins:
                pinned = np.argsort(-np.where(cand[i], acc, NEG), kind="stable")[:pins]
                pinned = pinned[acc[pinned] > 0]
                out[i, pinned] = PINNED + acc[pinned]
            if i < head.n_question:
                acc += ev[i]
        return out, scan

    wrapped.dense_question = True  # see reads_question_densely
    return wrapped


def question_memory_rule(rule: Rule, gamma: float, seeded: bool = True) -> Rule:
    """The selection memory seeded by a dense question pass: before the first answer step the memory
    holds each candidate region's share of the exact attention mass of the question's steps (summed
    over them and the group's heads, normalised over the candidates), then the answer's steps go on
    as persistent_rule's. The question's own steps select as the plain memory does (the engine reads
    the question densely). With seeded=False the memory starts empty at the first answer step: what
    the engine does without pins (a question read in one batch neither reads nor writes the memory)."""

    def question_mass(head: Head, geo: Geometry, cand_row: np.ndarray) -> np.ndarray:
        if not seeded:
            return np.zeros(cand_row.shape, dtype=np.float64)
        mass = region_mass(head.probs()[:head.n_question], geo.region, _n_regions(head, geo)).sum(axis=(0, 1))
        mass = mass * cand_row
        return mass / mass.sum() if mass.sum() > 0 else mass

    wrapped = persistent_rule(rule, gamma, answer_start=question_mass)
    wrapped.dense_question = True  # see reads_question_densely
    return wrapped


def reads_question_densely(rule: Rule) -> bool:
    """Whether a rule stands for a route whose question pass is dense (question_pin_rule and
    question_memory_rule: pins or a memory seeded by it, or the memory of a question read in one
    batch): there the step that predicts the first answer token is the question batch's last row,
    read densely, and only the later steps are routed."""
    return getattr(rule, "dense_question", False)


def share_budget_rule(rule: Rule, share: float) -> Rule:
    """A budget per head and step instead of a fixed k: of the regions the rule scores (its scores being
    shares, as persistent_rule's are), only the fewest whose shares add up to `share` of the candidates'
    total stay choosable (the replay's k caps them); pinned regions (question_pin_rule's) always stay and
    take their part of the cap. Twilight's top-p, over regions."""

    def wrapped(head: Head, geo: Geometry, cand: np.ndarray) -> RuleResult:
        sc, scan = rule(head, geo, cand)
        out = np.array(sc, dtype=np.float64)
        for i in range(sc.shape[0]):
            live = cand[i] & np.isfinite(sc[i])
            free = live & (sc[i] < PINNED)
            w = np.where(free, np.maximum(sc[i], 0.0), 0.0)
            if w.sum() <= 0:
                continue
            order = np.argsort(-w, kind="stable")
            n_keep = int(np.searchsorted(np.cumsum(w[order]) / w.sum(), share)) + 1
            drop = order[n_keep:]
            out[i, drop[free[drop]]] = NEG
        return out, scan

    wrapped.dense_question = reads_question_densely(rule)
    return wrapped


def oracle_rule(head: Head, geo: Geometry, cand: np.ndarray) -> RuleResult:
    """Upper bound: the regions holding the most true attention mass, summed over the group."""
    return region_mass(head.probs(), geo.region, _n_regions(head, geo)).sum(axis=1), np.zeros(len(head.pos))


def region_mass(p: np.ndarray, region: int, n_reg: int) -> np.ndarray:
    """[steps, group, cells] -> [steps, group, n_regions] attention mass per region."""
    s, g, t = p.shape
    if t < n_reg * region:
        p = np.concatenate([p, np.zeros((s, g, n_reg * region - t), p.dtype)], axis=2)
    return p[:, :, : n_reg * region].reshape(s, g, n_reg, region).sum(axis=-1)


def _pinned(rule: Rule) -> Rule:
    """`rule` with the default route's selection memory (keep 0.9) and its 2 pins."""
    return question_pin_rule(persistent_rule(rule, 0.9), 2)


def _default_scoring(shortlist: int, kind: str = "f16") -> Rule:
    """The engine's default scoring: 64-token coarse centroids shortlist `shortlist` regions, their
    8-token fine centroids choose, the selection memory keeps 0.9 of a region's share."""
    return persistent_rule(two_level_rule(64, 8, shortlist, kind), 0.9)


# The default model's route as the lab replays it: Q8_0 centroids, a shortlist of 48, the memory, 2 pins
DEFAULT_ROUTE_SCORING = question_pin_rule(_default_scoring(48, "q8_0"), 2)

# The rules the route's defaults were chosen by, and the references they are read against
# (BENCHMARKS.md, the routing lab's tables). A rule's name reads: meanN = one mean key per N tokens
# scanned in one pass; twoC/FxS = C-token coarse means shortlist S regions, F-token fine means
# choose; q8 = centroids kept in Q8_0; +keep.G = the selection memory at G.
RULES: dict[str, Rule] = {
    # the fine centroids' resolution: finer finds the fact more often and scans more bytes
    "mean16": mean_rule(16),
    "mean8": mean_rule(8),
    "mean4": mean_rule(4),
    # the default's scoring with the automatic shortlist (an eighth of the regions: 16 at 8k, 32 at
    # 16k, 64 at 32k), a larger shortlist, and no shortlist at all (every 8-token centroid)
    "two64/8x16+keep.9": _default_scoring(16),
    "two64/8x32+keep.9": _default_scoring(32),
    "two64/8x64+keep.9": _default_scoring(64),
    "two64/8x128+keep.9": _default_scoring(128),
    "mean8+keep.9": persistent_rule(mean_rule(8), 0.9),
    # the centroids kept in Q8_0 (34 bytes per 32 values instead of 64): a longer shortlist, or
    # 4-token centroids, within about the F16 default's bytes
    "two64/8x64q8+keep.9": _default_scoring(64, "q8_0"),
    "two64/8x128q8+keep.9": _default_scoring(128, "q8_0"),
    "two64/8x160q8+keep.9": _default_scoring(160, "q8_0"),
    "two64/4x64q8+keep.9": persistent_rule(two_level_rule(64, 4, 64, "q8_0"), 0.9),
    # what a dense question pass adds: the memory as the engine keeps it (empty at the first answer
    # step, +amem), seeded with the question's attention mass (+qmem), or 2 of the k regions pinned
    # by that mass (+qm2, the default's pins)
    "two64/8x64+amem.9": question_memory_rule(two_level_rule(64, 8, 64), 0.9, seeded=False),
    "two64/8x64+qmem.9": question_memory_rule(two_level_rule(64, 8, 64), 0.9),
    "two64/8x64+qm2": question_pin_rule(_default_scoring(64), 2),
    "two64/8x16+amem.9": question_memory_rule(two_level_rule(64, 8, 16), 0.9, seeded=False),
    "two64/8x16+qmem.9": question_memory_rule(two_level_rule(64, 8, 16), 0.9),
    "two64/8x16+qm2": question_pin_rule(_default_scoring(16), 2),
    # more of the budget pinned by the question's mass (`--pin 3`, `--pin 4`: every region of top-4
    # fixed for the whole answer), and the default's pins over a longer shortlist (issue 26's lab)
    "two64/8x16+qm3": question_pin_rule(_default_scoring(16), 3),
    "two64/8x16+qm4": question_pin_rule(_default_scoring(16), 4),
    "two64/8x32+qm2": question_pin_rule(_default_scoring(32), 2),
    "two64/8x128+qm2": question_pin_rule(_default_scoring(128), 2),
    "two64/8x64q8+qm2": question_pin_rule(_default_scoring(64, "q8_0"), 2),
    # the default route's scoring (Q8_0 centroids, a shortlist of 48, 2 pins), and in place of its
    # centroids, one pass over every region: every 8-token mean (no shortlist); Quest's per-channel
    # max/min bound per 64 / 32 / 16 cells; the mean raised by the keys' spread per 64 / 16 / 8 cells;
    # the exact best key of the region (reads all of K: the ceiling of any per-key bound)
    "two64/8x48q8+qm2": DEFAULT_ROUTE_SCORING,
    "mean8q8+qm2": _pinned(mean_rule(8, "q8_0")),
    "bound64q8+qm2": _pinned(bound_rule(64, "q8_0")),
    "bound32q8+qm2": _pinned(bound_rule(32, "q8_0")),
    "bound16q8+qm2": _pinned(bound_rule(16, "q8_0")),
    "spread64q8+qm2": _pinned(spread_rule(64, "q8_0")),
    "spread16q8+qm2": _pinned(spread_rule(16, "q8_0")),
    "spread8q8+qm2": _pinned(spread_rule(8, "q8_0")),
    "token+qm2": _pinned(unscaled(token_max_rule)),
    # SparQ's channel-subset scores of every key (channel_rule): 4, 8 or 16 of 128 channels
    "chan4+qm2": _pinned(channel_rule(4)),
    "chan8+qm2": _pinned(channel_rule(8)),
    "chan16+qm2": _pinned(channel_rule(16)),
    # a budget per head and step (share_budget_rule) over the default's scoring, capped by the replay's k
    "two64/8x48q8+qm2+share.2": share_budget_rule(DEFAULT_ROUTE_SCORING, 0.2),
    "two64/8x48q8+qm2+share.3": share_budget_rule(DEFAULT_ROUTE_SCORING, 0.3),
    "two64/8x48q8+qm2+share.5": share_budget_rule(DEFAULT_ROUTE_SCORING, 0.5),
    # references: exact q.k of every token, max-pooled (reads all of K), and the regions that hold
    # the most true attention mass
    "token": token_max_rule,
    "oracle": oracle_rule,
}


@dataclass
class HeadResult:
    """What one rule selected for one (probe, layer, KV head), per step and query head."""

    tail: np.ndarray  # [steps, group] mass outside sinks and window
    got: np.ndarray  # [steps, group] of it, the mass in the selected regions
    fact_mass: np.ndarray  # [steps, group] mass on the asked fact's cells
    fact_hit: np.ndarray  # [steps, group] the region holding most of that mass was selected (or is fixed)
    fact_rank: np.ndarray  # [steps] rank of that region (of the group's best head) among the candidates
    rows_read: np.ndarray  # [steps] K/V rows gathered (cells of fixed + selected regions)
    rows_scan: np.ndarray  # [steps] metadata scanned, in F16 key rows' bytes
    rows_dense: np.ndarray  # [steps] cells a dense step reads
    out_err: np.ndarray | None = None  # [answer steps, group] attention-output error over the document
    out_err_est: np.ndarray | None = None  # the same with the unread regions estimated from their means
    out_err_var: np.ndarray | None = None  # ... and the logit raised by half the query's variance over the region


def output_error(head: Head, values: np.ndarray, read: np.ndarray, cand: np.ndarray, steps: np.ndarray,
                 geo: Geometry) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Relative error ||o_routed - o_dense|| / ||o_dense|| of each query head's attention output over
    the document's cells (values: [n_doc, dim]; the question and answer tokens' own values are not
    captured, so both outputs leave them out), at `steps`, reading the regions `read` [steps, n_reg].
    Second: the same when every unread candidate region adds its mean key and mean value, weighted by
    its cell count (RetroInfer's estimate of the unread mass, here at region granularity). Third: the
    estimate's logit raised by q^T diag(var) q / 2 (the log-normal correction: the mean key scores a
    region's mean logit, its mass follows the logits' spread too), var the per-channel key variance."""
    n_doc = values.shape[0]
    w, o_dense, count, vc, e_est, e_var = _dense_output(head, values, steps, read.shape[1], geo)
    cells_read = np.repeat(read[steps], geo.region, axis=1)[:, :n_doc]  # [a, n_doc]
    wr = w * cells_read[:, None, :]
    num, den = np.einsum("agt,td->agd", wr, values), wr.sum(-1)[..., None]
    unread = (cand[steps] & ~read[steps] & (count > 0)[None, :])[:, None, :]  # [a, 1, n_reg]
    outputs = [num / den]
    for e in (e_est, e_var):
        we = np.where(unread, e, 0.0)
        outputs.append((num + np.einsum("agr,rd->agd", we, vc)) / (den + we.sum(-1)[..., None]))
    norm = np.linalg.norm(o_dense, axis=-1)
    return tuple(np.linalg.norm(o - o_dense, axis=-1) / norm for o in outputs)


def _dense_output(head: Head, values: np.ndarray, steps: np.ndarray, n_reg: int, geo: Geometry) -> tuple:
    """What output_error needs that no selection changes, computed once per head and steps: the
    softmax weights of the document's cells (before normalising), the dense output, each region's
    cell count and mean value, and the weight exp(logit - max) of every region's estimate row
    (the mean key plus log(count); and with the variance term)."""
    key = ("dense_output", steps.tobytes())
    if key not in head._cache:
        n_doc = values.shape[0]
        lg = head.logits()[steps][:, :, :n_doc]  # [a, g, n_doc]
        m = lg.max(axis=-1, keepdims=True)
        w = np.exp(lg - m)
        o_dense = np.einsum("agt,td->agd", w, values) / w.sum(-1)[..., None]
        count = np.clip(n_doc - np.arange(n_reg) * geo.region, 0, geo.region).astype(np.float32)

        def region_mean(x: np.ndarray) -> np.ndarray:
            padded = np.pad(x, ((0, n_reg * geo.region - len(x)), (0, 0)))  # regions past the document: empty
            return padded.reshape(n_reg, geo.region, -1).sum(1) / np.maximum(count, 1)[:, None]

        keys = head.keys[:n_doc]
        kc = region_mean(keys)
        var = stored(np.maximum(region_mean(keys * keys) - kc * kc, 0), "f16")  # kept in F16, as the engine keeps its means
        kc, vc = stored(kc, "f16"), stored(region_mean(values), "f16")
        le = np.einsum("agd,rd->agr", head.q[steps], kc) * np.float32(head.scale) + np.log(np.maximum(count, 1))
        qs = head.q[steps] * np.float32(head.scale)
        lv = le + 0.5 * np.einsum("agd,rd->agr", qs * qs, var)
        head._cache[key] = (w, o_dense, count, vc, np.exp(le - m), np.exp(np.minimum(lv - m, 80.0)))
    return head._cache[key]


def replay(head: Head, geo: Geometry, rule: Rule, budgets: Sequence[int], fact: tuple[int, int],
           values: np.ndarray | None = None, error_steps: np.ndarray | None = None) -> dict[int, HeadResult]:
    """Select the top-k candidate regions per step with `rule`, for every k in `budgets`, and measure
    against exact attention. `fact` is the [start, end) cell span of the asked fact; with the
    document's `values`, the attention-output error is measured at `error_steps`."""
    n_steps = len(head.pos)
    n_reg = _n_regions(head, geo)
    p = head.probs()
    mass = region_mass(p, geo.region, n_reg)  # [s, g, r]
    cand = np.zeros((n_steps, n_reg), bool)
    fixed = np.zeros((n_steps, n_reg), bool)
    for i, pos in enumerate(head.pos):
        f, c = geo.fixed_and_candidates(int(pos))
        fixed[i, f] = True
        cand[i, c] = True
    scores, scan = rule(head, geo, cand)
    scores = np.where(cand, scores, NEG)
    order = np.argsort(-scores, axis=1, kind="stable")
    tail = (mass * cand[:, None, :]).sum(-1)

    f0, f1 = fact
    fact_cells = p[:, :, f0:f1]
    fact_mass = fact_cells.sum(-1)
    region_of = (f0 + fact_cells.argmax(-1)) // geo.region  # [s, g] region holding the head's peak on the fact
    best = fact_mass.argmax(axis=1)
    fr = region_of[np.arange(n_steps), best]
    higher = (scores > scores[np.arange(n_steps), fr][:, None]) & cand
    fact_rank = np.where(cand[np.arange(n_steps), fr], higher.sum(axis=1) + 1, 0)
    n_cells = head.pos + 1
    region_cells = np.clip(n_cells[:, None] - np.arange(n_reg)[None, :] * geo.region, 0, geo.region)

    results = {}
    for top_k in budgets:
        sel = np.zeros_like(cand)
        for i in range(n_steps):
            chosen = order[i, : min(top_k, int(cand[i].sum()))]
            sel[i, chosen[np.isfinite(scores[i, chosen])]] = True
        read = sel | fixed
        errors = (None, None, None)
        if values is not None and error_steps is not None and len(error_steps):
            errors = output_error(head, values, read, cand, error_steps, geo)
        results[top_k] = HeadResult(
            tail=tail, got=(mass * sel[:, None, :]).sum(-1), fact_mass=fact_mass,
            fact_hit=np.take_along_axis(read, region_of, axis=1), fact_rank=fact_rank,
            rows_read=(region_cells * read).sum(axis=1), rows_scan=scan.astype(np.float64), rows_dense=n_cells,
            out_err=errors[0], out_err_est=errors[1], out_err_var=errors[2])
    return results
