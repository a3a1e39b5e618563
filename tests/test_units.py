"""Size and duration formatting (engine-free), and the layering rule that keeps it a leaf."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvlocal.units import human_bytes, human_seconds

ROOT = Path(__file__).resolve().parents[1]


def test_human_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1,023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 1024**3) == "3.0 GiB"
    assert human_bytes(5000 * 1024**3) == "5,000.0 GiB"


def test_human_seconds():
    assert human_seconds(0) == "0:00"
    assert human_seconds(61.4) == "1:01"
    assert human_seconds(3725) == "1:02:05"
    assert human_seconds(float("inf")) == "--:--"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_tui_imports_nothing_from_the_cli_layer():
    for path in sorted((ROOT / "tui").glob("*.py")):
        bad = {m for m in _imports(path) if m in ("kvlocal.cli", "kvlocal.progress") or m.startswith("typer")}
        assert not bad, f"{path.name} imports {bad}"


def test_units_is_a_leaf():
    assert not {m for m in _imports(ROOT / "kvlocal" / "units.py") if m.startswith("kvlocal")}


def test_question_pass_settings_are_validated_and_described():
    from kvlocal import routing
    from kvlocal.errors import UsageError
    from kvlocal.route_settings import DEFAULT_QUESTION, QUESTION_PASSES

    assert DEFAULT_QUESTION in QUESTION_PASSES
    with pytest.raises(UsageError, match="question pass") as info:
        routing.RouteConfig(question="sideways")
    assert info.value.setting == "question_pass"
    with pytest.raises(UsageError, match="regions a routed question reads") as info:
        routing.RouteConfig(question_top_k=-1)
    assert info.value.setting == "question_top_k"
    assert routing.Route(question="routed", question_top_k=7).question_batch_top_k == 7
    assert routing.Route(question="dense", question_top_k=7).question_batch_top_k == 0
    assert "one dense pass" in routing.Route(question="dense").describe()
    assert "top-7 regions" in routing.Route(question="routed", question_top_k=7).describe()
    assert "token by token" in routing.Route(question="steps").describe()


def test_eval_rows_before_the_question_pass_read_it_step_by_step():
    from kvlocal.evals.report import question_pass, scoring_label
    from kvlocal.evals.runner import row_key

    old = {"length": 8192, "task": "lookalike", "seed": 0, "probe": 1, "mode": "geometric", "top_k": 4,
           "region": 64, "window": 128, "sinks": 64}
    assert question_pass(old) == "steps"
    assert row_key(old) == row_key(dict(old, question="steps", question_top_k=32))  # top-k unused by steps
    assert row_key(old) != row_key(dict(old, question="dense"))
    assert row_key(dict(old, question="routed", question_top_k=16)) != row_key(dict(old, question="routed",
                                                                                     question_top_k=32))
    assert question_pass(dict(old, question="routed", question_top_k=16)) == "q16"
    assert scoring_label({"centroid_block": 4, "shortlist": 32, "keep": 0.9,
                          "question": "steps"}).endswith(" steps")


def test_eval_rows_of_the_retired_estimate_still_load_as_other_cells(tmp_path):
    """A results.jsonl from before the estimate was removed still loads, and a row that ran it is not
    taken for the same cell run without it (a rerun does not skip that cell)."""
    import json

    from kvlocal.evals.runner import load_rows, row_key

    row = {"length": 8192, "task": "lookalike", "seed": 0, "probe": 1, "mode": "geometric", "top_k": 4,
           "region": 64, "window": 128, "sinks": 64}
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (row, dict(row, estimate=True))))
    old, est = load_rows(path)
    assert row_key(old) == row_key(dict(old, estimate=False)) != row_key(est)


def test_every_route_field_a_row_records_is_in_its_key_or_left_out_on_purpose():
    """A route setting added to RouteConfig reaches the rows (route_fields): a rerun must not take a row
    run with another value for the same cell, so the key holds it, or says why not (NOT_IN_ROUTE_KEY)."""
    from kvlocal.evals.runner import NOT_IN_ROUTE_KEY, ROUTE_KEY, route_fields
    from kvlocal.routing import RouteConfig

    keyed = {name for name, _ in ROUTE_KEY}
    assert set(route_fields(RouteConfig())) <= keyed | set(NOT_IN_ROUTE_KEY)
    assert not keyed & set(NOT_IN_ROUTE_KEY)


def test_the_grid_and_the_library_key_a_route_the_same_way():
    from kvlocal.evals.library_runner import answer_key
    from kvlocal.evals.runner import route_key, row_key

    route = {"mode": "geometric", "top_k": 3, "region": 64, "window": 128, "sinks": 64, "pin": 2, "keep": 0.9,
             "shortlist": -1, "question": "dense", "question_top_k": 32, "centroid_block": 8, "hints": 0}
    grid = {"length": 8192, "task": "onekey", "seed": 0, "probe": 1, "haystack": "", **route}
    library = {"n_documents": 4, "length": 8192, "seed": 0, "probe": 1, "reference": "set", "haystack": "",
               "max_tokens": 24, "facts_per_doc": 2, **route}
    assert row_key(grid)[-len(route_key(grid)):] == answer_key(library)[-len(route_key(library)):] == route_key(grid)
    for changed in ({"top_k": 4}, {"layer_top_k": "19-23=8"}, {"centroid_type": "q8_0"}, {"hints": 1}):
        assert row_key(dict(grid, **changed)) != row_key(grid)
        assert answer_key(dict(library, **changed)) != answer_key(library)
    full = dict(grid, mode="full")  # full attention reads every cell: its route settings are no part of its key
    assert row_key(dict(full, top_k=9, centroid_type="q8_0")) == row_key(full)
    # the question pass is: a routed one's budget matters, a dense one's does not
    assert row_key(dict(grid, question="routed", question_top_k=8)) != row_key(dict(grid, question="routed"))
    assert row_key(dict(grid, question_top_k=8)) == row_key(grid)
