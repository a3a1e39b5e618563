"""Accuracy outside the window, total reduction and the answer steps' reduction per route, from
results.jsonl files of `kvlocal eval --question-pass dense`, and how often a route gives the answer
full attention gives on the same fact (paired: where full itself is often wrong, as at 32k, this
says more than accuracy), the MiB one answer step reads (K/V rows and metadata apart) and the median
decode rate the eval rows recorded (short answers, not `kvlocal bench`). Rows that record the question's read
(question_bytes_read/dense) use it; older rows take one dense read (bytes_dense / steps) as the
question's, which is what a dense question batch reads.

    python bench-results/lookalike-8k-question/answer_steps.py FOLDER/results.jsonl ...
"""
import json
import sys
from collections import defaultdict
from statistics import mean, median

from kvlocal.evals.report import _outside_window, question_pass, scoring, wilson_interval
from kvlocal.route_settings import DEFAULT_KEEP, SHORTLIST_AUTO

groups = defaultdict(list)
full_answer = {}  # (length, seed, depth, question pass) -> full attention's answer
for path in sys.argv[1:]:
    for line in open(path):
        r = json.loads(line)
        if r["mode"] == "full":
            full_answer[(r["length"], r["seed"], r["depth"], question_pass(r))] = r["answer"].strip()
        # scoring settings (centroid block, shortlist as set, keep, estimate) matter to geometric rows only;
        # an automatic shortlist is also told by the value it took
        geo = scoring(r) if r["mode"] == "geometric" else None
        key = (r["length"], r["mode"], r["top_k"] if r["mode"] != "full" else 0, question_pass(r), geo,
               r.get("shortlist_used") if geo and geo[1] == SHORTLIST_AUTO else None)
        groups[key].append(r)


def answer_reduction(r):
    if "question_bytes_read" in r:
        q_read, q_dense = r["question_bytes_read"], r["question_bytes_dense"]
    else:
        q_read = q_dense = r["bytes_dense"] / r["steps"]
    read = r["bytes_read"] - q_read
    return (r["bytes_dense"] - q_dense) / read if read > 0 else 1.0


def step_mib(rows):
    """Mean MiB one answer step reads: K/V rows + metadata (centroids, memory, estimate). Only rows of a
    dense question, whose one batch read no metadata and is recorded apart (with pins it reads K once
    more, counted as metadata of the whole answer: no split then)."""
    dense_q = [r for r in rows if question_pass(r) == "dense" and "question_bytes_read" in r and r["steps"] > 1
               and not r.get("pin")]
    if not dense_q:
        return "–"
    kv = mean((r["bytes_read"] - r["bytes_meta"] - r["question_bytes_read"]) / (r["steps"] - 1) for r in dense_q)
    meta = mean(r["bytes_meta"] / (r["steps"] - 1) for r in dense_q)
    return f"{kv / 2**20:.1f} + {meta / 2**20:.1f}"


def same_as_full(rows):
    paired = [r["answer"].strip() == full_answer[key] for r in rows
              if (key := (r["length"], r["seed"], r["depth"], question_pass(r))) in full_answer]
    if not paired:
        return "–"
    share = mean(paired)
    lo, hi = wilson_interval(share, len(paired))
    return f"{share:.0%} [{lo * 100:.0f}–{hi * 100:.0f}] ({len(paired)})"


print("| length | route | question | acc. outside window [95 % CI] (n) | same answer as full, outside window (n) "
      "| total reduction | answer steps' reduction | MiB per answer step: K/V + metadata | decode tok/s (median) |")
print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
for (length, mode, k, q, geo, used), rows in sorted(groups.items(), key=lambda kv: str(kv[0])):
    far = [r for r in rows if _outside_window(r)]
    acc = mean(r["score"] for r in far)
    lo, hi = wilson_interval(acc, len(far))
    if geo is None:
        route = "full" if mode == "full" else f"{mode} top-{k}"
    else:
        blk, shortlist, keep, est, _, ctype, pin = geo
        shortlist = f"{used} (auto)" if shortlist == SHORTLIST_AUTO else shortlist
        route = (f"{mode} top-{k}, shortlist {shortlist}{'' if est else ', no estimate'}, block {blk}"
                 + (f", keep {keep:g}" if keep != DEFAULT_KEEP else "") + (f", {ctype} centroids" if ctype != "f16" else "")
                 + (f", {pin} pinned" if pin else ""))
    print(f"| {length:,} | {route} | {q} | {acc:.0%} [{lo * 100:.0f}–{hi * 100:.0f}] ({len(far)}) | {same_as_full(far)} | "
          f"{mean(r['reduction'] for r in rows):.1f}x | {mean(answer_reduction(r) for r in rows):.1f}x | "
          f"{step_mib(rows)} | {median(r['decode_tps'] for r in rows):.1f} |")
