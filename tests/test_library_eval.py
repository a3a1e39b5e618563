"""`kvlocal eval library N`: the set cases (kvlocal.evals.library_cases), the runner on the tiny model
(kvlocal.evals.library_runner: rows, resume, the cache-only load, the per-document read attribution),
the report on hand-made rows (kvlocal.evals.library_report) and the command line.

The tiny model's answers are meaningless: the engine tests check the plumbing and exact properties."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from kvlocal import cli, cli_common
from kvlocal.evals import library_report
from kvlocal.evals.library_cases import (
    MAX_FACTS_PER_DOC,
    POOL,
    TASK,
    build_set_case,
    document_label,
    max_documents,
)
from kvlocal.evals.library_runner import ALONE, CONCAT, SET, LibraryConfig, answer_key, library_row
from kvlocal.evals.runner import load_rows as load_any_rows
from kvlocal.evals.tasks import ONEKEY_SHAPES, score


def load_rows(path):
    """The library runner's rows of a results file (runner.load_rows, one home for both runners)."""
    return load_any_rows(path, library_row)


def quarter(text: str) -> int:
    return len(text) // 4


def whole(value: str, text: str) -> int:
    return len(re.findall(rf"(?<![0-9A-Za-z]){re.escape(value)}(?![0-9A-Za-z])", text))


def key_of(question: str, seed: int) -> str:
    """The key word of a probe's question (the one word the shape's questions differ in)."""
    template = ONEKEY_SHAPES[seed % len(ONEKEY_SHAPES)][1]
    pattern = re.escape(template).replace(re.escape("{key}"), "(.+?)") + re.escape(" Answer with the code only.")
    match = re.fullmatch(pattern, question)
    assert match, question
    return match.group(1)


FILLER = "\n\n".join(
    f"Paragraph {p} of the ledger opens with entry zebra{p}. The clerk added a note on folio {p}b there. "
    f"It closes paragraph {p} with a signature."
    for p in range(40)
)


# -- the set cases ------------------------------------------------------------------------------


def test_a_set_case_is_deterministic_in_its_seed():
    a = build_set_case(3, 400, seed=5, count_tokens=quarter)
    assert a == build_set_case(3, 400, seed=5, count_tokens=quarter)
    b = build_set_case(3, 400, seed=6, count_tokens=quarter)
    assert all(x.text != y.text for x, y in zip(a.documents, b.documents)) and a.probes != b.probes
    assert a.seed == 5 and [d.source for d in a.documents] == [document_label(5, i) for i in range(3)]
    assert [d.source for d in a.documents] == ["library-s5-doc01", "library-s5-doc02", "library-s5-doc03"]
    assert all(p.task == TASK for p in a.probes)


@pytest.mark.parametrize("facts, n_big", [(1, 16), (2, 16), (3, 13)])
def test_the_first_documents_of_a_bigger_set_are_the_smaller_set(facts, n_big):
    small = build_set_case(4, 300, seed=2, count_tokens=quarter, facts_per_doc=facts)
    big = build_set_case(n_big, 300, seed=2, count_tokens=quarter, facts_per_doc=facts)
    assert big.documents[:4] == small.documents
    assert [d.text for d in big.documents[:4]] == [d.text for d in small.documents]
    assert big.probes[:4 * facts] == small.probes
    assert big.probe_document[:4 * facts] == small.probe_document
    assert big.n_tokens[:4] == small.n_tokens
    assert len(big.probes) == n_big * facts and len(set(d.text for d in big.documents)) == n_big


