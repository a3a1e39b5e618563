"""The lab's tables again, from the files `kvlocal lab` keeps (BENCHMARKS.md prints each with this command).

    python -m kvlocal.lab.report decode LAB.json...          the decode lab's rules (one row per rule and budget)
    python -m kvlocal.lab.report prefill LAB-PREFILL.json... the prefill lab's rules
    python -m kvlocal.lab.report hints [--pooled] HINTS.jsonl...
                                                             `kvlocal lab hints`: where text hints point
    python -m kvlocal.lab.report answers --results RESULTS.jsonl [--haystack FILE] [--summary] PROBES.jsonl...
                                                             the decode lab's probes beside an eval's answers
    python -m kvlocal.lab.report hint-reads [--haystack FILE] --seeds 0,1,2
                                                             where one document's hinted steps read (the model)

Each table names the folder a file came from. Nothing here decodes, except `hint-reads`, which loads each
8k one-key haystack on the default model (from the state cache when it is there) for its tokens.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvlocal.lab import decode, hints, prefill


def _folder(path: Path) -> str:
    return path.parent.name


def _tables(paths: Sequence[Path], table: Callable[[list[dict]], str]) -> str:
    """One table over several files' rows, a first column naming each file's folder; files whose tables
    have other columns (e.g. estimates measured in one run only) start a table of their own."""
    out: list[str] = []
    header: list[str] = []
    for path in paths:
        lines = table(json.loads(path.read_text())).splitlines()
        head, rows = lines[:2], lines[2:]
        if head != header:
            if out:
                out.append("")
            out += ["| lab " + head[0], "|---" + head[1]]
            header = head
        out += [f"| {_folder(path)} " + row for row in rows]
    return "\n".join(out)


def decode_table(paths: Sequence[Path]) -> str:
    """The decode lab's summary (`lab.json`: kvlocal.lab.decode.markdown) over several runs."""
    return _tables(paths, decode.markdown)


def prefill_table(paths: Sequence[Path]) -> str:
    """The prefill lab's summary (`lab-prefill.json`: kvlocal.lab.prefill.markdown_prefill) over several runs."""
    return _tables(paths, prefill.markdown_prefill)


def hints_table(paths: Sequence[Path], pooled: bool = False) -> str:
    """`kvlocal lab hints`'s table from its hints.jsonl files; `pooled`: the rows over all seeds only."""
    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
    summary = hints.summarize(rows)
    if pooled:
        summary = [e for e in summary if e["seed"] == "all"]
    return hints.markdown(summary)


# ---- the decode lab's probes beside the answers of an eval run ---------------------------------------


def answers_by_probe(rows: Sequence[dict], haystack: str = "") -> dict[tuple[int, int, str], tuple[str, bool]]:
    """(seed, probe, mode) -> (answer, right) of the one-key rows on `haystack` ("" for generated filler):
    full attention's, and the uniform route's as `kvlocal ask` runs it (evals.report.on_route): the route
    the lab's default rule (`two64/8x16+qm2`) replays."""
    from kvlocal.evals.report import on_route
    from kvlocal.route_settings import UNCALIBRATED_ROUTE

    answers = {}
    for r in rows:
        if r.get("haystack", "") != haystack or r["task"] != "onekey" or r["mode"] not in ("full", "geometric"):
            continue
        if on_route(r, UNCALIBRATED_ROUTE):
            answers[(r["seed"], r["probe"], r["mode"])] = (r["answer"].strip(), r["score"] >= 1)
    return answers


def seed_of(case: str) -> int:
    """The seed in a lab case's name, e.g. 'onekey-8192-s2-d10-gpl-3' -> 2."""
    return int(re.search(r"-s(\d+)-", case).group(1))


def answers_summary(probes: Sequence[dict], answers: dict) -> str:
    """Per folder, rule and budget: the share of the top fact-attending (layer, head) pairs read at the
    routed answer steps, over all probes and over those full attention answers and the route misses."""
    lines = ["| lab | rule | k | top pairs read, routed answer steps (n probes) "
             "| the same, where full is right and the route wrong (n) |",
             "|---|---|---:|---:|---:|"]
    groups: dict[tuple, list[dict]] = {}
    for p in probes:
        groups.setdefault((p["folder"], p["rule"], p["top_k"]), []).append(p)

    def share(selected: list[dict]) -> str:
        hits = [h for p in selected for h in p["answer_hits"] if h == h]  # NaN: a step without a top pair
        return f"{np.mean(hits):.2f} ({len(selected)})" if hits else "–"

    for (folder, rule, k), rows in groups.items():
        lost = [p for p in rows
                if answers.get((seed_of(p["case"]), p["probe"], "full"), ("", False))[1]
                and not answers.get((seed_of(p["case"]), p["probe"], "geometric"), ("", True))[1]]
        lines.append(f"| {folder} | {rule} | {k} | {share(rows)} | {share(lost)} |")
    return "\n".join(lines)


