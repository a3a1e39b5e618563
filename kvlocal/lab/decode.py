"""The decode lab (`kvlocal lab`): capture the dense model once per case, replay any number of selection rules offline.

`capture_case` prefills a haystack (or restores its saved state), decodes every probe densely while
recording the real post-RoPE queries and keys of every layer, and saves them (an .npz per case, so
replays need no engine). `replay_case` scores rules against exact attention; `summarize` and
`markdown` turn the numbers into the table BENCHMARKS.md shows.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvlocal.atomic import write_npz_atomic
from kvlocal.evals.tasks import Case, Probe
from kvlocal.lab.rules import RULES, Geometry, Head, HeadResult, reads_question_densely, replay

FAR_TAIL = 0.2  # a (step, layer, head) "reaches far" when this share of its attention is outside sinks and window
TOP_PAIRS = 10  # the (layer, head) pairs per step that attend most to the asked fact


@dataclass
class CaseCapture:
    """Everything a replay needs for one haystack: keys, and per probe its steps' queries and keys."""

    name: str
    doc_keys: np.ndarray  # [layer, cells, n_head_kv*dim] F16
    probes_q: list[np.ndarray]  # per probe [steps, layer, n_head, dim] F32
    probes_k: list[np.ndarray]  # per probe [steps, layer, n_head_kv, dim] F32
    facts: np.ndarray  # [probe, 2] cell span of the asked fact
    correct: np.ndarray  # [probe] the dense answer was right
    depths: np.ndarray  # [probe]
    n_question: np.ndarray | None = None  # [probe] steps that read the question (the rest are answer steps)
    doc_values: np.ndarray | None = None  # [layer, cells, n_head_kv*dim] F16, for the attention-output error

    @property
    def n_doc(self) -> int:
        return self.doc_keys.shape[1]

    def save(self, path: Path) -> None:
        arrays = {"doc_keys": self.doc_keys, "facts": self.facts, "correct": self.correct, "depths": self.depths}
        if self.n_question is not None:
            arrays["n_question"] = self.n_question
        if self.doc_values is not None:
            arrays["doc_values"] = self.doc_values
        for i, (q, k) in enumerate(zip(self.probes_q, self.probes_k)):
            arrays[f"q{i}"], arrays[f"k{i}"] = q.astype(np.float16), k.astype(np.float16)
        write_npz_atomic(path, arrays)

    @classmethod
    def load(cls, path: Path) -> CaseCapture:
        with np.load(path) as z:
            n = len(z["facts"])
            return cls(path.stem, z["doc_keys"], [z[f"q{i}"].astype(np.float32) for i in range(n)],
                       [z[f"k{i}"].astype(np.float32) for i in range(n)], z["facts"], z["correct"], z["depths"],
                       z["n_question"] if "n_question" in z.files else None,
                       z["doc_values"] if "doc_values" in z.files else None)


def fact_span(session, needle: str) -> tuple[int, int]:
    """Token span [start, end) of `needle` in the loaded document's prompt (BPE may shift a boundary by one)."""
    parts = session.parts
    at = parts.document.find(needle)
    if at < 0:
        raise ValueError(f"needle not found in the document: {needle[:60]!r}")
    head = len(session.tokenize_prompt(parts.prefix_segments()[:1], bos=True))
    start = head + len(session.tokenize(parts.document[:at], bos=False))
    end = head + len(session.tokenize(parts.document[: at + len(needle)], bos=False))
    return max(0, start - 1), end + 1


def needle_of(case: Case, probe: Probe) -> str:
    """The planted sentence a probe asks about: the one holding its first answer."""
    for sentence in re.split(r"(?<=[.!?])\s+", case.text):
        if probe.answers[0] in sentence:
            return sentence.strip()
    raise ValueError(f"no sentence holds {probe.answers[0]!r}")


