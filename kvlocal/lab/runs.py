"""The lab's runs, as `kvlocal lab` (decode rules), `kvlocal lab prefill` and `kvlocal lab hints` make them:
the haystacks' captures kept in OUT and replayed offline, the files each run writes, the tables it prints.

The command line checks the options first and hands `open_session`, called at the first capture that
is not in OUT yet (a run whose captures are all there never opens the engine). Progress goes to `log`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvlocal.atomic import write_text_atomic
from kvlocal.errors import UsageError
from kvlocal.lab.rules import Geometry

Log = Callable[[str], None]


def file_tag(path: Path) -> str:
    """A file name reduced to what a capture's name may hold: `GPL-3` -> `gpl-3`, `My Notes.pdf` -> `my-notes`."""
    return re.sub(r"[^a-z0-9]+", "-", path.stem.lower()).strip("-") or "haystack"


def captures(out: Path, lengths: list[int], tasks: list[str], seeds: list[int], depths: list[float],
             open_session: Callable[[], object], *, name_of, load, capture, haystack: Path | None = None,
             log: Log) -> Iterator[tuple[str, object]]:
    """(name, capture) of every haystack: loaded from OUT when it is there, else captured on the engine
    (one session for all, opened at the first capture) and saved beside the others. With `haystack`
    the facts are planted in that document's text (as `kvlocal eval --haystack` plants them) and the
    capture's name carries its file name."""
    from kvlocal.evals.runner import make_case
    from kvlocal.ingest import load_document

    filler = load_document(haystack).text if haystack else None
    tag = f"-{file_tag(haystack)}" if haystack else ""
    session = None
    for length in lengths:
        for task in tasks:
            for seed in seeds:
                name = name_of(task, length, seed) + tag
                path = out / f"{name}.npz"
                if path.exists():
                    cap = load(path)
                    log(f"{name}: capture loaded from {path}")
                else:
                    session = session or open_session()
                    case = make_case(session, task, length, depths, seed, filler)
                    cap = capture(session, case, task, name, log)
                    cap.save(path)
                yield name, cap


def decode_lab(out: Path, found: Iterator[tuple[str, object]], rules: Sequence[str], budgets: Sequence[int],
               geo: Geometry, layer_budget: str, log: Log) -> str:
    """Replay the decode `rules` at every budget on each capture; writes OUT/lab.json and OUT/probes.jsonl
    and returns the tables."""
    from kvlocal.lab import decode

    totals: dict = {}
    probe_rows: list[dict] = []  # where each probe's answer steps lose the fact (probes.jsonl)
    for name, cap in found:
        started = time.perf_counter()
        try:
            scale = decode.layer_scale(layer_budget, cap.doc_keys.shape[0]) if layer_budget else None
        except ValueError as e:
            raise UsageError(f"--layer-budget: {e}") from None
        decode.replay_case(cap, rules, budgets, geo, totals, scale=scale, probe_log=probe_rows)
        log(f"{name}: replayed {len(rules)} rules x {len(budgets)} budgets in {time.perf_counter() - started:.0f} s")
    rows = [dict(r, layer_budget=layer_budget) for r in decode.summarize(totals)]
    write_text_atomic(out / "lab.json", json.dumps(rows, indent=1))
    write_text_atomic(out / "probes.jsonl", "".join(json.dumps(r) + "\n" for r in probe_rows))
    tables = [decode.markdown(rows), decode.layer_markdown(rows, rules), decode.layer_error_markdown(rows)]
    if probe_rows:
        tables.append(decode.probe_markdown(probe_rows))
    return "\n\n".join(t for t in tables if t)


def prefill_lab(out: Path, found: Iterator[tuple[str, object]], rules: Sequence[str], chunks: Sequence[int],
                budgets: Sequence[int], geo: Geometry, estimates: bool, log: Log) -> str:
    """Replay the prefill `rules` per chunk and budget on each capture; writes OUT/lab-prefill.json and
    returns its table."""
    from kvlocal.lab import prefill

    totals: dict = {}
    for name, cap in found:
        started = time.perf_counter()
        prefill.replay_prefill(cap, rules, chunks, budgets, geo, totals,
                               estimates=list(prefill.ESTIMATES) if estimates else ())
        log(f"{name}: {len(cap.starts)} ubatches replayed in {time.perf_counter() - started:.0f} s")
    rows = prefill.summarize_prefill(totals)
    write_text_atomic(out / "lab-prefill.json", json.dumps(rows, indent=1))
    return prefill.markdown_prefill(rows)


def hints_lab(session, out: Path, sizes: Sequence[int], lengths: Sequence[int], seeds: Sequence[int], *,
              hints: int, scopes: Sequence[str], region: int, sinks: int, filler: str | None, haystack_name: str,
              paraphrase: bool, log: Log) -> str:
    """Where the text hints point on each library set, from its tokens alone; writes OUT/hints.jsonl and
    returns the table."""
    from kvlocal.evals.library_runner import LibraryConfig, make_set_case
    from kvlocal.lab import hints as lab_hints
    from kvlocal.library import set_cells

    rows = []
    for n in sizes:
        config = LibraryConfig(n, list(lengths), list(seeds), ["geometric"], paraphrase=paraphrase)
        for length in lengths:
            for seed in seeds:
                case = make_set_case(session, config, length, seed, filler)
                planned = set_cells(session, case.documents)
                pieces = session.token_pieces(planned.tokens)
                for scope in scopes:
                    found = lab_hints.hint_coverage(pieces, planned.starts, planned.n_body, case, hints=hints,
                                                    region=region, sinks=sinks, scope=scope)
                    rows += [dict(r, n_documents=n, length=length, haystack=haystack_name,
                                  questions="paraphrased" if paraphrase else "template") for r in found]
                    log(f"{n} x {length:,} seed {seed}, {scope} scope: {sum(r['code_read'] for r in found)} "
                        f"of {len(found)} hints read their fact's code")
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "hints.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return lab_hints.markdown(lab_hints.summarize(rows))
