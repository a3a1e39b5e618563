"""RULER in `kvlocal eval ruler`: its generators, its metric, the rows and the resume.

The generators and the metric are nvidia-long-context-eval's (installed by `make setup`); the
tokenizer is the model's, through the session.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvlocal.cli import app
from kvlocal.evals import ruler
from kvlocal.prompt import PromptParts, Segment


def run(*args: str):
    return CliRunner().invoke(app, list(args))


# ---- the metric: RULER's own, on hand-written answers ----------------------------------------------


@pytest.mark.parametrize("task, answer, outputs, expected", [
    ("niah_single_2", " 1234567.", ["1234567"], 1.0),
    ("niah_single_2", "The number is 1234568", ["1234567"], 0.0),
    ("niah_multivalue", "1111111, 2222222 and 9999999", ["1111111", "2222222", "3333333", "4444444"], 0.5),
    ("niah_multikey_3", "E256A6DC-8F54", ["e256a6dc-8f54"], 1.0),  # case does not matter
    ("vt", "FITJT VGCAO ZJQUQ", ["FITJT", "VGCAO", "ZJQUQ", "TYFAD", "DROFS"], 0.6),
    ("cwe", "", ["cracker"], 0.0),
    ("qa_1", "It is in France.", ["Paris", "France"], 1.0),  # any reference (string_match_part)
    ("qa_2", "no", ["yes"], 0.0),
])
def test_score_is_rulers_metric(task, answer, outputs, expected):
    assert ruler.score(task, answer, outputs) == pytest.approx(expected)


def test_postprocess_is_rulers():
    assert ruler.postprocess("  a\x00b\tc \x1f") == "a\nb\nc"
    assert ruler.postprocess(None) == ""


def test_zeta_matches_its_closed_form():
    import math

    assert ruler._zeta(2.0) == pytest.approx(math.pi ** 2 / 6, rel=1e-12)
    assert ruler._zeta(4.0) == pytest.approx(math.pi ** 4 / 90, rel=1e-12)


def test_every_task_has_rulers_settings():
    configs = ruler.task_configs()
    assert tuple(configs) == ruler.TASK_NAMES
    assert configs["niah_multikey_1"]["args"]["num_needle_k"] == 4
    assert configs["vt"]["tokens_to_generate"] == 30
    assert configs["vt"]["answer_prefix"].startswith(" Answer: According to the chain(s) of variable assignment")


def test_the_answer_prefix_opens_the_models_turn():
    parts = PromptParts("<head>", "doc", "<middle>", "<suffix>", "hash", answer_prefix="Answer: it is")
    assert parts.question_segments(" q? ") == [Segment("q?", False), Segment("<suffix>", True),
                                              Segment("Answer: it is", False)]
    assert PromptParts("h", "d", "m", "s", "x").question_segments("q") == [Segment("q", False), Segment("s", True)]


# ---- generation: RULER's generators with the model's tokenizer --------------------------------------


@pytest.fixture(scope="module")
def count_tokens(tiny_model):
    from kvlocal.session import Session

    session = Session(str(tiny_model), threads=1)
    return lambda text: len(session.tokenize(text, bos=False))


@pytest.mark.engine
@pytest.mark.parametrize("task", ["niah_single_1", "fwe"])
def test_generation_is_seeded_and_fills_the_budget(count_tokens, task):
    first = ruler.generate(task, 2048, 2, count_tokens, budget=1900)
    assert first == ruler.generate(task, 2048, 2, count_tokens, budget=1900)
    if task == "fwe":  # another seed, other samples (niah's word list takes seconds to build: once is enough)
        assert first != ruler.generate(task, 2048, 2, count_tokens, budget=1900, seed=7)
    assert [s.index for s in first] == [0, 1] and first[0] != first[1]
    for sample in first:
        tokens = count_tokens(sample.text) + sample.max_tokens
        assert 0.8 * 1900 <= tokens <= 1900, tokens
        assert sample.question.lstrip().startswith(("What", "Question:"))
        assert sample.answer_prefix.startswith(" ")
        if task.startswith("niah"):  # the asked needle's value is in the document
            assert all(value in sample.document for value in sample.outputs)


@pytest.mark.engine
def test_a_sample_that_cannot_fit_stops_with_an_error(count_tokens):
    # the tiny model's tokenizer spends several tokens a word: ten SQuAD paragraphs exceed 1,900
    from kvlocal.errors import UsageError

    with pytest.raises(UsageError, match="cannot fit a sample"):
        ruler.generate("qa_1", 2048, 1, count_tokens, budget=1900)


# ---- the eval: rows, resume, the table --------------------------------------------------------------


def _rows(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


@pytest.mark.engine
def test_ruler_eval_writes_rows_and_resumes(cache_dir, tiny_model, tmp_path):
    out = tmp_path / "ruler"
    args = ["eval", "ruler", "--model", str(tiny_model), "--lengths", "2k", "--tasks", "fwe,niah_single_1",
            "--modes", "full,window", "--max-tokens", "2", "--out", str(out)]
    first = run(*args, "--seeds", "0")
    assert first.exit_code == 0, first.stderr
    rows = _rows(out)
    assert sorted((r["task"], r["probe"], r["mode"]) for r in rows) == [
        ("fwe", 0, "full"), ("fwe", 0, "window"), ("niah_single_1", 0, "full"), ("niah_single_1", 0, "window")]
    assert all(r["suite"] == "ruler" and r["length"] == 2048 and 0 <= r["score"] <= 1 for r in rows)
    prefixes = {r["task"]: r["answer_prefix"] for r in rows}
    assert prefixes["fwe"] == " Answer: According to the coded text above, the three most frequently appeared words are:"
    assert prefixes["niah_single_1"].startswith(" The special magic number for ")
    assert all(r["n_tokens"] < r["ruler_tokens"] + 100 and r["ruler_tokens"] <= 2048 for r in rows)  # sized to 2k
    assert "| fwe |" in first.stdout and "| **average** |" in first.stdout and "(n=2)" in first.stdout
    assert run(*args, "--seeds", "0").exit_code == 0  # nothing left to ask
    assert len(_rows(out)) == 4
    again = run(*args, "--seeds", "0,1")  # sample 1 only
    assert again.exit_code == 0, again.stderr
    assert sorted((r["task"], r["probe"]) for r in _rows(out)[4:]) == [("fwe", 1)] * 2 + [("niah_single_1", 1)] * 2
    assert "(n=4)" in again.stdout


@pytest.mark.engine
def test_ruler_eval_asks_more_routes_on_the_same_prefill(cache_dir, tiny_model, tmp_path):
    out = tmp_path / "ruler"
    result = run("eval", "ruler", "--model", str(tiny_model), "--lengths", "2k", "--tasks", "niah_single_1",
                 "--modes", "full", "--max-tokens", "2", "--also", "keep=0;top-k=2,pin=0;keep=0,pin=0", "--out", str(out))
    assert result.exit_code == 0, result.stderr
    rows = _rows(out)
    assert [(r["mode"], r.get("keep"), r.get("top_k"), r.get("pin")) for r in rows][1:] == [
        ("geometric", 0.0, rows[1]["top_k"], rows[1]["pin"]), ("geometric", 0.9, 2, 0)]
    assert result.stderr.count("tokens prefilled") == 1  # one prefill for the three routes
    # keep=0,pin=0 is keep=0's route (no memory: nothing pinned): asked once
    assert "keep 0 " in result.stdout and "geometric top-2" in result.stdout


def test_ruler_eval_refuses_bad_settings_before_loading(tmp_path):
    for args, says in [(["--tasks", "passkey2"], "RULER's tasks"), (["--modes", "full,dense"], "--modes"),
                       (["--seeds", ""], "--seeds"), (["--also", "kep=0"], "--also"),
                       (["--also", "keep=zero"], "not a float"), (["--also", "top-k=-1"], "--also")]:
        result = run("eval", "ruler", "--model", str(tmp_path / "absent.gguf"), "--out", str(tmp_path / "o"), *args)
        assert result.exit_code == 2, (args, result.output)
        assert says in result.stderr and "Traceback" not in result.stderr


# ---- the real model ---------------------------------------------------------------------------------


@pytest.mark.engine
@pytest.mark.model
def test_the_default_model_finds_a_ruler_needle(tmp_path):
    out = tmp_path / "ruler"
    result = run("eval", "ruler", "--lengths", "2k", "--tasks", "niah_single_1", "--modes", "full,geometric",
                 "--out", str(out))
    assert result.exit_code == 0, result.stderr
    rows = {r["mode"]: r for r in _rows(out)}
    assert rows["full"]["score"] == 1.0, rows["full"]["answer"]
    assert rows["full"]["expected"][0] in rows["full"]["answer"]
    assert rows["geometric"]["reduction"] > 1.0
