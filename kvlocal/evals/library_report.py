"""The summary of `kvlocal eval library` rows: accuracy per set size, reference and mode with 95 %
intervals, reads per answer step, where the reads fell, and how long a cached set takes to ready.

`python -m kvlocal.evals.library_report OUT/results.jsonl` prints it again from kept rows;
`python -m kvlocal.evals.library_report --bench BENCH.json...` the tables of `kvlocal bench library --out`.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from statistics import mean, median

from kvlocal.evals.library_runner import ALONE, CONCAT, SET, library_row
from kvlocal.evals.report import _accuracy, _interval_text, _mode_rank, answer_reduction, rpc_cells, rpc_heads
from kvlocal.evals.runner import hint_rule, load_rows, question_pass
from kvlocal.hints import RULE as HINT_RULE
from kvlocal.route_settings import DEFAULT_QUESTION
from kvlocal.units import human_bytes

REFERENCE_RANK = {SET: 0, ALONE: 1, CONCAT: 2}


def summarize(rows: list[dict]) -> dict:
    answers = [r for r in rows if r["kind"] == "answer"]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in answers:
        groups[(r["n_documents"], r["length"], r["reference"], r["mode"], r["top_k"] if r["mode"] != "full" else 0,
                r.get("haystack", ""), r.get("hints", 0), _question(r) if r["mode"] != "full" else "",
                r.get("layout", ""), r.get("questions", "template"), hint_rule(r),
                r.get("layer_top_k", "") if r["mode"] != "full" else "", r.get("focus", "set"))].append(r)
    cells = []
    for (n_docs, length, reference, mode, top_k, haystack, hints, question, _, questions, rule, layers, focus), group in sorted(
            groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][5], kv[0][9], REFERENCE_RANK.get(kv[0][2], 9),
                                            kv[0][8], _mode_rank(kv[0][3]), kv[0][12], kv[0][4], kv[0][6], kv[0][10],
                                            kv[0][7])):
        shares = [r["fact_document_share"] for r in group if r.get("fact_document_share") is not None]
        cells.append({
            "n_documents": n_docs, "length": length, "haystack": haystack, "reference": reference, "mode": mode,
            "top_k": top_k or None, "hints": hints, "question": question, "seeds": sorted({r["seed"] for r in group}),
            "questions": questions, "hint_rule": rule, "layer_top_k": layers, "focus": focus,
            **_accuracy(group),
            "answer_reduction": mean(answer_reduction(r) for r in group),
            "reduction": mean(r["bytes_dense"] / r["bytes_read"] for r in group if r["bytes_read"]),
            "fact_document_share": mean(shares) if shares else None,
            "decode_tps": median(r["decode_tps"] for r in group),
            "n_tokens": round(mean(r["n_tokens"] for r in group)),
            "layout": sorted({r["layout"] for r in group}),
        })
    return {"cells": cells, "loads": _loads(rows)}


def _loads(rows: list[dict]) -> list[dict]:
    """Per set size: seconds to ready the set from cached bodies against the seconds its bodies took
    to prefill (when this file recorded every one of them)."""
    prefill = {(r["label"], r["n_tokens"], r.get("haystack", ""), r.get("facts_per_doc")): r["prefill_s"]
               for r in rows if r["kind"] == "body"}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["kind"] == "load":
            groups[(r["n_documents"], r["length"], r.get("haystack", ""))].append(r)
    out = []
    for (n_docs, length, haystack), group in sorted(groups.items()):
        ratios, prefills = [], []
        for r in group:
            times = [prefill.get((d["label"], d["n_tokens"], r.get("haystack", ""), r.get("facts_per_doc")))
                     for d in r["documents"]]
            if all(t is not None for t in times):
                prefills.append(sum(times))
                ratios.append(r["ready_s"] / sum(times))
        out.append({"n_documents": n_docs, "length": length, "haystack": haystack, "n": len(group),
                    "n_cells": round(mean(r["n_cells"] for r in group)), "layout": sorted({r["layout"] for r in group}),
                    "ready_s": mean(r["ready_s"] for r in group),
                    "prefill_s": mean(prefills) if prefills else None,
                    "ready_share": mean(ratios) if ratios else None})
    return out


def _question(row: dict) -> str:
    """The question pass of a library row (every library row records its route; the default is dense)."""
    return question_pass({"question": DEFAULT_QUESTION, **row})


def markdown(summary: dict) -> str:
    lines = ["| set | answered by | mode | accuracy (95 % CI) | n | seeds | reduction per answer step "
             "| reads in the fact's document | decode tok/s |",
             "|---|---|---|---:|---:|---|---:|---:|---:|"]
    for c in summary["cells"]:
        what = f"{c['n_documents']} x {c['length'] // 1024}k" + (f" ({Path(c['haystack']).name})" if c["haystack"] else "")
        if c.get("questions", "template") != "template":
            what += f", {c['questions']} questions"
        mode = c["mode"] if c["mode"] == "full" else f"{c['mode']} top-{c['top_k']}"
        if c.get("layer_top_k"):
            mode += f" (layers {c['layer_top_k']})"
        if c.get("hints"):
            mode += f" hints {c['hints']}" + (f" ({c['hint_rule']} rule)" if c.get("hint_rule") != HINT_RULE else "")
        if c.get("question") and c["question"] != "dense":
            mode += f", question {c['question']}"
        if c.get("focus", "set") != "set":
            mode += ", within the hinted document"
        share = "" if c["fact_document_share"] is None or c["reference"] != SET else f"{c['fact_document_share']:.0%}"
        reduction = "1.0x" if c["mode"] == "full" else f"{c['answer_reduction']:.1f}x"
        lines.append(f"| {what} | {_reference_text(c)} | {mode} | {c['accuracy']:.0%} {_interval_text(c['accuracy_ci'])} "
                     f"| {c['n']} | {','.join(map(str, c['seeds']))} | {reduction} | {share} | {c['decode_tps']:.1f} |")
    if summary["loads"]:
        lines += ["", "| set | cells | layout | readied (n) | ready from the cache | its bodies' prefill | share |",
                  "|---|---:|---|---:|---:|---:|---:|"]
        for load in summary["loads"]:
            prefill = "" if load["prefill_s"] is None else f"{load['prefill_s']:.0f} s"
            share = "" if load["ready_share"] is None else f"{load['ready_share']:.1%}"
            lines.append(f"| {load['n_documents']} x {load['length'] // 1024}k | {load['n_cells']:,} "
                         f"| {', '.join(load['layout'])} | {load['n']} | {load['ready_s']:.1f} s | {prefill} | {share} |")
    return "\n".join(lines)


def _reference_text(cell: dict) -> str:
    if cell["reference"] == ALONE:
        return "its document alone"
    if cell["reference"] == CONCAT:
        return "the concatenation, prefilled"
    return f"the set ({', '.join(cell['layout'])})"


def route_short(route: str) -> str:
    """A bench file's route in a few words: 'top-4', or 'top-1, 1 hint' for the hinted route."""
    top = re.search(r"top-(\d+)", route)
    hinted = re.search(r"(\d+) hinted", route)
    return (f"top-{top.group(1)}" if top else route) + (f", {hinted.group(1)} hint" if hinted else "")


