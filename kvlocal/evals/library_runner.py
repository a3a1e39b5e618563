"""`kvlocal eval library N`: look-alike facts over a set of N documents, asked of the set in each
routing mode and of two references; `kvlocal eval questions FILE`: a question file's real documents
and hand-written questions (question_sets.py), asked the same way (`run_case` serves both).

Per seed the set is loaded once through the library (each body prefilled alone and cached, then
assembled) and every fact is asked in every mode. The references: each fact asked of its own document
alone (the document's cached body assembled on its own: the same cells, nothing recomputed) and, where
the set fits the model's trained context and it is asked for, the concatenation prefilled as one
document. Rows are appended to OUT/results.jsonl as they come (a rerun resumes): kind "answer" for an
answer, "load" for a set readied from cached bodies, "body" for a body prefilled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvlocal.errors import ContextOverflowError, UsageError
from kvlocal.ingest import Document
from kvlocal.evals.library_cases import TASK, SetCase, build_set_case
from kvlocal.evals.question_sets import TASK as QUESTIONS_TASK
from kvlocal.evals.runner import (
    append_row, haystack_tokens, load_rows, question_pass, route_fields, route_key, task_answer_tokens,
)
from kvlocal.evals.tasks import score
from kvlocal.hints import RULE as HINT_RULE
from kvlocal.library import load_set
from kvlocal.route_settings import UNCALIBRATED_ROUTE, ModelRoute
from kvlocal.routing import Route, RouteConfig, RouteFacts, resolve_route
from kvlocal.session import Session

SET, ALONE, CONCAT = "set", "alone", "concat"
REFERENCES = (ALONE, CONCAT)
REFERENCE_MODES = {ALONE: ("full",), CONCAT: ("full", "geometric")}


@dataclass
class LibraryConfig:
    n_documents: int
    lengths: list[int]  # each document's context length (its haystack leaves room for the prompt)
    seeds: list[int]
    modes: list[str]
    route: RouteConfig = field(default_factory=RouteConfig)  # every mode's settings (its mode unused)
    references: list[str] = field(default_factory=lambda: [ALONE])
    alone_modes: tuple[str, ...] = REFERENCE_MODES[ALONE]  # the modes each document alone is asked in
    facts_per_doc: int = 2
    layout: str | None = None  # None: consecutive while the set fits the trained context
    max_tokens: int | None = None
    sets_per_seed: int = 1  # disjoint sets of n_documents drawn from each seed's documents
    paraphrase: bool = False  # ask each fact in other words (the documents stay the same)
    calibrated: ModelRoute = UNCALIBRATED_ROUTE  # the model's route (run_library sets the session's)

    def documents_of(self, reference: str) -> int:
        """The documents a reference's answer is routed as: one alone; the set's, the concatenation too."""
        return 1 if reference == ALONE else self.n_documents

    def route_of(self, mode: str, n_documents: int = 1) -> Route:
        """`mode`'s route over `n_documents` documents as a row records it (a set's own route where the
        settings follow the set, the model's calibrated budget where they follow the model); the answer
        is asked with the settings themselves (a set's question without hints takes another route)."""
        focused = n_documents > 1 and self.route.focus == "hinted"  # routed as the one document it reads
        route = resolve_route(replace(self.route, mode=mode), self.calibrated, RouteFacts(1 if focused else n_documents))
        return replace(route, pin=route.pins, follow=route.follows, hints=route.hinted,
                       focus="hinted" if focused else "set")

    @property
    def answer_tokens(self) -> int:
        return self.max_tokens or task_answer_tokens("onekey")


def make_set_case(session: Session, config: LibraryConfig, length: int, seed: int, filler: str | None,
                  first: int = 0) -> SetCase:
    count = lambda text: len(session.tokenize(text, bos=False))  # noqa: E731
    try:
        return build_set_case(config.n_documents, haystack_tokens(length), seed=seed, count_tokens=count,
                              facts_per_doc=config.facts_per_doc, filler=filler, first=first,
                              paraphrase=config.paraphrase)
    except ValueError as err:
        raise UsageError(f"cannot build a set of {config.n_documents} documents of {length} tokens: {err}") from None


ROW_KINDS = ("answer", "load", "body")


def library_row(row: dict) -> bool:
    """Whether a results file's row is one of this runner's (for runner.load_rows)."""
    return row.get("kind") in ROW_KINDS


def answer_key(row: dict) -> tuple:
    """The cell an answer row fills (a rerun asks only the facts whose key no row has)."""
    return (row["n_documents"], row["length"], row["seed"], row["probe"], row["reference"], row["mode"],
            question_pass(row), row["haystack"], row["max_tokens"], row["facts_per_doc"], row.get("first_document", 0),
            row.get("layout_asked", "auto"),  # rows before --layout was recorded ran the automatic layout
            row.get("questions", "template"), row.get("focus", "set"), *route_key(row))


def run_library(
    session: Session,
    config: LibraryConfig,
    out: Path,
    *,
    filler: str | None = None,
    haystack_name: str = "",
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Ask every fact not yet in `out` of the set and the references; returns all rows."""
    out.parent.mkdir(parents=True, exist_ok=True)
    config = replace(config, calibrated=session.calibrated_route)
    rows = load_rows(out, library_row)
    for length, seed, first in ((length, seed, k * config.n_documents) for length in config.lengths
                                for seed in config.seeds for k in range(config.sets_per_seed)):
        case = make_set_case(session, config, length, seed, filler, first)
        base = {"n_documents": config.n_documents, "length": length, "seed": seed, "haystack": haystack_name,
                "centroid_block": session.centroid_block, "max_tokens": config.answer_tokens,
                "facts_per_doc": config.facts_per_doc, "first_document": first, "task": TASK,
                "layout_asked": config.layout or "auto",
                "questions": "paraphrased" if config.paraphrase else "template"}
        run_case(session, config, case, base, rows, out, log)
    return rows


def run_questions(session: Session, config: LibraryConfig, case: SetCase, name: str, out: Path,
                  log: Callable[[str], None] = print) -> list[dict]:
    """Ask a question file's questions (`question_sets.load_question_set`) not yet in `out` of its documents
    as one set and of the references; returns all rows. `name` tells the file's rows from another's."""
    out.parent.mkdir(parents=True, exist_ok=True)
    config = replace(config, n_documents=len(case.documents), calibrated=session.calibrated_route)
    rows = load_rows(out, library_row)
    longest = max(len(session.tokenize(d.text, bos=False)) for d in case.documents)
    base = {"n_documents": config.n_documents, "length": longest, "seed": case.seed, "haystack": name,
            "centroid_block": session.centroid_block, "max_tokens": config.answer_tokens,
            "facts_per_doc": len(case.probes), "first_document": 0, "task": QUESTIONS_TASK,
            "layout_asked": config.layout or "auto", "questions": "hand-written"}
    run_case(session, config, case, base, rows, out, log)
    return [r for r in rows if r.get("haystack") == name]


def run_case(session: Session, config: LibraryConfig, case: SetCase, base: dict, rows: list[dict], out: Path,
             log: Callable[[str], None]) -> None:
    """Ask every probe of `case` not yet in `rows` of the set and the references, appending each new row
    to `out` and `rows`; `base` holds the case's part of every row (and of the key a rerun finds it by)."""
    done = {answer_key(r) for r in rows if r["kind"] == "answer"}
    seed = case.seed

    def todo(reference: str, modes: Sequence[str], probes: Sequence[int]) -> list[tuple[int, Route]]:
        n_documents = config.documents_of(reference)
        return [(i, route) for i in probes for route in (config.route_of(m, n_documents) for m in modes)
                if answer_key({**base, **_route_fields(route), "probe": i, "reference": reference,
                               # the set's context, or one document's (alone, or the concatenation)
                               "centroid_type": session.centroid_type_for(
                                   config.n_documents if reference == SET else 1)}) not in done]

    def record(row: dict) -> None:
        append_row(out, row)
        rows.append(row)
        if row["kind"] == "answer":
            done.add(answer_key(row))

    all_probes = range(len(case.probes))
    work = todo(SET, config.modes, all_probes)
    if work:
        loaded = _load_set(session, case, config, base, record, log)
        for i, route in work:
            record(_ask(session, case, i, route, config, {**base, **loaded, "reference": SET}, log))
    if ALONE in config.references:
        for d, document in enumerate(case.documents):
            work = todo(ALONE, config.alone_modes, case.probes_of(d))
            if not work:
                continue
            result = load_set(session, [document], layout="consecutive")
            loaded = {"layout": "alone", "n_tokens": result.n_cells, "n_positions": result.n_positions}
            for i, route in work:
                record(_ask(session, case, i, route, config, {**base, **loaded, "reference": ALONE}, log))
    if CONCAT in config.references:
        work = todo(CONCAT, REFERENCE_MODES[CONCAT], all_probes)
        if work:
            text = "\n\n".join(doc.text.strip() for doc in case.documents)
            log(f"concatenation of seed {seed}: loading its {len(case.documents)} documents as one "
                "(a dense prefill of the whole unless it is cached)")
            start = time.perf_counter()
            try:  # as one document: the single-document path (the read tally sees one document)
                result = load_set(session, [Document(text, f"library-s{seed}-concatenation", "text")]).single
            except ContextOverflowError as err:  # refused before any prefill
                log(f"concatenation of seed {seed} left out: {err}")
                return
            log(f"concatenation of seed {seed}: {result.n_tokens:,} tokens "
                f"({'cache hit' if result.cache_hit else 'prefilled'}, {time.perf_counter() - start:.0f} s)")
            loaded = {"layout": "concatenation", "n_tokens": result.n_tokens, "n_positions": result.n_tokens,
                      "concat_prefill_s": None if result.cache_hit else result.seconds}
            for i, route in work:
                record(_ask(session, case, i, route, config, {**base, **loaded, "reference": CONCAT}, log))


def _load_set(session: Session, case: SetCase, config: LibraryConfig, base: dict,
              record: Callable[[dict], None], log) -> dict:
    """Load the set; a row per body prefilled and, once every body is cached, a row for the set readied
    from the cache alone (in a fresh context: what opening the set again costs)."""
    result = load_set(session, case.documents, layout=config.layout, log=log)
    for d, body in enumerate(result.documents):
        if not body.cache_hit:
            record({"kind": "body", "seed": case.seed, "document": base["first_document"] + d, "label": body.label,
                    "n_tokens": body.n_tokens, "length": base["length"], "haystack": base["haystack"],
                    "facts_per_doc": base["facts_per_doc"], "prefill_s": body.seconds, "threads": session.threads})
    if result.cache_hits < len(result.documents):
        session.unload()
        result = load_set(session, case.documents, layout=config.layout)
    record({"kind": "load", **{k: base[k] for k in ("n_documents", "length", "seed", "haystack", "facts_per_doc",
                                                   "first_document")},
            "layout": result.layout, "n_cells": result.n_cells, "n_positions": result.n_positions,
            "n_ctx": result.n_ctx, "ready_s": result.ready_seconds, "threads": session.threads,
            "documents": [{"label": b.label, "n_tokens": b.n_tokens, "load_s": b.seconds} for b in result.documents]})
    log(f"set of {len(case.documents)} (seed {case.seed}): {result.n_cells:,} cells, {result.layout}, "
        f"ready from the cache in {result.ready_seconds:.1f} s")
    return {"layout": result.layout, "n_tokens": result.n_cells, "n_positions": result.n_positions}


def _route_fields(route: Route) -> dict:
    """The route's part of an answer row, and of the key a rerun finds it by: its settings and hint rule."""
    return {**route_fields(route), "hint_rule": HINT_RULE if route.hinted else ""}


def _ask(session: Session, case: SetCase, index: int, route: Route, config: LibraryConfig, base: dict,
         log) -> dict:
    probe = case.probes[index]
    fact_document = case.probe_document[index]
    n_documents = config.documents_of(base["reference"])
    answer = session.ask(probe.question, route=replace(config.route, mode=route.mode), n_documents=n_documents,
                         max_tokens=config.answer_tokens, want_regions=True)
    tally = session.read_tally()
    for piece in answer:
        tally.add(piece.stats)
    summary = answer.summary()
    in_docs = sum(tally.documents)
    labels = [s.label for s in session.layout.spans]
    own = case.documents[fact_document].source
    fact_share = (tally.documents[labels.index(own)] / in_docs) if in_docs and own in labels else None
    row = {
        "kind": "answer", **base, **_route_fields(route), "centroid_type": session.centroid_type,
        "probe": index, "document": fact_document, "depth": probe.depth,
        "score": score(probe, summary.text), "answer": summary.text.strip(), "expected": list(probe.answers),
        "decode_tps": summary.decode_rate, "steps": summary.steps,
        "rows_read": summary.rows_read, "rows_dense": summary.rows_dense,
        "bytes_read": summary.bytes_read, "bytes_meta": summary.bytes_meta, "bytes_dense": summary.bytes_dense,
        "reduction": summary.reduction,
        "question_bytes_read": summary.question_bytes_read, "question_bytes_dense": summary.question_bytes_dense,
        "fact_document_share": fact_share,  # of the answer steps' reads that fell in documents
        # the documents of the cells the question's words hinted (route hints), in hint order
        "hint_documents": [labels.index(span.label) if (span := session.document_at(c)) else None
                           for c in summary.hint_cells[::2]],
        "hint_cells": list(summary.hint_cells),
        # the document a focused answer read (--focus hinted; None: the set, or one document)
        "focus_document": labels.index(summary.focus) if summary.focus in labels else None,
        "top_k_read": summary.route.top_k,  # top_k, raised to the hinted regions where they are more
        "model": session.model.alias or session.model.path.name,
    }
    log(f"{base['n_documents']}x{base['length']} s{base['seed']} {base['reference']:<6} {route.mode:<9} "
        f"doc {fact_document + 1} score={row['score']:.0f} x{row['reduction']:.1f} "
        f"own doc {fact_share if fact_share is not None else float('nan'):.0%} | {row['answer'][:40]!r}")
    return row
