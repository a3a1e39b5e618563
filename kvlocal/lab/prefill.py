"""The prefill lab: how well a routed ubatch's selection keeps what dense prefill attention reads.

A routed prefill (`--prefill routed`) lets the queries of a chunk of the document choose regions
together. Whether a rule keeps the attention the facts of a document need is measured here
offline, as the decode lab does for answers: `capture_prefill` restores a haystack's dense
prefill, prefills again (densely) every ubatch that holds a planted fact and records the real
post-RoPE queries of every layer from llama.cpp's graph; the keys and values are the saved state's.
`replay_prefill` then chooses regions for each chunk of those queries by a rule and compares the
attention output of the rows it reads with exact attention, per query row: the error that one
routed ubatch hands to the next layer, for the fact's own tokens and for the rest of the chunk.
(The lab measures one ubatch on dense history: it does not compound errors over layers or ubatches.)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvlocal.atomic import write_npz_atomic
from kvlocal.lab.rules import NEG, Geometry, block_means, softmax_over
from kvlocal.route_settings import PREFILL_SHORTLIST_SHARE

SAMPLE_EVERY = 8  # besides the fact tokens, every SAMPLE_EVERY-th row of a ubatch is scored


@dataclass
class PrefillCapture:
    """One haystack: its dense keys and values, and the queries of the ubatches that hold facts."""

    name: str
    doc_keys: np.ndarray  # [layer, cells, n_head_kv*dim] F16
    doc_values: np.ndarray  # [layer, cells, n_head_kv*dim] F16
    starts: np.ndarray  # [ubatch] first cell of each captured ubatch
    queries: list[np.ndarray]  # per ubatch [tokens, layer, n_head, dim] F16
    facts: np.ndarray  # [fact, 2] cell span of every planted fact

    def save(self, path: Path) -> None:
        arrays = {"doc_keys": self.doc_keys, "doc_values": self.doc_values, "starts": self.starts, "facts": self.facts}
        for i, q in enumerate(self.queries):
            arrays[f"q{i}"] = q.astype(np.float16)
        write_npz_atomic(path, arrays)

    @classmethod
    def load(cls, path: Path) -> PrefillCapture:
        with np.load(path) as z:
            starts = z["starts"]
            return cls(path.stem, z["doc_keys"], z["doc_values"], starts,
                       [z[f"q{i}"] for i in range(len(starts))], z["facts"])


def fact_ubatches(facts: np.ndarray, n_tokens: int, ubatch: int, start: int) -> list[tuple[int, int]]:
    """The routed ubatches (first cell >= `start`, on the prefill's grid of `ubatch` cells) that
    hold the first token of a fact."""
    out = []
    for first in range(0, n_tokens, ubatch):
        end = min(n_tokens, first + ubatch)
        if first >= start and any(first <= f0 < end for f0, _ in facts):
            out.append((first, end))
    return out


def capture_prefill(session, case, name: str, start: int, log: Callable[[str], None] = print) -> PrefillCapture:
    """Dense prefill of `case` (its saved state when there is one), then every ubatch past `start`
    that holds a fact prefilled again on the dense history before it, recording its queries."""
    from kvlocal.errors import EngineError
    from kvlocal.lab.capture import BatchQCapture, state_kv
    from kvlocal.lab.decode import fact_span, needle_of

    info = session.model.info
    head_dim = info.head_dim or info.n_embd // info.n_head
    capture = BatchQCapture(info.n_layer, info.n_head, head_dim)
    session.unload()  # the context must be created with the callback installed
    with capture.installed():
        result = session.load_document(case.text, label=f"lab {name}")
    log(f"{name}: {result.n_tokens:,} tokens ({'cached state' if result.cache_hit else f'prefilled in {result.seconds:.0f} s'})")
    state = session.kv_state()
    _, keys, values = state_kv(state, info.n_layer, info.n_head_kv * head_dim)
    tokens = session.prefix_cell_tokens()  # what was prefilled
    facts = np.array([fact_span(session, needle_of(case, p)) for p in case.probes])
    starts, queries = [], []
    for first, end in fact_ubatches(facts, len(tokens), session.n_batch, start):
        if not session.restore_state(state):
            raise EngineError("the lab could not restore the haystack's dense state")
        session.context.truncate(first)
        capture.active = True
        try:
            session.context.decode(tokens[first:end])
        finally:
            capture.active = False
        starts.append(first)
        queries.append(capture.take(end - first))
        log(f"  ubatch {first:,}-{end:,}: queries captured")
    session.unload()  # the history was cut: nothing of this context may be reused
    return PrefillCapture(name, keys, values, np.array(starts), queries, facts)


# A prefill rule chooses `k` regions for a chunk of queries of one layer and KV head: from the
# chunk's ChunkScores, the candidate regions (a bool mask) and k, it returns the chosen region ids.
PrefillRule = Callable[["ChunkScores", np.ndarray, int], np.ndarray]


@dataclass
class ChunkScores:
    fine: np.ndarray  # [rows, n_reg] max over the region's fine centroids of q.c (raw)
    coarse: np.ndarray  # [rows, n_reg] q.c of the region's coarse centroid
    mass: np.ndarray  # [scored rows, n_reg] exact attention mass (the oracle's evidence)
    scale: float


def _top(score: np.ndarray, cand: np.ndarray, k: int) -> np.ndarray:
    s = np.where(cand, score, NEG)
    return np.argsort(-s, kind="stable")[: min(k, int(cand.sum()))]


def engine_rule(shortlist_share: int) -> PrefillRule:
    """The engine's routed ubatch: each query row shares a softmax over the regions' best fine
    centroid and a region scores the largest share any row gives it. With a shortlist share, the
    coarse centroids first keep share x k regions the same way (0: the fine centroids rank every
    candidate)."""

    def pooled(sc: np.ndarray, cand: np.ndarray, scale: float) -> np.ndarray:
        return softmax_over(sc, cand[None, :], scale).max(axis=0)

    def rule(cs: ChunkScores, cand: np.ndarray, k: int) -> np.ndarray:
        if shortlist_share:
            short = np.zeros_like(cand)
            short[_top(pooled(cs.coarse, cand, cs.scale), cand, shortlist_share * k)] = True
            cand = short
        return _top(pooled(cs.fine, cand, cs.scale), cand, k)

    return rule


def oracle_rule(cs: ChunkScores, cand: np.ndarray, k: int) -> np.ndarray:
    """Reference: the regions with the most exact attention mass summed over the scored rows."""
    return _top(cs.mass.sum(axis=0), cand, k)


PREFILL_RULES: dict[str, PrefillRule] = {
    "engine": engine_rule(PREFILL_SHORTLIST_SHARE),  # the routed prefill as the engine runs it
    "oracle-sum": oracle_rule,
}


@dataclass
class PrefillTotals:
    """Per (rule, chunk, k): per scored row, its attention-output error and recall, fact rows apart."""

    err_fact: list
    err_rest: list
    recall_fact: list
    recall_rest: list
    layer_err_fact: dict
    err_est: dict = field(default_factory=dict)  # estimate -> fact rows' error with the unread regions estimated
    rows_read: int = 0
    rows_dense: int = 0


def replay_prefill(cap: PrefillCapture, rules: Sequence[str], chunks: Sequence[int], budgets: Sequence[int],
                   geo: Geometry, totals: dict | None = None, block: int = 8,
                   layers: Sequence[int] | None = None, estimates: Sequence[str] = ()) -> dict:
    """Replay `rules` for every chunk size and budget on every captured ubatch; adds into `totals`
    {(rule, chunk, k): PrefillTotals}. `estimates` (names of ESTIMATES) also score each rule with
    the unread regions joining the attention as their means."""
    totals = totals if totals is not None else {}
    n_layer = cap.doc_keys.shape[0]
    for b, first in enumerate(cap.starts):
        q_all = cap.queries[b]
        n_tok, _, n_head, dim = q_all.shape
        first = int(first)
        scored, f = _scored_rows(cap.facts, first, n_tok)
        for il in (layers if layers is not None else range(n_layer)):
            for h in range(cap.doc_keys.shape[2] // dim):
                view = _head_view(cap, q_all, il, h, first, scored, geo, block, estimates)
                for chunk in chunks:
                    _add_reads(totals, _chunk_reads(view, first, chunk, rules, budgets, geo), view, f, chunk, il)
    return totals


def _scored_rows(facts: np.ndarray, first: int, n_tok: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a ubatch from `first` that are scored (every fact token, and every SAMPLE_EVERY-th
    row), and which of them are a fact's."""
    in_fact = np.zeros(n_tok, bool)
    for f0, f1 in facts:
        lo, hi = max(int(f0), first), min(int(f1), first + n_tok)
        if lo < hi:
            in_fact[lo - first:hi - first] = True
    scored = np.flatnonzero(in_fact | (np.arange(n_tok) % SAMPLE_EVERY == 0))
    return scored, in_fact[scored]


@dataclass
class _HeadView:
    """One layer and KV head of a captured ubatch: every row's centroid scores (a chunk's selection uses
    all its rows) and the scored rows' exact attention, per region."""

    n_tok: int
    n_reg: int
    scored: np.ndarray  # [m] the scored rows
    scale: float
    fine: np.ndarray  # [tok, group, n_reg] each region's best fine centroid score
    coarse: np.ndarray  # [tok, group, n_reg]
    mass: np.ndarray  # [m, group, n_reg] exact attention mass
    part: np.ndarray  # [m, group, n_reg, dim] each region's share of the exact output
    dense_out: np.ndarray  # [m, group, dim]
    dense_norm: np.ndarray  # [m, group]
    visible: np.ndarray  # [m, n_reg] cells of each region each scored row sees (causal)
    estimated: dict  # estimate -> (mass, output numerator) of each region as its means


def _head_view(cap: PrefillCapture, q_all: np.ndarray, il: int, h: int, first: int, scored: np.ndarray,
               geo: Geometry, block: int, estimates: Sequence[str]) -> _HeadView:
    n_tok, _, n_head, dim = q_all.shape
    end = first + n_tok
    group = n_head // (cap.doc_keys.shape[2] // dim)
    n_reg = -(-end // geo.region)
    pos_scored = first + scored
    sl = slice(h * dim, (h + 1) * dim)
    keys = cap.doc_keys[il, :end, sl].astype(np.float32)
    vals = cap.doc_values[il, :end, sl].astype(np.float32)
    q = q_all[:, il, h * group:(h + 1) * group].astype(np.float32)  # [tok, group, dim]
    scale = 1.0 / np.sqrt(dim)
    fine_c = block_means(keys, block, n_reg, geo.region)
    coarse_c = block_means(keys, geo.region, n_reg, geo.region)
    fine = (q @ fine_c.T).reshape(n_tok, group, n_reg, geo.region // block).max(axis=3)
    coarse = q @ coarse_c.T
    # exact attention of the scored rows, summed per region, and each region's output share
    qs = q[scored]  # [m, group, dim]
    lg = (qs @ keys.T) * np.float32(scale)
    lg = np.where(np.arange(end)[None, None, :] <= pos_scored[:, None, None], lg, NEG)
    lg_max = lg.max(axis=2)
    p = np.exp(lg - lg_max[..., None])
    z_dense = p.sum(axis=2)
    p /= z_dense[..., None]
    pad = n_reg * geo.region - end
    pr = np.pad(p, ((0, 0), (0, 0), (0, pad))).reshape(len(scored), group, n_reg, geo.region)
    vr = np.pad(vals, ((0, pad), (0, 0))).reshape(n_reg, geo.region, dim)
    # estimates of each region's share (mass, output numerator) from block means: what the
    # unread regions would add if they joined the attention as their means
    log_z = np.log(z_dense) + lg_max  # [m, group]
    estimated = {name: region_estimate(qs, keys, vals, n_reg, geo.region, geo.region if per == "region" else block,
                                       scale, log_z, var)
                 for name, (per, var) in ESTIMATES.items() if name in estimates}
    # [m, group, n_reg, dim]: one batched product per region
    part = np.matmul(pr.reshape(-1, n_reg, geo.region).transpose(1, 0, 2), vr).transpose(1, 0, 2)
    part = part.reshape(len(scored), group, n_reg, dim)
    dense_out = part.sum(axis=2)
    visible = np.clip(pos_scored[:, None] + 1 - np.arange(n_reg)[None, :] * geo.region, 0, geo.region)
    return _HeadView(n_tok, n_reg, scored, scale, fine, coarse, pr.sum(axis=3), part, dense_out,
                     np.linalg.norm(dense_out, axis=-1), visible, estimated)


def _chunk_reads(view: _HeadView, first: int, chunk: int, rules: Sequence[str], budgets: Sequence[int],
                 geo: Geometry) -> dict:
    """(rule, k) -> [m, n_reg]: the regions each scored row reads when each chunk of `chunk` rows chooses together."""
    read: dict = {}
    scored, n_reg = view.scored, view.n_reg
    for c0 in range(0, view.n_tok, chunk):
        c1 = min(view.n_tok, c0 + chunk)
        rows = (scored >= c0) & (scored < c1)
        if not rows.any():
            continue
        fixed, cand_ids = geo.chunk_fixed_and_candidates(first + c0, first + c1)
        cand = np.zeros(n_reg, bool)
        cand[cand_ids] = True
        cs = ChunkScores(view.fine[c0:c1].reshape(-1, n_reg), view.coarse[c0:c1].reshape(-1, n_reg),
                         view.mass[rows].reshape(-1, n_reg), view.scale)
        for name in rules:
            for k in budgets:
                sel = PREFILL_RULES[name](cs, cand, k)
                m = read.setdefault((name, k), np.zeros((len(scored), n_reg), bool))
                m[np.ix_(rows, fixed)] = True
                m[np.ix_(rows, sel)] = True
    return read


def _add_reads(totals: dict, read: dict, view: _HeadView, f: np.ndarray, chunk: int, il: int) -> None:
    """Each rule's attention-output error and recall of the rows it read, into `totals`."""
    for (name, k), m in read.items():
        got = (view.mass * m[:, None, :]).sum(axis=2)  # [m, group]
        num = np.matmul(m.astype(np.float32)[:, None, None, :], view.part)[:, :, 0]  # [m, group, dim]
        norm = np.maximum(view.dense_norm, 1e-30)
        err = np.linalg.norm(num / np.maximum(got, 1e-30)[..., None] - view.dense_out, axis=-1) / norm
        t = totals.setdefault((name, chunk, k), PrefillTotals([], [], [], [], defaultdict(list)))
        unread = (~m).astype(np.float32)[:, None, :, None]  # [m, 1, n_reg, 1]
        for est, (e_mass, e_part) in view.estimated.items():
            z = got + (e_mass * unread[..., 0]).sum(axis=2)
            e_num = num + (e_part * unread).sum(axis=2)
            e_err = np.linalg.norm(e_num / z[..., None] - view.dense_out, axis=-1) / norm
            t.err_est.setdefault(est, []).extend(e_err[f].ravel().tolist())
        t.err_fact += err[f].ravel().tolist()
        t.err_rest += err[~f].ravel().tolist()
        t.recall_fact += got[f].ravel().tolist()
        t.recall_rest += got[~f].ravel().tolist()
        t.layer_err_fact[il] += err[f].ravel().tolist()
        t.rows_read += int((m * view.visible).sum())
        t.rows_dense += int(view.visible.sum())


# estimates of an unread region: the mean key and value of the whole region (the engine's
# --prefill-estimate) or of each centroid block, optionally with the keys' per-channel variance
ESTIMATES = {"region": ("region", False), "block": ("block", False), "block+var": ("block", True)}


def region_estimate(q: np.ndarray, keys: np.ndarray, vals: np.ndarray, n_reg: int, region: int, block: int,
                    scale: float, log_z: np.ndarray, variance: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per scored row and region, the attention mass and output numerator (both over the row's exact
    normaliser) that the region's blocks of `block` cells give as their mean key and value, weighted
    by their cell counts: exp(s q.k_mean) (times exp(s^2/2 sum_d q_d^2 var_d) with `variance`).
    q [m, group, dim]; returns ([m, group, n_reg], [m, group, n_reg, dim])."""
    k = np.pad(keys, ((0, n_reg * region - len(keys)), (0, 0))).reshape(-1, block, keys.shape[1])
    v = np.pad(vals, ((0, n_reg * region - len(vals)), (0, 0))).reshape(-1, block, vals.shape[1])
    km, vm = k.mean(axis=1), v.mean(axis=1)  # [n_blocks, dim]
    lg = (q @ km.T) * np.float32(scale)  # [m, group, n_blocks]
    if variance:
        lg = lg + 0.5 * np.float32(scale) ** 2 * ((q * q) @ k.var(axis=1).T)
    w = block * np.exp(np.minimum(lg - log_z[..., None], 50.0))  # [m, group, n_blocks]
    per = region // block
    mass = w.reshape(*w.shape[:2], n_reg, per).sum(axis=3)
    num = np.matmul(w.reshape(-1, n_reg, per).transpose(1, 0, 2), vm.reshape(n_reg, per, -1)).transpose(1, 0, 2)
    return mass, num.reshape(*w.shape[:2], n_reg, vals.shape[1])


def summarize_prefill(totals: dict) -> list[dict]:
    rows = []
    for (name, chunk, k), t in sorted(totals.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        ef, er = np.array(t.err_fact), np.array(t.err_rest)
        rows.append({
            "rule": name, "chunk": chunk, "top_k": k,
            "err_fact": float(ef.mean()), "err_fact_p90": float(np.percentile(ef, 90)),
            "err_rest": float(er.mean()), "recall_fact": float(np.mean(t.recall_fact)),
            "recall_rest": float(np.mean(t.recall_rest)), "n_fact_rows": len(ef),
            "read_share": t.rows_read / t.rows_dense if t.rows_dense else 0.0,
            "layer_err_fact": {int(il): float(np.mean(v)) for il, v in sorted(t.layer_err_fact.items())},
            "err_est": {name: float(np.mean(v)) for name, v in t.err_est.items()},
        })
    return rows


def markdown_prefill(rows: list[dict]) -> str:
    ests = [e for e in ESTIMATES if any(e in r["err_est"] for r in rows)]
    lines = ["| rule | chunk | k | output error, fact rows (mean / p90) | other rows | recall, fact rows | other rows | "
             + "".join(f"+ estimate {e} | " for e in ests) + "cells read / dense |",
             "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(ests) + "---:|"]
    for r in rows:
        est = "".join(f"{r['err_est'][e]:.3f} | " for e in ests)
        lines.append(f"| {r['rule']} | {r['chunk']} | {r['top_k']} | {r['err_fact']:.3f} / {r['err_fact_p90']:.3f} | "
                     f"{r['err_rest']:.3f} | {r['recall_fact']:.3f} | {r['recall_rest']:.3f} | {est}{r['read_share']:.3f} |")
    return "\n".join(lines)
