"""`kvlocal lab hints`: where text hints point on a library set, from its tokens alone
(kvlocal/lab/hints.py). The coverage logic on word-per-cell sets without an engine; the command on the
tiny model."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from kvlocal.cli import app
from kvlocal.evals.library_cases import build_set_case
from kvlocal.lab.hints import hint_coverage, markdown, summarize, text_cells

HEAD = 64  # cells before the first body (the sink region)


def words_of(text: str) -> list[bytes]:
    """One cell per word with its leading space (a tokenizer of whole words)."""
    return [f" {w}".encode() for w in re.findall(r"\S+", text)]


def cells_of(case, pad: int = 64):
    """A set laid out as the library does: a head, then each body padded to whole regions."""
    pieces: list[bytes] = [b" head"] * HEAD
    starts, n_body = [], []
    for doc in case.documents:
        body = words_of(doc.text)
        starts.append(len(pieces))
        n_body.append(len(body))
        pieces += body + [b"\n"] * (-len(body) % pad)
    return pieces, starts, n_body


def test_text_cells_finds_the_first_and_last_cell_of_a_spelling():
    pieces = [b" the", b" code", b" cob", b"alt", b"-48", b"49", b"."]
    assert text_cells(pieces, 0, len(pieces), "cobalt-4849") == (2, 5)
    assert text_cells(pieces, 3, len(pieces), "cobalt-4849") is None  # its start is outside the range
    assert text_cells(pieces, 0, len(pieces), "amber-1") is None


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_every_hint_of_a_set_lies_in_its_fact_s_document_and_reads_the_code(seed):
    case = build_set_case(6, 900, seed=seed, count_tokens=lambda t: len(t.split()))
    pieces, starts, n_body = cells_of(case)
    rows = hint_coverage(pieces, starts, n_body, case, hints=1, region=64, sinks=64)
    assert len(rows) == len(case.probes) == 12
    for row in rows:
        assert row["in_document"] and row["hint_documents"] == [row["document"]]
        assert row["code_read"]
        lo = starts[row["document"]]
        assert lo <= row["hint_cells"][0] < lo + n_body[row["document"]]


def test_a_code_cut_by_a_region_boundary_counts_as_read_only_with_both_regions():
    case = build_set_case(2, 600, seed=0, count_tokens=lambda t: len(t.split()))
    pieces, starts, n_body = cells_of(case)
    code = case.probes[0].answers[0]
    at = next(i for i in range(len(pieces)) if code in pieces[i].decode())
    # split the code over two cells on either side of a region boundary: shift it by padding before it
    shift = (64 - at % 64) % 64
    pieces = pieces[:at] + [b" pad"] * (shift - 1) + [b" " + code[:3].encode(), code[3:].encode()] + pieces[at + 1:]
    n_body = [n_body[0] + shift] + n_body[1:]
    starts = [starts[0]] + [s + shift for s in starts[1:]]
    row = hint_coverage(pieces, starts, n_body, case, hints=1, region=64, sinks=64)[0]
    assert row["code_read"] and not row["code_in_first_region"]
    assert row["hint_regions"] == 2


def test_the_summary_counts_shares_with_intervals_per_seed_and_over_all():
    rows = [{"n_documents": 2, "length": 8192, "haystack": "", "scope": "sentence", "seed": s, "hint_regions": 1,
             "in_document": True, "code_read": s == 0, "code_in_first_region": False} for s in (0, 1)]
    summary = summarize(rows)
    assert [e["seed"] for e in summary] == [0, 1, "all"]
    assert summary[-1]["code_read"] == 0.5 and summary[-1]["n"] == 2
    lo, hi = summary[-1]["code_read_ci"]
    assert 0 < lo < 0.5 < hi < 1
    assert "| 2 x 8k | generated | template | sentence | all | 2 |" in markdown(summary)


@pytest.mark.engine
def test_the_command_checks_the_hints_on_the_tiny_model(tiny_model, tmp_path):
    out = tmp_path / "lab"
    result = CliRunner().invoke(app, ["lab", "hints", "2", "--lengths", "2k", "--seeds", "0,1",
                                      "--hint-scope", "both", "--model", str(tiny_model), "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "hints.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2 * 2  # seeds x scopes x documents x facts
    assert {r["scope"] for r in rows} == {"sentence", "region"}
    # the tiny model's byte-level tokens spell a code ~30 cells after its key, past FOLLOW: the rows say
    # so per fact (with the default model's tokens the hinted regions held every code: docs/experiments/library-hints.md)
    assert all(r["in_document"] for r in rows if r["scope"] == "sentence")
    assert {r["code_read"] for r in rows} <= {True, False}
    assert "| 2 x 2k | generated | template | sentence | all | 8 |" in result.output


def test_the_command_refuses_an_unknown_scope(tmp_path):
    result = CliRunner().invoke(app, ["lab", "hints", "2", "--hint-scope", "page", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "--hint-scope" in result.output
