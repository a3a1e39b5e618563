"""`kvlocal eval questions FILE`: the question file (kvlocal.evals.question_sets), its errors, the shipped
file, and the run on the tiny model through the library runner (rows, resume, the table).

The tiny model's answers are meaningless: the engine test checks the plumbing."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvlocal import cli, cli_common
from kvlocal.errors import UsageError
from kvlocal.evals.library_runner import ALONE, SET, library_row
from kvlocal.evals.question_sets import TASK, load_question_set
from kvlocal.evals.runner import load_rows

SHIPPED = Path(__file__).resolve().parent.parent / "kvlocal" / "evals" / "question_files"

HARBOUR = "\n\n".join(f"Line {i} of the harbour log notes a quiet tide and one ferry." for i in range(30)) + \
    "\n\nThe harbour master's launch is named Petrel and its berth is number 14.\n\n" + \
    "\n\n".join(f"Entry {i} records the weather as fair." for i in range(30))
ORCHARD = "\n\n".join(f"Row {i} of the orchard holds pear trees." for i in range(30)) + \
    "\n\nThe oldest tree in the orchard was planted in 1911 by Ada Quill.\n\n" + \
    "\n\n".join(f"Row {i} was pruned in March." for i in range(30, 60))


def write_set(folder: Path, questions=None, digests=None) -> Path:
    """A question file over two small text documents in `folder` (relative paths)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("harbour.txt", HARBOUR), ("orchard.txt", ORCHARD)):
        (folder / name).write_text(text)
    digests = digests or [hashlib.sha256(t.encode()).hexdigest() for t in (HARBOUR, ORCHARD)]
    spec = {"documents": [{"path": "harbour.txt", "sha256": digests[0]}, {"path": "orchard.txt", "sha256": digests[1]}],
            "questions": questions if questions is not None else [
                {"document": 0, "question": "What is the harbour master's launch named?", "answers": ["Petrel"]},
                {"document": 1, "question": "Who planted the oldest tree, and when?", "answers": ["Ada Quill", "1911"]},
                {"document": 0, "question": "Which berth does the launch use?", "answers": ["14"]}]}
    path = folder / "set.json"
    path.write_text(json.dumps(spec))
    return path


def test_a_question_file_becomes_one_set_case(tmp_path):
    case = load_question_set(write_set(tmp_path))
    assert [d.text for d in case.documents] == [HARBOUR, ORCHARD]
    assert case.probe_document == (0, 1, 0)
    assert [p.answers for p in case.probes] == [("Petrel",), ("Ada Quill", "1911"), ("14",)]
    assert all(p.task == TASK for p in case.probes) and case.probes_of(0) == [0, 2]
    # depth: the answer's first occurrence in its document, which here sits in its middle
    assert abs(case.probes[0].depth - HARBOUR.index("Petrel") / len(HARBOUR)) < 1e-9
    assert 0.3 < case.probes[1].depth < 0.7


@pytest.mark.parametrize("edit, words", [
    (lambda p: p.unlink(), "cannot read the question file"),
    (lambda p: p.write_text("{not json"), "not a JSON question file"),
    (lambda p: p.write_text("[]"), "non-empty 'documents' list"),
    (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "questions": []})), "non-empty 'questions' list"),
    (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "documents": [{"path": "harbour.txt"}]})),
     "document 0 needs a 'path' and a 'sha256'"),
    (lambda p: (p.parent / "orchard.txt").write_text(ORCHARD + " One more line."), "is another text"),
    (lambda p: (p.parent / "harbour.txt").unlink(), "document 0"),
])
def test_a_bad_question_file_is_one_clear_error(tmp_path, edit, words):
    path = write_set(tmp_path)
    edit(path)
    with pytest.raises(UsageError, match=words):
        load_question_set(path)