@pytest.mark.parametrize("seed", [0, 1, 2, 3])  # every onekey shape
def test_each_fact_is_planted_once_in_the_whole_set_in_its_own_document(seed):
    facts = 3
    case = build_set_case(6, 500, seed=seed, count_tokens=quarter, facts_per_doc=facts)
    assert len(case.documents) == 6 and len(case.probes) == 18
    assert case.probe_document == tuple(i for i in range(6) for _ in range(facts))
    assert [case.probes_of(d) for d in range(6)] == [list(range(d * facts, (d + 1) * facts)) for d in range(6)]
    keys = [key_of(p.question, seed) for p in case.probes]
    assert len(set(keys)) == len(keys)  # every fact asked by its own key
    codes = [p.answers[0] for p in case.probes]
    assert all(len(p.answers) == 1 for p in case.probes) and len(set(codes)) == len(codes)
    assert len({c.split("-")[0] for c in codes}) <= 2  # look-alikes: the codes share their words
    for probe, doc, key in zip(case.probes, case.probe_document, keys):
        code = probe.answers[0]
        counts = [whole(code, d.text) for d in case.documents]
        assert counts == [1 if i == doc else 0 for i in range(6)], (code, counts)
        digits = code.split("-")[1]
        assert sum(whole(digits, d.text) for d in case.documents) == 1  # no filler sentence repeats its digits
        assert sum(whole(key, d.text) for d in case.documents) == 1  # the key is named by its fact alone
        assert score(probe, code) == 1.0
        text = case.documents[doc].text
        fact = ONEKEY_SHAPES[seed % len(ONEKEY_SHAPES)][0].format(key=key, code=code)
        assert text.count(fact) == 1
        assert 0.1 <= probe.depth <= 0.9
        assert abs(text.index(fact) / len(text) - probe.depth) <= 0.05, (probe.depth, text.index(fact) / len(text))
    for d in range(6):  # a document's facts in order of depth, one in each of its bands
        depths = [case.probes[i].depth for i in case.probes_of(d)]
        assert all(0.1 + 0.8 * j / facts <= x <= 0.1 + 0.8 * (j + 1) / facts for j, x in enumerate(depths))


def test_documents_are_sized_like_an_eval_haystack():
    calls = []
    count = lambda text: calls.append(1) or quarter(text)  # noqa: E731
    case = build_set_case(4, 800, seed=0, count_tokens=count)
    for doc, n in zip(case.documents, case.n_tokens):
        assert n == quarter(doc.text) and 0.95 * 800 <= n <= 1.03 * 800
        assert doc.kind == "text"
    assert len(calls) <= 4 * 5


def test_a_supplied_filler_is_started_at_another_place_in_each_document():
    case = build_set_case(5, 600, seed=1, count_tokens=quarter, filler=FILLER)
    openings = [d.text[:40] for d in case.documents]
    assert len(set(openings)) == 5, openings
    assert all(d.text.startswith("Paragraph ") for d in case.documents)
    sentences = set(re.split(r"(?<=[.!?])\s+", " ".join(FILLER.split())))
    for d, doc in enumerate(case.documents):  # the filler's sentences and the document's facts, nothing else
        body = doc.text
        for i in case.probes_of(d):
            code = case.probes[i].answers[0]
            [fact] = [s for s in re.split(r"(?<=[.!?])\s+", " ".join(body.split())) if code in s]
            body = body.replace(fact, "")
        assert all(s in sentences for s in re.split(r"(?<=[.!?])\s+", " ".join(body.split())) if s)
    # document i is the same whatever the set's size, with a filler too
    assert build_set_case(2, 600, seed=1, count_tokens=quarter, filler=FILLER).documents == case.documents[:2]
    # a filler of one paragraph cannot be rotated: every document starts with it
    one = build_set_case(2, 300, seed=1, count_tokens=quarter, filler=FILLER.split("\n\n")[0])
    assert one.documents[0].text[:30] == one.documents[1].text[:30]


def test_too_many_documents_or_facts_are_refused():
    assert max_documents(2) == POOL // 2 == 20 and max_documents(MAX_FACTS_PER_DOC) == 5
    for n, facts in [(0, 2), (21, 2), (6, MAX_FACTS_PER_DOC), (41, 1)]:
        with pytest.raises(ValueError, match="documents"):
            build_set_case(n, 300, seed=0, count_tokens=quarter, facts_per_doc=facts)
    for facts in (0, MAX_FACTS_PER_DOC + 1):
        with pytest.raises(ValueError, match="facts per document"):
            build_set_case(2, 300, seed=0, count_tokens=quarter, facts_per_doc=facts)
    most = build_set_case(max_documents(MAX_FACTS_PER_DOC), 400, seed=3, count_tokens=quarter,
                          facts_per_doc=MAX_FACTS_PER_DOC)  # the whole pool of keys and codes
    assert len({p.answers[0] for p in most.probes}) == POOL


# -- the runner on the tiny model -----------------------------------------------------------------

