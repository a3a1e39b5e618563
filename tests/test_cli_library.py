"""`kvlocal ask DOC... QUESTION` over a set of documents on the tiny model: the argument shape, the set's
summaries, skipped files and the exit status, the KV limit, and the bad inputs refused with nothing lost."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvlocal import cli, cli_common, kvstate
from kvlocal.cli import EXIT_SKIPPED, app
from kvlocal.errors import UsageError

A = "\n".join(f"Line {i}: the gauge at post {i} read {i * 13 % 97} units." for i in range(25))
B = "\n".join(f"Row {i}: the crate in bay {i} held {i * 7 % 89} bolts." for i in range(30))
QUESTION = "What did post 7 read?"


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return path


@pytest.fixture
def docs(tmp_path) -> tuple[Path, Path]:
    return write(tmp_path / "a.txt", A), write(tmp_path / "b.txt", B)


def ask(*args, model, extra=()):
    return run("ask", *map(str, args), QUESTION, "--model", str(model), "--max-tokens", "4", *extra)


def test_the_question_is_the_last_argument_after_every_document(monkeypatch, docs):
    seen = []

    def record(documents, max_kv):
        seen.append((list(documents), max_kv))
        raise UsageError("stop")

    monkeypatch.setattr(cli, "_document_set", record)
    result = run("ask", str(docs[0]), str(docs[1]), "which post?", "--max-kv", "2GiB")
    assert result.exit_code == 2 and "stop" in result.stderr
    assert seen == [([str(docs[0]), str(docs[1])], "2GiB")]
    missing = run("ask", str(docs[0]))  # one argument: the question is missing
    assert missing.exit_code == 2 and "Missing argument" in missing.output


@pytest.mark.parametrize("value", ["lots", "0", "-1G", "8 parsecs"])
def test_a_bad_kv_limit_is_refused_before_any_work(monkeypatch, docs, value):
    monkeypatch.setattr(cli_common, "open_session", lambda *a, **k: pytest.fail("engine work before the check"))
    result = run("ask", str(docs[0]), str(docs[1]), "q?", "--max-kv", value)
    assert result.exit_code == 2 and "max-kv" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("layout", ["empty folder", "duplicate", "same text", "missing"])
def test_bad_sets_are_one_line_errors_before_any_work(monkeypatch, tmp_path, docs, layout):
    monkeypatch.setattr(cli_common, "open_session", lambda *a, **k: pytest.fail("engine work before the check"))
    if layout == "empty folder":
        (tmp_path / "empty").mkdir()
        args, code, words = [docs[0], tmp_path / "empty"], 2, "holds no documents"
    elif layout == "duplicate":
        args, code, words = [docs[0], docs[1], docs[0]], 1, "named twice"
    elif layout == "same text":
        args, code, words = [docs[0], write(tmp_path / "copy.md", A)], 1, "same text"
    else:
        args, code, words = [docs[0], tmp_path / "nope.txt"], 2, "no such file"
    result = run("ask", *map(str, args), "q?")
    assert result.exit_code == code, result.output
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1


pytestmark_engine = pytest.mark.engine


@pytestmark_engine
def test_a_set_is_answered_with_reads_by_document_and_cached_per_document(cache_dir, docs, tiny_model):
    first = ask(*docs, model=tiny_model)
    assert first.exit_code == 0, first.stderr
    assert "kvlocal:" not in first.stdout
    assert "document " + str(docs[0]) in first.stderr and "prefilled in" in first.stderr
    assert "set: 2 documents" in first.stderr and "consecutive positions" in first.stderr
    assert "reads by document:" in first.stderr and "a.txt" in first.stderr.split("reads by document:")[1]
    assert len(kvstate.list_entries()) == 2  # a state per document, none for the set
    again = ask(docs[1], docs[0], model=tiny_model)  # another order: both from the cache
    assert again.exit_code == 0 and "2 from the cache" in again.stderr and "prefilled in" not in again.stderr
    assert len(kvstate.list_entries()) == 2


@pytestmark_engine
def test_a_folder_with_an_unusable_file_answers_from_the_others_and_says_so(cache_dir, tmp_path, docs, tiny_model):
    folder = tmp_path / "folder"
    write(folder / "c.txt", B.replace("bolts", "nuts"))
    write(folder / "notes.xyz", "not a document kind")
    write(folder / "broken.txt", b"\x00\x01\x02binary\x00" * 40)
    result = ask(docs[0], folder, model=tiny_model)
    assert result.exit_code == EXIT_SKIPPED, result.stderr
    skipped = [line for line in result.stderr.splitlines() if line.startswith("kvlocal: skipped")]
    assert len(skipped) == 2 and any("notes.xyz" in line for line in skipped) and any("broken.txt" in line
                                                                                        for line in skipped)
    assert "set: 2 documents" in result.stderr and result.stdout.strip()
    assert f"exit status {EXIT_SKIPPED}" in result.stderr


@pytestmark_engine
def test_a_set_over_the_kv_limit_is_refused_in_one_line_with_nothing_lost(cache_dir, docs, tiny_model):
    assert ask(docs[0], model=tiny_model).exit_code == 0  # a state saved before
    before = {e.path.name for e in kvstate.list_entries()}
    result = ask(*docs, model=tiny_model, extra=["--max-kv", "64K"])
    assert result.exit_code == 1 and "over the limit of 64.0 KiB" in result.stderr, result.stderr
    assert [line for line in result.stderr.splitlines() if "error" in line] == [result.stderr.strip().splitlines()[-1]]
    assert {e.path.name for e in kvstate.list_entries()} == before
    assert ask(*docs, model=tiny_model, extra=["--max-kv", "1G"]).exit_code == 0


@pytestmark_engine
def test_a_model_whose_memory_cannot_be_composed_is_refused_with_nothing_lost(cache_dir, tmp_path, docs, tiny_model):
    from synth_gguf import write_tiny_olmo2_swa

    assert ask(docs[0], model=tiny_model).exit_code == 0
    before = {e.path.name for e in kvstate.list_entries()}
    result = ask(*docs, model=write_tiny_olmo2_swa(tmp_path / "swa.gguf"))
    assert result.exit_code == 1 and "sliding-window" in result.stderr, result.stderr
    assert {e.path.name for e in kvstate.list_entries()} == before