def answers_table(probe_paths: Sequence[Path], results: Path, haystack: str = "", summary: bool = False) -> str:
    """The probes of one or more `probes.jsonl` (each tagged with its folder) beside the answers of an eval's
    results.jsonl: fact by fact (full attention's / the route's answer, a cross after a wrong one), or with
    `summary` per rule (answers_summary). Only facts outside the sinks and window appear (the lab's probes)."""
    from kvlocal.evals.runner import load_rows

    probes = [dict(json.loads(line), folder=_folder(path))
              for path in probe_paths for line in path.read_text().splitlines() if line.strip()]
    answers = answers_by_probe(load_rows(results), haystack)
    if summary:
        return answers_summary(probes, answers)
    outcomes = {}
    for p in probes:
        cells = []
        for mode in ("full", "geometric"):
            text, right = answers.get((seed_of(p["case"]), p["probe"], mode), ("–", True))
            cells.append(text + ("" if right else " ✗"))
        outcomes[(p["case"], p["probe"])] = " / ".join(cells)
    return decode.probe_markdown(probes, outcomes)


# ---- where one document's hinted steps read ------------------------------------------------------------


def hint_read_lines(pieces: Sequence[bytes], probes: Sequence, lead: str, seed: int, *, region: int,
                    skip_regions: int) -> list[str]:
    """One line per probe of a single-document case whose cells are `pieces`: the regions a hinted top-1
    step reads (kvlocal.hints.hint_cells), the first and last region of the asked code, and the region of
    its sentence's first token (the last `lead` before the code), marked START-MISSED when it is not read."""
    index = hints.TextIndex.of(pieces)
    text, char_cells = hints.cell_text(pieces)
    lines = []
    for i, probe in enumerate(probes):
        read = sorted({c // region for c in hints.hint_cells(index, probe.question, 1, region,
                                                             skip_regions=skip_regions)})
        code = probe.answers[0]
        at = text.find(code)
        start = char_cells[text.rfind(lead, 0, at)] // region
        span = (char_cells[at] // region, char_cells[at + len(code) - 1] // region)
        lines.append(f"{seed} {i} {probe.depth} {code} read {read} code {span} start {start} "
                     + ("START-MISSED" if start not in read else ""))
    return lines


def _hint_reads(haystack: str | None, seeds: Sequence[int]) -> None:  # pragma: no cover - the real model
    from kvlocal.evals.runner import depth_grid, make_case
    from kvlocal.evals.tasks import ONEKEY_SHAPES
    from kvlocal.ingest import load_document
    from kvlocal.route_settings import DEFAULT_REGION, DEFAULT_SINKS
    from kvlocal.session import Session

    session = Session(None, threads=1)
    filler = load_document(Path(haystack)).text if haystack else None
    for seed in seeds:
        case = make_case(session, "onekey", 8192, depth_grid(10), seed, filler)
        session.load_document(case.text, label="x")
        pieces = session.token_pieces(session.prefix_cell_tokens())
        lead = ONEKEY_SHAPES[seed % len(ONEKEY_SHAPES)][0].split("{key}")[0][:12]
        for line in hint_read_lines(pieces, case.probes, lead, seed, region=DEFAULT_REGION,
                                    skip_regions=-(-DEFAULT_SINKS // DEFAULT_REGION)):
            print(line, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvlocal.lab.report", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="table", required=True)
    sub.add_parser("decode", help="lab.json files").add_argument("files", nargs="+", type=Path)
    sub.add_parser("prefill", help="lab-prefill.json files").add_argument("files", nargs="+", type=Path)
    hints_cmd = sub.add_parser("hints", help="hints.jsonl files of kvlocal lab hints")
    hints_cmd.add_argument("--pooled", action="store_true", help="only the rows over all seeds")
    hints_cmd.add_argument("files", nargs="+", type=Path)
    answers = sub.add_parser("answers", help="probes.jsonl files beside an eval's answers")
    answers.add_argument("--results", type=Path, required=True, help="the eval's results.jsonl")
    answers.add_argument("--haystack", default="", help="the --haystack the eval ran with (none: generated filler)")
    answers.add_argument("--summary", action="store_true", help="per rule, not fact by fact")
    answers.add_argument("files", nargs="+", type=Path)
    reads = sub.add_parser("hint-reads", help="where one document's hinted steps read (loads the default model)")
    reads.add_argument("--haystack", default=None, help="the filler document (none: generated filler)")
    reads.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.table == "decode":
        print(decode_table(args.files))
    elif args.table == "prefill":
        print(prefill_table(args.files))
    elif args.table == "hints":
        print(hints_table(args.files, args.pooled))
    elif args.table == "answers":
        print(answers_table(args.files, args.results, args.haystack, args.summary))
    else:
        _hint_reads(args.haystack, [int(s) for s in args.seeds.split(",")])


if __name__ == "__main__":
    main()