LENGTH = 2048  # the shortest --lengths; documents of about 1k tokens: the set (~2.3k cells) fits 4k


@pytest.fixture(scope="module")
def library_run(tiny_model, tmp_path_factory):
    """One run of a 2-document set (a fact in each) in modes full and geometric, with both references;
    every load_set call is recorded."""
    from kvlocal import kvstate
    from kvlocal.evals import library_runner
    from kvlocal.evals.library_runner import run_library
    from kvlocal.session import Session

    root = tmp_path_factory.mktemp("library-eval")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLOCAL_CACHE_DIR", str(root / "cache"))
        mp.setenv("KVLOCAL_STATE_DIR", str(root / "state"))
        lib = Session(str(tiny_model), threads=2)
        try:
            loads = []
            real = library_runner.load_set

            def load_set(session, documents, **kwargs):
                result = real(session, documents, **kwargs)
                loads.append(SimpleNamespace(labels=[d.source for d in documents], layout=kwargs.get("layout"),
                                             result=result, spans=session.layout.spans))
                return result

            mp.setattr(library_runner, "load_set", load_set)
            config = LibraryConfig(2, [LENGTH], [0], ["full", "geometric"], references=[ALONE, CONCAT],
                                   facts_per_doc=1, max_tokens=2)
            out = root / "out" / "results.jsonl"
            logs: list[str] = []
            rows = run_library(lib, config, out, log=logs.append)
            yield SimpleNamespace(lib=lib, config=config, out=out, rows=rows, loads=loads, logs=logs,
                                  cache=root / "cache", entries=kvstate.list_entries(), run_loads=list(loads),
                                  text=out.read_text())
        finally:
            lib.close()


def answers(rows: list[dict], reference: str | None = None) -> list[dict]:
    return [r for r in rows if r["kind"] == "answer" and reference in (None, r["reference"])]


@pytest.mark.engine
def test_every_fact_is_asked_in_every_mode_and_of_each_reference(library_run):
    rows = library_run.rows
    assert rows == load_rows(library_run.out)  # every row returned is in the file, in order
    asked = Counter((r["reference"], r["mode"], r["probe"]) for r in answers(rows))
    want = [(SET, m, p) for p in (0, 1) for m in ("full", "geometric")] + [(ALONE, "full", p) for p in (0, 1)] \
        + [(CONCAT, m, p) for p in (0, 1) for m in ("full", "geometric")]
    assert sorted(asked) == sorted(want) and set(asked.values()) == {1}
    assert len({answer_key(r) for r in answers(rows)}) == len(want)
    for r in answers(rows):
        assert r["document"] == r["probe"]  # a fact per document
        assert r["task"] == TASK and r["n_documents"] == 2 and r["length"] == LENGTH and r["seed"] == 0
        assert r["facts_per_doc"] == 1 and r["max_tokens"] == 2 and r["steps"] >= 1
        assert len(r["expected"]) == 1 and r["score"] in (0.0, 1.0)
        assert r["bytes_read"] > 0 and r["bytes_dense"] > 0
    layouts = {r["reference"]: r["layout"] for r in answers(rows)}
    assert layouts == {SET: "consecutive", ALONE: "alone", CONCAT: "concatenation"}
    concat = answers(rows, CONCAT)
    assert all(r["concat_prefill_s"] > 0 for r in concat)  # prefilled in this run
    assert any(line.startswith("concatenation of seed 0:") and "prefilled" in line for line in library_run.logs)
    # the alone reference is each body's cached state assembled alone: fewer cells than the set's
    alone = answers(rows, ALONE)
    assert all(r["n_tokens"] < answers(rows, SET)[0]["n_tokens"] for r in alone)


