"""What the wrong answers of the 32k passkey grid are: another depth's code (a real needle of the
same haystack, read from the wrong place) or something else (a near-copy with wrong digits, a cut
answer), per route, over the needles outside the sinks and window.

    python bench-results/passkey-32k-question/miss_kinds.py bench-results/passkey-32k-question/*/results.jsonl
"""
import json
import sys
from collections import Counter, defaultdict

from kvlocal.evals.report import _outside_window, scoring

rows = [json.loads(line) for path in sys.argv[1:] for line in open(path)]
codes = defaultdict(set)  # seed -> every needle's code
for r in rows:
    codes[r["seed"]].update(r["expected"])

routes = defaultdict(dict)  # route -> (seed, depth) -> row (a probe counted once per route)
for r in rows:
    if _outside_window(r):
        # geometric rows by their scoring, an automatic shortlist by the value it took (so the default's
        # rows join the same settings given explicitly)
        blk, shortlist, keep, est, _ = scoring(r)
        shortlist = r.get("shortlist_used", shortlist)
        label = r["mode"] if r["mode"] != "geometric" else (
            f"geometric top-{r['top_k']}, block {blk}, shortlist {shortlist}" + (f", keep {keep:g}" if keep != 0.9 else "")
            + (", estimate" if est else ""))
        routes[label][(r["seed"], r["depth"])] = r

print("| route | n | right | another depth's code | other |")
print("|---|---:|---:|---:|---:|")
for label, probes in sorted(routes.items()):
    kinds = Counter("right" if r["score"] == 1 else "depth" if r["answer"].strip() in codes[r["seed"]] else "other"
                    for r in probes.values())
    print(f"| {label} | {len(probes)} | {kinds['right']} | {kinds['depth']} | {kinds['other']} |")
