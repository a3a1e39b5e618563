"""Routed vs dense prefill, same haystacks, same decode routes: accuracy on the facts outside the
sinks and window (n, 95 % Wilson interval), the probes whose score changed, and the prefill times.

    python bench-results/prefill-routed/compare.py ROUTED/results.jsonl DENSE/results.jsonl [DENSE2/results.jsonl ...]

The first file holds the routed-prefill rows; the others the dense-prefill rows of the same
haystacks (length, task, seed). A probe is paired by (length, task, seed, depth) and route: full,
and geometric with the default scoring (an automatic shortlist by the value it took, and the
number of pins: rows from before the pins are their own route).
"""
import json
import sys
from collections import defaultdict

from kvlocal.evals.report import _outside_window, scoring, wilson_interval
from kvlocal.route_settings import DEFAULT_CENTROID_BLOCK, DEFAULT_KEEP, DEFAULT_TOP_K


def route_label(r: dict) -> str | None:
    if r["mode"] == "full":
        return "full"
    if r["mode"] != "geometric":
        return r["mode"]
    blk, shortlist, keep, est, question, ctype, pin = scoring(r)
    if (r["top_k"], blk, keep, est, question, ctype) != (DEFAULT_TOP_K, DEFAULT_CENTROID_BLOCK, DEFAULT_KEEP, False, "dense", "f16"):
        return None
    return f"geometric (shortlist {r.get('shortlist_used', shortlist)}, {pin} pins)"


def load(paths: list[str]) -> dict:
    out = {}
    for path in paths:
        for line in open(path):
            r = json.loads(line)
            label = route_label(r)
            if label and _outside_window(r):
                out[(label, r["length"], r["task"], r["seed"], r["depth"])] = r
    return out


routed, dense = load(sys.argv[1:2]), load(sys.argv[2:])
pairs = defaultdict(list)
for key, r in routed.items():
    if key in dense:
        pairs[key[:3]].append((dense[key], r))


def acc(scores: list[float]) -> str:
    a = sum(scores) / len(scores)
    lo, hi = wilson_interval(a, len(scores))
    return f"{a:.0%} [{lo:.0%}–{hi:.0%}]"


print("| length | task | decode route | n | dense prefill | routed prefill | difference | probes that changed (dense→routed) |")
print("|---:|---|---|---:|---:|---:|---:|---|")
for (label, length, task), ps in sorted(pairs.items(), key=lambda x: (x[0][1], x[0][2], x[0][0])):
    d = [p[0]["score"] for p in ps]
    r = [p[1]["score"] for p in ps]
    changed = [f"s{p[0]['seed']} d{p[0]['depth']:g}: {p[0]['score']:.0f}→{p[1]['score']:.0f}" for p in ps
               if p[0]["score"] != p[1]["score"]]
    diff = (sum(r) - sum(d)) / len(ps)
    print(f"| {length} | {task} | {label} | {len(ps)} | {acc(d)} | {acc(r)} | {diff:+.1%} | {', '.join(changed) or 'none'} |")

print()
print("| length | task | seed | tokens | routed prefill s | tok/s | attention bytes reduction |")
print("|---:|---|---:|---:|---:|---:|---:|")
seen = set()
for path in sys.argv[1:2]:
    for line in open(path):
        r = json.loads(line)
        key = (r["length"], r["task"], r["seed"])
        if r.get("prefill_tps") and key not in seen:  # a haystack prefilled in this run, not restored
            seen.add(key)
            print(f"| {r['length']} | {r['task']} | {r['seed']} | {r['n_tokens']:,} | {r['n_tokens'] / r['prefill_tps']:.0f} | "
                  f"{r['prefill_tps']:.1f} | {r['prefill_reduction']:.1f}x |")