@pytest.mark.engine
def test_a_body_row_per_body_prefilled_and_a_load_row_from_the_cache_alone(library_run):
    rows, loads = library_run.rows, library_run.run_loads
    sets = [load for load in loads if len(load.labels) == 2]
    assert [load.result.cache_hits for load in sets] == [0, 2]  # prefilled, then readied again from the cache
    first, cached = sets[0].result, sets[1].result
    bodies = [r for r in rows if r["kind"] == "body"]
    assert [(b["document"], b["label"]) for b in bodies] == [(0, "library-s0-doc01"), (1, "library-s0-doc02")]
    assert [b["n_tokens"] for b in bodies] == [d.n_tokens for d in first.documents]
    assert [b["prefill_s"] for b in bodies] == [d.seconds for d in first.documents]
    assert all(b["prefill_s"] > 0 and b["length"] == LENGTH and b["threads"] == 2 for b in bodies)
    [load] = [r for r in rows if r["kind"] == "load"]
    assert load["ready_s"] == cached.ready_seconds > 0 and load["n_cells"] == cached.n_cells
    assert load["layout"] == cached.layout == "consecutive" and load["n_positions"] == cached.n_positions
    assert [(d["label"], d["n_tokens"]) for d in load["documents"]] == [(b["label"], b["n_tokens"]) for b in bodies]
    assert [d["load_s"] for d in load["documents"]] == [d.seconds for d in cached.documents]
    assert all(r["n_tokens"] == cached.n_cells for r in answers(rows, SET))
    # the alone reference: each body's cached state, assembled alone; nothing prefilled
    alone = [load for load in loads if len(load.labels) == 1 and load.layout == "consecutive"]
    assert [load.labels for load in alone] == [["library-s0-doc01"], ["library-s0-doc02"]]
    assert all(load.result.cache_hits == 1 and load.result.layout == "consecutive" for load in alone)
    assert [r["n_tokens"] for r in answers(rows, ALONE)] == [load.result.n_cells for load in alone]
    # saved states: the two bodies and the concatenation (the references added no body of their own)
    assert len(library_run.entries) == 3


@pytest.mark.engine
def test_reads_are_attributed_to_the_facts_document(library_run):
    rows = library_run.rows
    [set_load] = [load for load in library_run.run_loads if len(load.labels) == 2 and load.result.cache_hits == 2]
    cells = [s.end - s.start for s in set_load.spans]
    for r in answers(rows, SET):
        assert 0.0 <= r["fact_document_share"] <= 1.0
        if r["mode"] == "full":  # every step reads every cell: the share is the document's part of the cells
            assert r["fact_document_share"] == pytest.approx(cells[r["document"]] / sum(cells))
    for r in answers(rows):
        if r["mode"] == "full":
            assert r["reduction"] == 1.0 and r["bytes_read"] == r["bytes_dense"]
        else:
            assert r["reduction"] > 1.0  # routed: fewer bytes than dense
    assert all(r["fact_document_share"] == 1.0 for r in answers(rows, ALONE))  # its own document alone
    assert all(r["fact_document_share"] is None for r in answers(rows, CONCAT))  # one document: no attribution


@pytest.mark.engine
def test_a_rerun_writes_nothing_and_loads_nothing(library_run):
    from kvlocal.evals.library_runner import run_library

    before = len(library_run.loads)
    again = run_library(library_run.lib, library_run.config, library_run.out, log=library_run.logs.append)
    assert library_run.out.read_text() == library_run.text
    assert len(library_run.loads) == before
    assert again == library_run.rows


@pytest.mark.engine
def test_a_rerun_asks_only_what_is_missing(library_run, tmp_path):
    from kvlocal.evals.library_runner import run_library

    out = tmp_path / "results.jsonl"
    kept = [line for line in library_run.text.splitlines() if json.loads(line).get("reference") != ALONE]
    out.write_text("\n".join(kept[:3]) + '\n{"kind": "answer", "n_docu\n' + "\n".join(kept[3:]) + "\n")  # a cut line
    before = len(library_run.loads)
    config = LibraryConfig(**{**vars(library_run.config), "references": [ALONE]})
    rows = run_library(library_run.lib, config, out, log=lambda line: None)
    new = load_rows(out)[len(kept):]
    assert [r["kind"] for r in new] == ["answer", "answer"]
    assert [answer_key(r) for r in new] == [answer_key(r) for r in answers(library_run.rows, ALONE)]
    assert [load.labels for load in library_run.loads[before:]] == [["library-s0-doc01"], ["library-s0-doc02"]]
    assert len(rows) == len(library_run.rows)