def capture_case(session, case: Case, name: str, max_tokens: int, log: Callable[[str], None] = print) -> CaseCapture:
    """Dense decode of every probe of `case`, recording Q and K of every layer at every step."""
    from kvlocal.evals.tasks import score
    from kvlocal.lab.capture import QKCapture, state_kv
    from kvlocal.routing import RouteConfig

    info = session.model.info
    head_dim = info.head_dim or info.n_embd // info.n_head
    capture = QKCapture(info.n_layer, info.n_head, info.n_head_kv, head_dim)
    session.unload()  # the context must be created with the callback installed
    with capture.installed():
        result = session.load_document(case.text, label=f"lab {name}")
    log(f"{name}: {result.n_tokens:,} tokens ({'cached state' if result.cache_hit else f'prefilled in {result.seconds:.0f} s'})")
    _, doc_keys, doc_values = state_kv(session.kv_state(), info.n_layer, info.n_head_kv * head_dim)
    qs, ks, facts, correct, n_question = [], [], [], [], []
    for probe in case.probes:
        n_question.append(question_steps(session, probe.question))
        capture.reset()
        capture.active = True
        try:
            answer = session.answer(probe.question, route=RouteConfig(mode="full", question="steps"), max_tokens=max_tokens)
        finally:
            capture.active = False
        q, k = capture.steps.arrays()
        qs.append(q)
        ks.append(k)
        facts.append(fact_span(session, needle_of(case, probe)))
        correct.append(score(probe, answer.text) >= 1.0)
        log(f"  depth {probe.depth:.2f}: {len(q)} steps, dense answer {answer.text.strip()[:40]!r} "
            f"({'right' if correct[-1] else 'wrong'})")
    return CaseCapture(name, doc_keys, qs, ks, np.array(facts), np.array(correct),
                       np.array([p.depth for p in case.probes]), np.array(n_question), doc_values)


def question_steps(session, question: str) -> int:
    """Decode steps that read the question (its tokens and the template's turn change), as `Session.ask` feeds them."""
    return len(session.tokenize_prompt(session.parts.question_segments(question), bos=False))


@dataclass
class RuleTotals:
    """Sums over the replayed heads of one rule and budget."""

    recall_far: list  # per far-reaching (probe, step, layer, head): recall
    layer_recall: dict  # layer -> list of recalls (far-reaching)
    hits: list  # per (probe, step): share of the top pairs whose fact region was read
    ranks: list
    answer_hits: list  # per (probe, step) that predicts an answer token (the last question step on)
    out_err: list = field(default_factory=list)  # per (answer step, layer, query head) attention-output error
    out_err_est: list = field(default_factory=list)
    out_err_var: list = field(default_factory=list)
    layer_out_err_est: dict = field(default_factory=lambda: defaultdict(list))
    layer_out_err: dict = field(default_factory=lambda: defaultdict(list))
    rows_read: int = 0
    rows_scan: float = 0.0  # in F16 key rows' bytes
    rows_dense: int = 0


def layer_scale(spec: str, n_layer: int) -> np.ndarray:
    """Per-layer factors on the budget from "2-11:2,14-27:0.5" (first-last layer: factor; 1 elsewhere)."""
    scale = np.ones(n_layer)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            span, factor = part.split(":")
            first, _, last = span.partition("-")
            lo, hi, f = int(first), int(last or first), float(factor)
        except ValueError:
            raise ValueError(f"layer budget scale {part!r}: give first-last:factor, e.g. 2-11:2") from None
        if not (0 <= lo <= hi < n_layer and f > 0):
            raise ValueError(f"layer budget scale {part!r}: layers 0-{n_layer - 1}, a positive factor")
        scale[lo:hi + 1] = f
    return scale