def bench_markdown(runs: list[tuple[str, dict]]) -> str:
    """One row per set of `kvlocal bench library --out FILE.json` runs: readiness from the cache, full
    against geometric decode over the set, and the route geometric took (a set's own when its question hints)."""
    lines = ["| run | set | cells | layout | KV bytes | ready from the cache | geometric route | full tok/s "
             "| geometric tok/s | speed-up | KV bytes read, reduction (question included) | peak RSS |",
             "|---|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for name, run in runs:
        rss = human_bytes(run["peak_rss_bytes"]) if run.get("peak_rss_bytes") else "–"
        for r in run.get("library", []):
            route = route_short(r.get("geometric_route") or run.get("route", ""))
            lines.append(f"| {name} | {r['n_documents']} x {r['length'] // 1024}k | {r['n_cells']:,} | {r['layout']} "
                         f"| {human_bytes(r['kv_bytes'])} | {r['ready_s']:.1f} s | {route} | {r['full_tps']:.2f} "
                         f"| {r['geometric_tps']:.2f} | {r['speedup']:.2f}x | {r['bytes_reduction']:.1f}x | {rss} |")
    return "\n".join(lines)


def bench_text(report: dict) -> str:
    """What `kvlocal bench library` prints of its report: a row per set, the route geometric took where it
    was not the one asked for, and the peak memory."""
    rows = report["library"]
    extra = rpc_heads(rows)
    lines = [f"model {report['model']}, {report['threads']} threads, route {report['route']}",
             *([report["placement"]] if report.get("placement") else []),
             "| set | cells | layout | KV bytes | ready from the cache | full tok/s | geometric tok/s | speedup "
             "| KV bytes read, reduction |" + "".join(f" {h} |" for h in extra),
             "|---|---:|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(extra)]
    for r in rows:
        cells = [f"{r['n_documents']} x {r['length'] // 1024}k", f"{r['n_cells']:,}", r["layout"], human_bytes(r["kv_bytes"]),
                 f"{r['ready_s']:.1f} s", f"{r['full_tps']:.2f}", f"{r['geometric_tps']:.2f}", f"{r['speedup']:.2f}x",
                 f"{r['bytes_reduction']:.1f}x", *rpc_cells(r)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"geometric over {r['n_documents']} documents took the route {r['geometric_route']}"
              for r in report["library"] if r["geometric_route"] != report["route"]]
    lines.append(f"peak RSS: {human_bytes(report['peak_rss_bytes'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """`python -m kvlocal.evals.library_report RESULTS.jsonl...`: the library eval's tables; `--bench`
    first: one table over `kvlocal bench library --out` files; `--decode` first: each such file's table as
    `bench library` printed it (every column it measured: over RPC, the rates here and the wire bytes)."""
    args = list(sys.argv[1:] if argv is None else argv)
    kind = args.pop(0) if args[:1] in (["--bench"], ["--decode"]) else None
    if not args:
        print("usage: python -m kvlocal.evals.library_report RESULTS.jsonl...\n"
              "       python -m kvlocal.evals.library_report --bench|--decode BENCH.json...", file=sys.stderr)
        raise SystemExit(2)
    if kind == "--bench":
        print(bench_markdown([(Path(p).stem, json.loads(Path(p).read_text())) for p in args]))
        return
    if kind == "--decode":
        print("\n\n".join(bench_text(json.loads(Path(p).read_text())) for p in args))
        return
    rows = [row for path in args for row in load_rows(Path(path), library_row)]
    print(markdown(summarize(rows)))


if __name__ == "__main__":
    main()
