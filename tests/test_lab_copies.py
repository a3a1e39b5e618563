"""`kvlocal lab copies`: the step an answer should copy, the regions its heads read for it, the summary."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvlocal.cli import app
from kvlocal.lab.copies import DocumentCells, Target, look_alike, markdown, step_record, summarize, target_of

VALUES = ["FITJT", "VGCAO", "ZJQUQ"]


def run(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("written, token, expected", [
    ("", "FIT", Target("FITJT", 0, True)),
    ("FIT", "JT", Target("FITJT", 3, True)),
    ("FITJT", " VG", Target("VGCAO", 0, True)),  # a new word: the values not written yet first
    ("FITJT VG", "ZQ", Target("VGCAO", 2, False)),  # mid-copy, a wrong character
    ("FITJT VGZQ", "ZQ", None),  # after a wrong character the word is no value's start
    ("FITJT", ", ", None),  # a separator
    ("", "for", None),  # text around the values
    ("FITJT VGCAO", " ZJQUQ.", Target("ZJQUQ", 0, True)),  # a token holding a whole value and more
])
def test_the_target_is_the_value_character_due(written, token, expected):
    assert target_of(written, token, VALUES) == expected


def test_look_alikes_keep_the_values_shape():
    assert look_alike("3684052").fullmatch("1234567") and not look_alike("3684052").fullmatch("12345678")
    assert look_alike("e256a6dc-8f54-46b7-87b5-b2bc5a8aaeca").fullmatch("6a18ce4c-7496-4764-92a4-def0c4b7a325")
    assert look_alike("FITJT").search("VAR QWERT = 1") and look_alike("used-postfix") is None


def _doc() -> DocumentCells:
    # one cell a character, regions of 8 cells: FITJT at 8-12 (region 1), VGCAO at 21-25 (regions 2 and 3),
    # a look-alike ABCDE at 40-44 (region 5); the rest is filler
    text = "filler. FITJT x" + " " * 6 + "VGCAO" + " " * 14 + "ABCDE" + " " * 11
    return DocumentCells(text, list(range(len(text))), region=8)


def test_a_step_records_who_read_the_target_and_what_the_others_read():
    doc = _doc()
    # 2 layers x 2 KV heads x 2 regions; the target: VGCAO's 4th character (cell 24, region 3)
    regions = np.array([[[3, 0], [1, -1]],  # layer 4: head 0 reads it; head 1 reads FITJT's region
                        [[2, 5], [3, 4]]])  # layer 9: head 0 reads VGCAO's first region and the look-alike
    step = step_record(doc, VALUES, Target("VGCAO", 3, True), "A", regions, np.array([4, 9]), n_kv=60, sinks=0,
                       window=0)
    assert step["read"] == 0.5 and step["read_by_layer"] == [0.5, 0.5] and step["layers"] == [4, 9]
    assert step["next_region"]  # the value began in region 2; its 4th character lies in region 3
    assert step["instead"] == {"other asked value": 1, "same value": 1, "look-alike": 1}
    assert step["dropped"] == 0.0  # no step before: nothing dropped
    before = np.array([[[3, 0], [3, -1]], [[1, 5], [3, 4]]])  # layer 4 head 1 read it the step before
    assert step_record(doc, VALUES, Target("VGCAO", 3, True), "A", regions, np.array([4, 9]), n_kv=60, sinks=0,
                       window=0, before=before)["dropped"] == 0.25
    in_window = step_record(doc, VALUES, Target("VGCAO", 3, True), "A", regions, np.array([4, 9]), n_kv=60,
                            sinks=0, window=40)
    assert in_window["read"] == 1.0  # the window holds it: every head reads it
    assert step_record(doc, VALUES, None, ", ", regions, np.array([4, 9]), 60, 0, 0) is None


def _step(right: bool, read: float, by_layer: list[float], next_region: bool = False, instead=None) -> dict:
    return {"right": right, "read": read, "read_by_layer": by_layer, "layers": [4, 9], "next_region": next_region,
            "instead": instead or {}}


def test_the_summary_compares_steps_copied_right_with_the_first_wrong_ones():
    rows = [{"task": "vt", "steps": [_step(True, 0.75, [1.0, 0.5]), _step(True, 0.75, [1.0, 0.5], True),
                                     _step(False, 0.25, [0.0, 0.5], True, {"filler": 3, "look-alike": 1}),
                                     _step(False, 0.0, [0.0, 0.0])]},  # after the first wrong: not counted
            {"task": "vt", "steps": [_step(True, 0.5, [0.5, 0.5])]}]
    (s,) = summarize(rows)
    assert (s["answers"], s["right_steps"], s["wrong_steps"]) == (2, 3, 1)
    assert s["read_right"] == pytest.approx(2 / 3) and s["read_wrong"] == 0.25
    assert (s["next_region_right"], s["next_region_wrong"]) == (1, 1)
    assert s["lost_layers"] == [4]  # 0.83 -> 0.0 in layer 4; layer 9 unchanged
    table = markdown([s])
    assert "| vt | 2 | 0.67 (0.00; n=3) | 0.25 (0.00; n=1) | 1/3 [6%–79%] / 1/1 [21%–100%] |" in table and "look-alike 25%, filler 75%" in table


@pytest.mark.engine
def test_lab_copies_writes_rows_and_resumes(cache_dir, tiny_model, tmp_path):
    out = tmp_path / "copies"
    args = ["lab", "copies", "--model", str(tiny_model), "--lengths", "2k", "--tasks", "niah_single_1",
            "--seeds", "0", "--out", str(out)]
    first = run(*args)
    assert first.exit_code == 0, first.stderr
    (row,) = [json.loads(line) for line in (out / "copies.jsonl").read_text().splitlines()]
    assert (row["length"], row["task"], row["seed"]) == (2048, "niah_single_1", 0)
    assert row["route"].startswith("geometric top-") and isinstance(row["steps"], list)
    assert "| niah_single_1 | 1 |" in first.stdout
    again = run(*args)
    assert again.exit_code == 0 and len((out / "copies.jsonl").read_text().splitlines()) == 1  # nothing asked


def test_lab_copies_refuses_an_unknown_task_before_loading(tmp_path):
    result = run("lab", "copies", "--model", str(tmp_path / "absent.gguf"), "--tasks", "passkey")
    assert result.exit_code == 2 and "RULER's tasks" in result.stderr


@pytest.mark.engine
@pytest.mark.model
def test_a_needle_copied_right_reads_its_region_at_every_step(tmp_path):
    out = tmp_path / "copies"
    result = run("lab", "copies", "--lengths", "2k", "--tasks", "niah_single_1", "--seeds", "0", "--out", str(out))
    assert result.exit_code == 0, result.stderr
    (row,) = [json.loads(line) for line in (out / "copies.jsonl").read_text().splitlines()]
    (value,) = row["expected"]
    assert value in row["answer"]
    # the dense question pass chooses the first token (a space or the first digit); each later
    # character of the number is a routed step's
    steps = [s for s in row["steps"] if s["value"] == value]
    offsets = [s["offset"] for s in steps]
    assert offsets and offsets[0] in (0, 1) and offsets == list(range(offsets[0], len(value)))
    assert all(s["right"] and s["read"] > 0 for s in steps)