@pytest.mark.engine
def test_the_concatenation_is_left_out_where_it_does_not_fit_the_trained_context(library_run, tmp_path):
    from kvlocal.evals.library_runner import run_library

    lib = library_run.lib
    trained = lib.trained_ctx
    lib.trained_ctx = 2600  # the two bodies (~2.3k cells) no longer fit one after the other, nor as one document
    logs: list[str] = []
    try:
        config = LibraryConfig(2, [LENGTH], [0], ["full"], references=[CONCAT], facts_per_doc=1, max_tokens=2)
        rows = run_library(lib, config, tmp_path / "results.jsonl", log=logs.append)
    finally:
        lib.trained_ctx = trained
    assert {r["layout"] for r in answers(rows, SET)} == {"parallel"} and len(answers(rows, SET)) == 2
    assert answers(rows, CONCAT) == [] and any("concatenation" in line for line in logs)


# -- the report ---------------------------------------------------------------------------------------


def _answer(reference: str, mode: str, score: float, *, probe: int = 0, seed: int = 0, top_k: int = 4,
            share: float | None = 0.5, n_documents: int = 2, length: int = 2048, bytes_read: int = 100,
            layout: str = "consecutive") -> dict:
    return {"kind": "answer", "n_documents": n_documents, "length": length, "seed": seed, "probe": probe,
            "reference": reference, "mode": mode, "top_k": top_k, "haystack": "", "question": "steps",
            "score": score, "bytes_read": bytes_read, "bytes_dense": 400, "steps": 4, "decode_tps": 10.0,
            "fact_document_share": share, "n_tokens": 2250, "layout": layout}


def _body(label: str, n_tokens: int, prefill_s: float) -> dict:
    return {"kind": "body", "seed": 0, "document": 0, "label": label, "n_tokens": n_tokens, "length": 2048,
            "prefill_s": prefill_s, "threads": 2}


def _load(n_documents: int, ready_s: float, documents: list[tuple[str, int]], length: int = 2048) -> dict:
    return {"kind": "load", "n_documents": n_documents, "length": length, "seed": 0, "haystack": "",
            "layout": "consecutive", "n_cells": 2250, "n_positions": 2250, "n_ctx": 3072, "ready_s": ready_s,
            "threads": 2, "documents": [{"label": lbl, "n_tokens": n, "load_s": 0.1} for lbl, n in documents]}


REPORT_ROWS = [
    *[_answer(SET, "full", s, probe=i, seed=i % 2, bytes_read=400) for i, s in enumerate([1, 0, 1, 1])],
    _answer(SET, "full", 1, probe=4, top_k=8, bytes_read=400),  # full's top-k is no budget: the same cell
    _answer(SET, "geometric", 1, share=0.8), _answer(SET, "geometric", 0, probe=1, share=None),
    _answer(SET, "geometric", 0, top_k=8, share=0.6),
    _answer(CONCAT, "full", 0, share=None, layout="concatenation", bytes_read=400),
    _answer(ALONE, "full", 1, share=1.0, layout="alone", bytes_read=400),
    _answer(ALONE, "full", 1, probe=1, share=1.0, layout="alone", bytes_read=400),
    _answer(SET, "full", 0, n_documents=3),
    _body("library-s0-doc01", 1000, 2.0), _body("library-s0-doc02", 1010, 3.0),
    _load(2, 0.5, [("library-s0-doc01", 1000), ("library-s0-doc02", 1010)]),
    _load(2, 1.5, [("library-s0-doc01", 1000), ("library-s0-doc02", 1010)]),
    _load(3, 0.7, [("library-s0-doc01", 1000), ("library-s0-doc02", 1010), ("library-s0-doc03", 990)]),
]


def test_the_summary_has_accuracy_and_n_per_reference_and_mode():
    cells = library_report.summarize(REPORT_ROWS)["cells"]
    got = [(c["n_documents"], c["reference"], c["mode"], c["top_k"], c["accuracy"], c["n"]) for c in cells]
    assert got == [(2, SET, "full", None, 0.8, 5), (2, SET, "geometric", 4, 0.5, 2), (2, SET, "geometric", 8, 0.0, 1),
                   (2, ALONE, "full", None, 1.0, 2), (2, CONCAT, "full", None, 0.0, 1), (3, SET, "full", None, 0.0, 1)]
    by = {(c["n_documents"], c["reference"], c["mode"], c["top_k"]): c for c in cells}
    assert by[(2, SET, "full", None)]["seeds"] == [0, 1]
    assert by[(2, SET, "geometric", 4)]["fact_document_share"] == pytest.approx(0.8)  # None left out
    assert by[(2, CONCAT, "full", None)]["fact_document_share"] is None
    assert by[(2, SET, "geometric", 4)]["reduction"] == pytest.approx(4.0)
    assert by[(2, SET, "full", None)]["reduction"] == 1.0
    assert by[(2, SET, "full", None)]["layout"] == ["consecutive"]
    lo, hi = by[(2, SET, "full", None)]["accuracy_ci"]
    assert lo < 0.8 < hi