def replay_case(cap: CaseCapture, rules: Sequence[str], budgets: Sequence[int], geo: Geometry,
                totals: dict | None = None, only_outside: bool = True, scale: np.ndarray | None = None,
                probe_log: list | None = None) -> dict:
    """Replay `rules` at every budget on a capture; adds into `totals` {(rule, k): RuleTotals}. With
    `scale` (a factor per layer), layer l selects round(k * scale[l]) regions (at least 1) for the
    nominal budget k: the bytes and the reduction count what each layer really reads. With
    `probe_log`, one row per (probe, rule, budget) is appended to it (see `probe_row`)."""
    totals = totals if totals is not None else {}
    n_layer = cap.doc_keys.shape[0]
    for i, (q_all, k_all) in enumerate(zip(cap.probes_q, cap.probes_k)):
        n_steps, _, n_head, dim = q_all.shape
        n_head_kv = k_all.shape[2]
        group = n_head // n_head_kv
        pos = cap.n_doc + np.arange(n_steps)
        fact = tuple(int(x) for x in cap.facts[i])
        n_q = int(cap.n_question[i]) if cap.n_question is not None else 0
        # the steps that predict an answer token: the last question step on, not the one predicting the end
        answer_steps = np.arange(n_q - 1, n_steps - 1) if n_q else None
        fixed0, _ = geo.fixed_and_candidates(int(pos[0]))
        fact_region = (fact[0] + fact[1]) // 2 // geo.region
        if only_outside and fact_region in set(fixed0.tolist()):
            continue  # a fact in the sinks or the window says nothing about routing
        per = defaultdict(list)  # (rule, k) -> [(layer, kv head, HeadResult)]
        for il in range(n_layer):
            for h in range(n_head_kv):
                keys = np.concatenate([cap.doc_keys[il, :, h * dim:(h + 1) * dim].astype(np.float32), k_all[:, il, h]])
                head = Head(q_all[:, il, h * group:(h + 1) * group], keys, pos, 1.0 / np.sqrt(dim), n_q)
                values = None if cap.doc_values is None else cap.doc_values[il, :, h * dim:(h + 1) * dim].astype(np.float32)
                layer_ks = [k if scale is None else max(1, int(round(k * scale[il]))) for k in budgets]
                for name in rules:
                    results = replay(head, geo, RULES[name], sorted(set(layer_ks)), fact, values, answer_steps)
                    for k, k_layer in zip(budgets, layer_ks):
                        per[(name, k)].append((il, h, results[k_layer]))
        for key, results in per.items():
            _accumulate(totals.setdefault(key, RuleTotals([], defaultdict(list), [], [], [])), results, group,
                        answer_steps)
            if probe_log is not None and answer_steps is not None:
                first = 1 if reads_question_densely(RULES[key[0]]) else 0
                probe_log.append(dict(probe_row(results, group, answer_steps[first:], first), case=cap.name, probe=i,
                                      depth=float(cap.depths[i]), dense_right=bool(cap.correct[i]),
                                      rule=key[0], top_k=key[1]))
    return totals


class FactPair(NamedTuple):
    """One (layer, query head) of a step, by its attention to the asked fact."""

    mass: float  # its attention mass on the fact's cells
    hit: bool  # the rule read the region holding its peak on the fact (or it is fixed)
    rank: int  # the rank of that region among the candidates (0: fixed)
    layer: int
    query_head: int


def top_fact_pairs(results: list[tuple[int, int, HeadResult]], group: int, step: int) -> list[FactPair]:
    """The TOP_PAIRS (layer, query head) pairs of a step that attend most to the asked fact, those
    with over 1 % of their mass on it."""
    pairs = [FactPair(float(r.fact_mass[step, g]), bool(r.fact_hit[step, g]), int(r.fact_rank[step]), il, h * group + g)
             for il, h, r in results for g in range(group)]
    pairs.sort(key=lambda x: -x.mass)
    return [x for x in pairs[:TOP_PAIRS] if x.mass > 0.01]


