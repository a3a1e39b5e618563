"""The lab's per-probe rows (probes.jsonl of `kvlocal lab`) beside the answers an eval run gave.

    .venv/bin/python bench-results/lab-onekey-8k/probes_vs_answers.py PROBES RESULTS [HAYSTACK] [--summary]

PROBES: one or more probes.jsonl (comma-separated; e.g. the runs of several --layer-budget folders,
each tagged with its folder's name). RESULTS: an eval's results.jsonl; HAYSTACK: the --haystack it
ran with ("" for generated filler). The answers column: full attention's / the default route's (top-4,
pins 2, dense question, F16 centroids), a cross after each wrong one. Only facts outside the sinks
and window appear (the lab's probes).

--summary: per rule, budget (and folder), the share of the top fact-attending (layer, head) pairs read
at the routed answer steps, over all probes and over the probes full answers and the default misses.
"""

import json
import re
import sys
from pathlib import Path

import numpy as np

from kvlocal.evals.runner import question_pass
from kvlocal.lab.decode import probe_markdown
from kvlocal.route_settings import (
    DEFAULT_CENTROID_TYPE, DEFAULT_HINTS, DEFAULT_MODE, DEFAULT_PIN, DEFAULT_QUESTION, DEFAULT_SHORTLIST,
    DEFAULT_TOP_K, DEFAULT_WINDOW,
)


def answers_by_probe(results_path: str, haystack: str) -> dict:
    answers = {}
    for line in open(results_path):
        r = json.loads(line)
        if r.get("haystack", "") != haystack or r["task"] != "onekey":
            continue
        # rows of older runs lack the fields added since; their values then were the defaults
        default = (r["mode"] == DEFAULT_MODE and r["top_k"] == DEFAULT_TOP_K and r.get("pin", DEFAULT_PIN) == DEFAULT_PIN
                   and r.get("hints", DEFAULT_HINTS) == DEFAULT_HINTS and question_pass(r) == DEFAULT_QUESTION
                   and r.get("window", DEFAULT_WINDOW) == DEFAULT_WINDOW
                   and r.get("centroid_type", DEFAULT_CENTROID_TYPE) == DEFAULT_CENTROID_TYPE
                   and r.get("shortlist", DEFAULT_SHORTLIST) == DEFAULT_SHORTLIST)
        if r["mode"] == "full" or default:
            answers[(r["seed"], r["probe"], r["mode"])] = (r["answer"].strip(), r["score"] >= 1)
    return answers


def load_probes(spec: str) -> list[dict]:
    rows = []
    for path in spec.split(","):
        tag = Path(path).parent.name
        rows += [dict(json.loads(line), folder=tag) for line in open(path)]
    return rows


def seed_of(case: str) -> int:
    return int(re.search(r"-s(\d+)-", case).group(1))


def summary(probes: list[dict], answers: dict) -> str:
    lines = ["| folder | rule | k | top pairs read, routed answer steps (n probes) | the same, where full is right and the default wrong (n) |",
             "|---|---|---:|---:|---:|"]
    groups = {}
    for p in probes:
        groups.setdefault((p["folder"], p["rule"], p["top_k"]), []).append(p)
    for (folder, rule, k), rows in groups.items():
        def share(sel):
            hits = [h for p in sel for h in p["answer_hits"] if h == h]
            return f"{np.mean(hits):.2f} ({len(sel)})" if hits else "–"
        lost = [p for p in rows
                if answers.get((seed_of(p["case"]), p["probe"], "full"), ("", False))[1]
                and not answers.get((seed_of(p["case"]), p["probe"], "geometric"), ("", True))[1]]
        lines.append(f"| {folder} | {rule} | {k} | {share(rows)} | {share(lost)} |")
    return "\n".join(lines)


def main(probes_spec: str, results_path: str, haystack: str = "", *flags: str) -> None:
    probes = load_probes(probes_spec)
    answers = answers_by_probe(results_path, haystack)
    if "--summary" in flags:
        print(summary(probes, answers))
        return
    outcomes = {}
    for p in probes:
        cells = []
        for mode in ("full", "geometric"):
            text, right = answers.get((seed_of(p["case"]), p["probe"], mode), ("–", True))
            cells.append(text + ("" if right else " ✗"))
        outcomes[(p["case"], p["probe"])] = " / ".join(cells)
    print(probe_markdown(probes, outcomes))


if __name__ == "__main__":
    main(*sys.argv[1:])