def test_ready_share_is_the_cached_ready_time_over_the_bodies_prefill():
    loads = library_report.summarize(REPORT_ROWS)["loads"]
    two, three = loads
    assert (two["n_documents"], two["n"], two["n_cells"]) == (2, 2, 2250)
    assert two["ready_s"] == pytest.approx(1.0) and two["prefill_s"] == pytest.approx(5.0)
    assert two["ready_share"] == pytest.approx((0.5 / 5.0 + 1.5 / 5.0) / 2)
    # a body whose prefill this file did not record: nothing to compare with
    assert three["n_documents"] == 3 and three["prefill_s"] is None and three["ready_share"] is None
    # the same label at another size of body (another length) is another body
    other = [_body("library-s0-doc01", 2000, 4.0), _load(2, 0.5, [("library-s0-doc01", 1000)], length=4096)]
    assert library_report.summarize(other)["loads"][0]["ready_share"] is None


def test_the_markdown_tables():
    text = library_report.markdown(library_report.summarize(REPORT_ROWS))
    lines = text.splitlines()
    assert lines[0].startswith("| set | answered by | mode | accuracy (95 % CI) | n |")
    rows = [line for line in lines if line.startswith("| 2 x 2k |")]
    assert rows[0].startswith("| 2 x 2k | the set (consecutive) | full | 80% [") and "| 5 | 0,1 | 1.0x | 50% |" in rows[0]
    assert rows[1].startswith("| 2 x 2k | the set (consecutive) | geometric top-4, question steps | 50% [") and "| 4.0x | 80% |" in rows[1]
    assert rows[3].startswith("| 2 x 2k | its document alone | full | 100% [") and rows[3].endswith("| 1.0x |  | 10.0 |")
    assert rows[4].startswith("| 2 x 2k | the concatenation, prefilled | full | 0% [")
    assert "| 2 x 2k | 2,250 | consecutive | 2 | 1.0 s | 5 s | 20.0% |" in lines
    assert "| 3 x 2k | 2,250 | consecutive | 1 | 0.7 s |  |  |" in lines
    # no load rows: no second table
    assert "ready from the cache" not in library_report.markdown(library_report.summarize(REPORT_ROWS[:3]))


def test_the_report_reads_kept_rows_and_skips_cut_lines(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    lines = [json.dumps(r) for r in REPORT_ROWS]
    path.write_text("\n".join(lines[:5]) + '\n{"kind": "ans\n[1, 2]\n{"kind": "other"}\n' + "\n".join(lines[5:]) + "\n")
    assert load_rows(path) == REPORT_ROWS and load_rows(tmp_path / "missing.jsonl") == []
    library_report.main([str(path)])
    want = library_report.markdown(library_report.summarize(REPORT_ROWS))
    assert capsys.readouterr().out.strip() == want
    with pytest.raises(SystemExit) as info:
        library_report.main([])
    assert info.value.code == 2
    module = subprocess.run([sys.executable, "-m", "kvlocal.evals.library_report", str(path)], capture_output=True,
                            text=True, timeout=120)
    assert module.returncode == 0, module.stderr
    assert module.stdout.strip() == want


# -- the command line ---------------------------------------------------------------------------------


def run(*args: str):
    return CliRunner().invoke(cli.app, list(args))


@pytest.fixture
def no_engine(monkeypatch):
    monkeypatch.setattr(cli_common, "open_session", lambda *a, **k: pytest.fail("engine work before the check"))


@pytest.mark.parametrize("args, words", [
    (["--references", "bogus"], "--references"),
    (["--references", "alone,bogus"], "bogus"),
    (["--layout", "bogus"], "--layout"),
    (["21"], "a seed has 20 documents"),
    (["5", "--facts-per-doc", "8"], None),  # fine: stopped at the session below
    (["6", "--facts-per-doc", "8"], "a seed has 5 documents"),
    (["2", "--quick"], "No such option"),  # the needle grid's check is `kvlocal eval quick`
    (["--lengths", "1k"], "at least 2k"),
    (["--seeds", ","], "--seeds"),
    (["--modes", "full,sideways"], "sideways"),
    (["--alone-modes", "sideways"], "sideways"),
    (["--focus", "nearest"], "focus"),
])
def test_bad_library_options_are_refused_before_any_work(monkeypatch, tmp_path, args, words):
    class Stop(Exception):
        pass

    def open_session(*a, **k):
        raise Stop

    monkeypatch.setattr(cli_common, "open_session", open_session)
    argv = ["eval", "library", *(args if args[0].isdigit() else ["2", *args]), "--out", str(tmp_path / "out")]
    result = run(*argv)
    if words is None:
        assert isinstance(result.exception, Stop), result.output
        return
    assert result.exit_code == 2, result.output
    assert words in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["41", "0"])