def probe_row(results: list[tuple[int, int, HeadResult]], group: int, answer_steps: np.ndarray, first: int = 0) -> dict:
    """Where one probe's answer loses its fact under one rule. At each routed answer step (a rule with
    a dense question pass routes from the second answer token on: `first` = 1, the answer token
    `answer_steps[0]` predicts), the (layer, query head) pairs that attend most to the asked fact (the
    TOP_PAIRS of them with over 1 % of their mass on it), and whether the rule read the region holding
    each one's peak on the fact. Reported: the share read per step, the first answer token whose step
    left a top pair unread, how often each pair (layer.query-head) was left unread, and the median
    rank of the fact's region among the candidates (0: it sat in the sinks or window)."""
    hits, missed, ranks = [], defaultdict(int), []
    for s in answer_steps:
        top = top_fact_pairs(results, group, s)
        if not top:
            hits.append(float("nan"))
            continue
        hits.append(float(np.mean([x.hit for x in top])))
        ranks += [x.rank for x in top]
        for x in top:
            if not x.hit:
                missed[f"{x.layer}.{x.query_head}"] += 1
    first_drop = next((first + j for j, h in enumerate(hits) if h < 1.0), None)
    return {"answer_hits": hits, "first_drop": first_drop, "missed_pairs": dict(missed),
            "fact_rank_median": float(np.median(ranks)) if ranks else float("nan")}


def probe_markdown(rows: list[dict], outcomes: dict | None = None) -> str:
    """One line per probe: for every (rule, budget), the share of the top fact-attending pairs read at
    its routed answer steps (mean and worst), the first answer token whose step lost one, and the
    pairs lost most often (layer.query-head x steps). `outcomes` maps (case, probe) to a text column
    (e.g. the answers of an eval run)."""
    keys = list(dict.fromkeys((r["rule"], r["top_k"]) for r in rows))
    by = {(r["case"], r["probe"], r["rule"], r["top_k"]): r for r in rows}
    probe_of = {}  # (case, probe) -> its first row: the depth and the dense answer are the same in all
    for r in rows:
        probe_of.setdefault((r["case"], r["probe"]), r)
    extra = ["answers"] if outcomes else []
    lines = ["| case | depth | dense | " + " | ".join([f"{n} k={k}" for n, k in keys] + extra) + " |",
             "|---|---:|---|" + "---|" * (len(keys) + len(extra))]
    for case, i in probe_of:
        cells = []
        for n, k in keys:
            r = by.get((case, i, n, k))
            if r is None:
                cells.append("–")
                continue
            h = np.array([x for x in r["answer_hits"] if x == x])
            lost = sorted(r["missed_pairs"].items(), key=lambda x: -x[1])[:3]
            where = "" if r["first_drop"] is None else f", token {r['first_drop']}: " + " ".join(f"{p}x{c}" for p, c in lost)
            cells.append(f"{h.mean():.2f} (min {h.min():.1f}){where}" if len(h) else "–")
        probe = probe_of[(case, i)]
        row = [case, f"{probe['depth']:.2f}", "right" if probe["dense_right"] else "wrong"] + cells
        if outcomes:
            row.append(outcomes.get((case, i), ""))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _accumulate(t: RuleTotals, results: list[tuple[int, int, HeadResult]], group: int,
                answer_steps: np.ndarray | None = None) -> None:
    for il, _, r in results:
        far = r.tail >= FAR_TAIL
        rec = (r.got[far] / r.tail[far]).tolist()
        t.recall_far += rec
        t.layer_recall[il] += rec
        t.rows_read += int(r.rows_read.sum())
        t.rows_scan += float(r.rows_scan.sum())
        t.rows_dense += int(r.rows_dense.sum())
        if r.out_err is not None:
            t.out_err += r.out_err.ravel().tolist()
            t.out_err_est += r.out_err_est.ravel().tolist()
            t.out_err_var += r.out_err_var.ravel().tolist()
            t.layer_out_err_est[il] += r.out_err_est.ravel().tolist()
            t.layer_out_err[il] += r.out_err.ravel().tolist()
    n_steps = results[0][2].tail.shape[0]
    for s in range(n_steps):
        top = top_fact_pairs(results, group, s)
        if top:
            t.hits.append(float(np.mean([x.hit for x in top])))
            if answer_steps is not None and s in answer_steps:
                t.answer_hits.append(t.hits[-1])
            t.ranks += [x.rank for x in top if x.rank > 0]