@pytest.mark.parametrize("question", [
    {"document": 2, "question": "Where?", "answers": ["x"]},
    {"document": True, "question": "Where?", "answers": ["x"]},
    {"document": 0, "question": "  ", "answers": ["x"]},
    {"document": 0, "question": "Where?", "answers": []},
    {"document": 0, "question": "Where?", "answers": ["x", ""]},
    "Where?",
])
def test_a_malformed_question_is_refused_by_its_number(tmp_path, question):
    path = write_set(tmp_path, questions=[{"document": 0, "question": "Fine?", "answers": ["Petrel"]}, question])
    with pytest.raises(UsageError, match="question 1 needs 'document' \\(0 to 1\\)"):
        load_question_set(path)


def test_the_shipped_file_asks_words_its_documents_hold():
    """Every answer word of the shipped file is in its document (where the document is installed: its
    sha256 is checked, so this is the text the questions were written for)."""
    for path in sorted(SHIPPED.glob("*.json")):
        spec = json.loads(path.read_text())
        assert len(spec["questions"]) >= 16 and len(spec["documents"]) >= 2
        if not all(Path(d["path"]).is_file() for d in spec["documents"]):
            continue
        case = load_question_set(path)
        for probe, d in zip(case.probes, case.probe_document):
            text = case.documents[d].text.lower()
            assert all(a.lower() in text for a in probe.answers), probe
            assert 0 < probe.depth < 1


def run(*args: str):
    return CliRunner().invoke(cli.app, list(args))


@pytest.mark.parametrize("args, words", [
    (["--references", "bogus"], "--references"),
    (["--modes", "full,sideways"], "sideways"),
])
def test_bad_options_are_refused_before_any_work(monkeypatch, tmp_path, args, words):
    monkeypatch.setattr(cli_common, "open_session", lambda *a, **k: pytest.fail("engine work before the check"))
    result = run("eval", "questions", str(write_set(tmp_path / "docs")), *args, "--out", str(tmp_path / "out"))
    assert result.exit_code == 2 and words in result.stderr, result.output
    assert not (tmp_path / "out").exists()


def test_a_bad_file_is_refused_before_any_work(monkeypatch, tmp_path):
    monkeypatch.setattr(cli_common, "open_session", lambda *a, **k: pytest.fail("engine work before the check"))
    path = write_set(tmp_path / "docs")
    (path.parent / "harbour.txt").write_text("another text")
    result = run("eval", "questions", str(path), "--out", str(tmp_path / "out"))
    assert result.exit_code == 2 and "is another text" in result.stderr and "Traceback" not in result.output


@pytest.mark.engine
def test_eval_questions_asks_the_set_and_each_document_alone_and_resumes(tiny_model, tmp_path, cache_dir):
    path = write_set(tmp_path / "docs")
    out = tmp_path / "ev"
    argv = ["eval", "questions", str(path), "--modes", "full,geometric", "--model", str(tiny_model), "--threads", "2",
            "-n", "2", "--out", str(out)]
    result = run(*argv)
    assert result.exit_code == 0, result.stderr
    rows = load_rows(out / "results.jsonl", library_row)
    answers = [r for r in rows if r["kind"] == "answer"]
    # the set in both modes, each document alone in full attention and the default route
    assert Counter((r["reference"], r["mode"]) for r in answers) == {
        (SET, "full"): 3, (SET, "geometric"): 3, (ALONE, "full"): 3, (ALONE, "geometric"): 3}
    assert {r["haystack"] for r in answers} == {"set"} and {r["questions"] for r in answers} == {"hand-written"}
    assert sorted(r["document"] for r in answers if r["reference"] == ALONE and r["mode"] == "full") == [0, 0, 1]
    assert all(r["n_documents"] == 2 and r["task"] == TASK for r in answers)
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("| set | answered by | mode |") and "kvlocal:" not in result.stdout
    assert sum("hand-written questions" in line for line in lines) == 4
    again = run(*argv)
    assert again.exit_code == 0 and again.stdout == result.stdout
    assert load_rows(out / "results.jsonl", library_row) == rows  # nothing asked twice