def test_the_set_size_is_bounded_by_the_option(no_engine, value):
    result = run("eval", "library", value)
    assert result.exit_code == 2 and "the set size N" in result.output


def test_the_command_line_hands_one_config_to_the_runner(monkeypatch, tmp_path):
    from kvlocal import library
    from kvlocal.evals import library_runner

    opened, configs, checked = [], [], []
    session = SimpleNamespace(trained_ctx=32768)
    monkeypatch.setattr(cli_common, "open_session", lambda *a, **k: opened.append((a, k)) or session)
    monkeypatch.setattr(library, "check_composable", checked.append)

    def run_library(s, config, out, **kwargs):
        assert s is session
        configs.append((config, out, kwargs))
        return []

    monkeypatch.setattr(library_runner, "run_library", run_library)
    result = run("eval", "library", "3", "--out", str(tmp_path / "ev"))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("| set | answered by |")
    (config, out, kwargs), = configs
    assert opened[0][1] == {} and checked == [session]  # a plain session; the set loader checks its model
    assert (config.n_documents, config.lengths, config.seeds, config.facts_per_doc) == (3, [8192], [0], 2)
    assert config.modes == ["full", "geometric", "window", "random"]
    assert config.references == [ALONE] and config.layout is None and config.max_tokens is None
    assert out == tmp_path / "ev" / "results.jsonl" and kwargs["haystack_name"] == "" and kwargs["filler"] is None
    configs.clear()
    result = run("eval", "library", "4", "--lengths", "2k,4k", "--seeds", "1,2", "--modes", "full,geometric",
                 "--references", "alone,concat", "--layout", "parallel", "--facts-per-doc", "3", "--top-k", "3",
                 "-n", "5", "--out", str(tmp_path / "ev"))
    assert result.exit_code == 0, result.output
    (config, _, _), = configs
    assert (config.lengths, config.seeds, config.modes) == ([2048, 4096], [1, 2], ["full", "geometric"])
    assert (config.references, config.layout, config.facts_per_doc) == ([ALONE, CONCAT], "parallel", 3)
    assert config.route.top_k == 3 and config.max_tokens == 5 and config.answer_tokens == 5
    assert config.alone_modes == ("full",) and config.route.focus == "hinted"
    configs.clear()
    assert run("eval", "library", "2", "--alone-modes", "full,geometric", "--focus", "set",
               "--out", str(tmp_path / "ev")).exit_code == 0
    assert configs[0][0].alone_modes == ("full", "geometric") and configs[0][0].route.focus == "set"
    configs.clear()
    assert run("eval", "library", "2", "--out", str(tmp_path / "ev")).exit_code == 0
    # a focused set's rows record the route of the one document it reads; each alone, its own
    assert configs[0][0].route_of("geometric", 2).focus == "hinted"
    assert configs[0][0].route_of("geometric", 1).focus == "set"
    configs.clear()
    assert run("eval", "library", "2", "--references", "none", "--layout", "consecutive",
               "--out", str(tmp_path / "ev")).exit_code == 0
    assert configs[0][0].references == [] and configs[0][0].layout == "consecutive"
    # --haystack: its text is every document's filler
    filler = tmp_path / "filler.txt"
    filler.write_text(FILLER)
    assert run("eval", "library", "2", "--haystack", str(filler), "--out", str(tmp_path / "ev")).exit_code == 0
    assert configs[-1][2]["filler"] == FILLER and configs[-1][2]["haystack_name"] == str(filler)
    # a set over the model's trained context
    session.trained_ctx = 4096
    over = run("eval", "library", "2", "--lengths", "8k", "--out", str(tmp_path / "ev"))
    assert over.exit_code == 2 and "trained context" in over.stderr