def summarize(totals: dict) -> list[dict]:
    rows = []
    for (name, k), t in totals.items():
        rec = np.array(t.recall_far) if t.recall_far else np.zeros(1)
        dense_bytes = 2 * t.rows_dense  # K and V rows
        read = 2 * t.rows_read + t.rows_scan  # gathered K and V rows + scanned key-sized metadata rows
        rows.append({
            "rule": name, "top_k": k,
            "scan_share_of_k": t.rows_scan / t.rows_dense if t.rows_dense else 0.0,
            "recall_far": float(rec.mean()), "recall_far_p10": float(np.percentile(rec, 10)),
            "n_far": len(t.recall_far),
            "fact_hit": float(np.mean(t.hits)) if t.hits else float("nan"), "n_steps": len(t.hits),
            "answer_hit": float(np.mean(t.answer_hits)) if t.answer_hits else float("nan"),
            "answer_hit_all": float(np.mean(np.array(t.answer_hits) >= 1.0)) if t.answer_hits else float("nan"),
            "fact_rank_median": float(np.median(t.ranks)) if t.ranks else float("nan"),
            "reduction": dense_bytes / read if read else float("inf"),
            "out_err": float(np.mean(t.out_err)) if t.out_err else float("nan"),
            "out_err_est": float(np.mean(t.out_err_est)) if t.out_err_est else float("nan"),
            "out_err_var": float(np.mean(t.out_err_var)) if t.out_err_var else float("nan"),
            "layer_out_err_est": {int(il): float(np.mean(v)) for il, v in sorted(t.layer_out_err_est.items()) if v},
            "layer_out_err": {int(il): float(np.mean(v)) for il, v in sorted(t.layer_out_err.items()) if v},
            "layer_recall": {int(il): float(np.mean(v)) for il, v in sorted(t.layer_recall.items()) if v},
        })
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| rule | k | scan (x K bytes) | recall, far-reaching | worst decile | fact hit | answer steps: fact hit | all top pairs | output error | + estimate | + variance | fact rank (median) | KV bytes reduction |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        scan = f"1/{1 / r['scan_share_of_k']:.0f}" if r["scan_share_of_k"] else "–"
        lines.append(f"| {r['rule']} | {r['top_k']} | {scan} | {r['recall_far']:.2f} | {r['recall_far_p10']:.2f} | "
                     f"{r['fact_hit']:.2f} | {r['answer_hit']:.2f} | {r['answer_hit_all']:.2f} | {r['out_err']:.2f} | "
                     f"{r['out_err_est']:.2f} | {r['out_err_var']:.2f} | {r['fact_rank_median']:.0f} | "
                     f"{r['reduction']:.1f}x |")
    return "\n".join(lines)


def layer_markdown(rows: list[dict], rules: Sequence[str]) -> str:
    """Recall of far-reaching heads per layer, one column per rule (at its first budget)."""
    chosen = {}
    for r in rows:
        chosen.setdefault(r["rule"], r)
    cols = [chosen[n] for n in rules if n in chosen]
    layers = sorted({il for r in cols for il in r["layer_recall"]})
    lines = ["| layer | " + " | ".join(r["rule"] for r in cols) + " |", "|---:|" + "---:|" * len(cols)]
    for il in layers:
        lines.append(f"| {il} | " + " | ".join(f"{r['layer_recall'].get(il, float('nan')):.2f}" for r in cols) + " |")
    return "\n".join(lines)


def layer_error_markdown(rows: list[dict]) -> str:
    """Attention-output error per layer at the answer steps, for every (rule, budget) that measured it:
    routed alone / with the region-mean estimate of the unread mass."""
    cols = [r for r in rows if r.get("layer_out_err")]
    if not cols:
        return ""
    layers = sorted({il for r in cols for il in r["layer_out_err"]})
    lines = ["| layer | " + " | ".join(f"{r['rule']} k={r['top_k']}" for r in cols) + " |", "|---:|" + "---:|" * len(cols)]
    for il in layers:
        cells = [f"{r['layer_out_err'].get(il, float('nan')):.2f} / {r['layer_out_err_est'].get(il, float('nan')):.2f}" for r in cols]
        lines.append(f"| {il} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
