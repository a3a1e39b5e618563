"""`kvlocal lab hints N`: where text hints point on a library set, from its tokens alone.

For each fact of a `kvlocal eval library` set: the cells the question's words hint
(kvlocal/hints.py), the regions a hinted step reads for them (the session raises top-k to their
number: kvlocal.routing.resolve_route), whether they lie in the fact's document and whether they hold the
asked code whole. Nothing is prefilled or decoded: it checks the text side of the selection on many
sets, fact shapes and fillers in seconds. Whether the model then copies the code it reads is what
`kvlocal eval library` measures.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from kvlocal.evals.library_cases import SetCase
from kvlocal.evals.intervals import wilson_interval
from kvlocal.hints import FOLLOW, TextIndex, cell_text, hint_cells


def text_cells(pieces: Sequence[bytes], start: int, end: int, text: str) -> tuple[int, int] | None:
    """The first and last cell in [start, end) of the first place `text` is spelled, or None."""
    spelled, char_cells = cell_text(pieces[start:end], start)
    at = spelled.find(text)
    if at < 0:
        return None
    return char_cells[at], char_cells[at + len(text) - 1]


def hint_coverage(pieces: Sequence[bytes], starts: Sequence[int], n_body: Sequence[int], case: SetCase, *,
                  hints: int, region: int, sinks: int, follow: int = FOLLOW, scope: str = "sentence") -> list[dict]:
    """One row per fact of `case`: the set's cells are `pieces` (each token's bytes, in cell order),
    document d's body the `n_body[d]` cells from `starts[d]`."""
    index = TextIndex.of(pieces)
    skip = -(-sinks // region)

    def document_of(cell: int) -> int | None:
        return next((d for d, s in enumerate(starts) if s <= cell < s + n_body[d]), None)

    rows = []
    for i, probe in enumerate(case.probes):
        d = case.probe_document[i]
        cells = hint_cells(index, probe.question, hints, region, follow=follow, skip_regions=skip, scope=scope)
        read = {c // region for c in cells}
        code = text_cells(pieces, starts[d], starts[d] + n_body[d], probe.answers[0])
        code_regions = set(range(code[0] // region, code[1] // region + 1)) if code else set()
        anchors = cells[::2]
        rows.append({
            "seed": case.seed, "scope": scope, "probe": i, "document": d, "code": probe.answers[0],
            "hint_cells": cells, "hint_documents": [document_of(c) for c in anchors],
            "hint_regions": len(read),
            "in_document": bool(anchors) and document_of(anchors[0]) == d,
            # the hinted regions hold every cell of the code (what a hinted step reads of the fact)
            "code_read": bool(code_regions) and code_regions <= read,
            # the first hinted word's region alone holds it (all a top-1 step read before top-k was raised to the hinted regions)
            "code_in_first_region": bool(anchors) and bool(code_regions) and code_regions == {anchors[0] // region},
        })
    return rows


def summarize(rows: Sequence[dict]) -> list[dict]:
    """Per set size, document length, haystack and seed (and over all seeds): n, and the share of facts whose hint
    lies in their document, whose hinted regions hold the code, whose first region alone does."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    several_seeds = len({r["seed"] for r in rows}) > 1
    for row in rows:
        what = (row["n_documents"], row["length"], row["haystack"], row.get("questions", "template"), row["scope"])
        groups[(*what, row["seed"])].append(row)
        if several_seeds:
            groups[(*what, "all")].append(row)
    out = []
    for (n_documents, length, haystack, questions, scope, seed), group in groups.items():
        n = len(group)
        entry = {"n_documents": n_documents, "length": length, "haystack": haystack, "questions": questions,
                 "scope": scope, "seed": seed, "n": n,
                 "hint_regions": sum(r["hint_regions"] for r in group) / n}
        for key in ("in_document", "code_read", "code_in_first_region"):
            share = sum(bool(r[key]) for r in group) / n
            entry[key] = share
            entry[f"{key}_ci"] = wilson_interval(share, n)
        out.append(entry)
    return sorted(out, key=lambda e: (e["n_documents"], e["length"], e["haystack"], e["questions"],
                                      e["scope"] != "sentence",
                                      e["seed"] == "all", str(e["seed"])))


def markdown(summary: Sequence[dict]) -> str:
    def cell(entry: dict, key: str) -> str:
        lo, hi = entry[f"{key}_ci"]
        return f"{entry[key]:.0%} [{lo:.0%}–{hi:.0%}]"

    lines = ["| set | haystack | questions | hint scope | seed | n | hint in the fact's document | hinted regions hold the code "
             "| the first region alone holds it | regions hinted (mean) |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for e in summary:
        lines.append(f"| {e['n_documents']} x {e['length'] // 1024}k | {Path(e['haystack']).name if e['haystack'] else 'generated'} | {e['questions']} | {e['scope']} | {e['seed']} | {e['n']} "
                     f"| {cell(e, 'in_document')} | {cell(e, 'code_read')} | {cell(e, 'code_in_first_region')} "
                     f"| {e['hint_regions']:.2f} |")
    return "\n".join(lines)