@pytest.mark.engine
def test_eval_library_runs_on_the_tiny_model_and_prints_the_table(library_run, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(library_run.cache))  # the run's bodies: from the cache
    out = tmp_path / "ev"
    result = run("eval", "library", "2", "--lengths", "2k", "--modes", "full,geometric", "--references", "alone",
                 "--facts-per-doc", "1", "--model", str(tiny_model), "--threads", "2", "-n", "2", "--out", str(out))
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("| set | answered by | mode |") and "kvlocal:" not in result.stdout
    table = [line for line in lines if line.startswith("| 2 x 2k |")]
    assert [line.split(" | ")[1:3] for line in table[:3]] == [["the set (consecutive)", "full, within the hinted document"],
                                                            # focused: one document's route
                                                            ["the set (consecutive)", "geometric top-4, within the hinted document"],
                                                            ["its document alone", "full"]]
    assert all(line.split(" | ")[4] == "2" for line in table[:3])  # n: a fact in each of 2 documents
    assert re.search(r"^\| 2 x 2k \| [\d,]+ \| consecutive \| 1 \| [\d.]+ s \|  \|  \|$", result.stdout, re.M)
    assert "set of 2 (seed 0)" in result.stderr and "prefilling" not in result.stderr  # both bodies cached
    rows = load_rows(out / "results.jsonl")
    assert Counter(r["kind"] for r in rows) == {"answer": 6, "load": 1}
    again = run("eval", "library", "2", "--lengths", "2k", "--modes", "full,geometric", "--references", "alone",
                "--facts-per-doc", "1", "--model", str(tiny_model), "--threads", "2", "-n", "2", "--out", str(out))
    assert again.exit_code == 0 and again.stdout == result.stdout
    assert load_rows(out / "results.jsonl") == rows


@pytest.mark.engine
def test_bench_library_readies_the_set_from_the_cache_and_decodes_full_and_geometric(library_run, tiny_model,
                                                                                       tmp_path, monkeypatch):
    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(library_run.cache))
    out = tmp_path / "bench.json"
    result = run("bench", "library", "2", "--lengths", "2k", "--tokens", "3", "--model", str(tiny_model),
                 "--threads", "2", "--out", str(out))
    assert result.exit_code == 0, result.stderr
    assert "bodies prefilled and cached" in result.stderr  # two facts a document: not the eval run's bodies
    report = json.loads(out.read_text())
    (entry,) = report["library"]
    assert entry["n_documents"] == 2 and entry["layout"] == "consecutive" and entry["ready_s"] > 0
    assert entry["full_tps"] > 0 and entry["geometric_tps"] > 0
    assert entry["speedup"] == pytest.approx(entry["geometric_tps"] / entry["full_tps"])
    assert entry["bytes_reduction"] > 1  # geometric read fewer bytes than the dense baseline
    assert entry["geometric_route"].startswith("geometric: top-")  # the route the set's answer took, in words
    assert report["seed"] == 0  # --set-seed: the eval's seed-0 set
    assert re.search(r"^\| 2 x 2k \| [\d,]+ \| consecutive \|", result.stdout, re.M)
    assert run("bench", "library", "2", "--lengths", "2k,4k", "--model", str(tiny_model)).exit_code == 2


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_paraphrased_questions_keep_the_documents_and_the_key_word(seed):
    plain = build_set_case(3, 500, seed=seed, count_tokens=quarter)
    other = build_set_case(3, 500, seed=seed, count_tokens=quarter, paraphrase=True)
    assert other.documents == plain.documents  # their cached states serve both
    assert [p.answers for p in other.probes] == [p.answers for p in plain.probes]
    assert len({p.question for p in other.probes} & {p.question for p in plain.probes}) == 0
    for a, b in zip(plain.probes, other.probes):
        assert key_of(a.question, seed) in b.question
