"""The commands BENCHMARKS.md prints its tables with, on tiny hand-made files: `report --routes --select`
(kvlocal.evals.report), `library_report --bench` and the lab's tables (kvlocal.lab.report)."""

from __future__ import annotations

import json
import re

import pytest

from kvlocal.evals import library_report, report
from kvlocal.evals.tasks import Probe
from kvlocal.lab import report as lab_report
from kvlocal.route_settings import UNCALIBRATED_ROUTE, ModelRoute

CALIBRATED = ModelRoute(top_k=3, layer_top_k="19-23=8", centroid_type="q8_0", shortlist_floor=48)


def _row(mode: str, *, top_k: int = 4, score: float = 1.0, answer: str = "amber-1111", probe: int = 5,
         **extra) -> dict:
    """A row of an 8k run (110 regions: the automatic shortlist takes 16, or the floor)."""
    row = {"length": 8192, "task": "onekey", "seed": 0, "probe": probe, "depth": 0.5, "mode": mode, "top_k": top_k,
           "region": 64, "sinks": 64, "window": 128, "score": score, "answer": answer, "expected": ["amber-1111"],
           "n_tokens": 7000, "question": "dense", "question_top_k": 32, "prefill": "dense", "hints": 0,
           "bytes_dense": 1000, "bytes_read": 500, "bytes_meta": 0, "steps": 5, "question_bytes_read": 400,
           "question_bytes_dense": 400, "decode_tps": 10.0, "model": "qwen2.5-coder-1.5b"}
    if mode != "full":
        row.update(centroid_block=8, shortlist=-1, shortlist_used=16, keep=0.9, pin=2 if mode == "geometric" else 0,
                   centroid_type="f16", layer_top_k="")
    return dict(row, **extra)


def test_on_route_takes_full_the_route_at_its_defaults_and_its_controls():
    uniform = _row("geometric")
    assert report.on_route(_row("full", estimate=True, hints=1), UNCALIBRATED_ROUTE)  # full reads every cell
    assert report.on_route(uniform, UNCALIBRATED_ROUTE)
    assert report.on_route(dict(uniform, shortlist=16), UNCALIBRATED_ROUTE)  # the automatic value, given
    assert report.on_route(_row("window"), UNCALIBRATED_ROUTE) and report.on_route(_row("random"), UNCALIBRATED_ROUTE)
    for change in ({"pin": 0}, {"keep": 0.0}, {"centroid_block": 4}, {"shortlist": 64, "shortlist_used": 64},
                   {"centroid_type": "q8_0"}, {"hints": 1}, {"estimate": True}, {"question": "steps"},
                   {"prefill": "routed:top64"}, {"window": 32}, {"top_k": 2}, {"layer_top_k": "16-23=8"}):
        assert not report.on_route(dict(uniform, **change), UNCALIBRATED_ROUTE), change
    assert not report.on_route(_row("full", question="steps"), UNCALIBRATED_ROUTE)
    # a calibrated route: its budget per layer, centroid type and the shortlist's floor
    calibrated = _row("geometric", top_k=3, layer_top_k="19-23=8", centroid_type="q8_0", shortlist=48)
    assert report.on_route(calibrated, CALIBRATED) and not report.on_route(calibrated, UNCALIBRATED_ROUTE)
    assert not report.on_route(dict(calibrated, shortlist=64), CALIBRATED)  # at 8k the floor is the default
    assert report.on_route(dict(calibrated, n_tokens=31000, shortlist=-1, shortlist_used=64), CALIBRATED)
    assert report.on_route(_row("window", top_k=3, layer_top_k="19-23=8", centroid_type="q8_0"), CALIBRATED)


def test_select_keeps_each_model_s_default_or_the_uniform_route():
    mine = _row("geometric", top_k=3, layer_top_k="19-23=8", centroid_type="q8_0", shortlist=48)
    rows = [_row("full"), _row("geometric"), mine, _row("geometric", model="qwen2.5-coder-0.5b")]
    assert report.select(rows, "default") == [rows[0], mine, rows[3]]  # the 0.5B has no calibrated route
    assert report.select(rows, "uniform") == [rows[0], rows[1], rows[3]]
    with pytest.raises(ValueError):
        report.select(rows, "best")


def test_main_routes_select_prints_only_the_selected_routes(tmp_path, capsys):
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in [_row("full"), _row("geometric"), _row("geometric", pin=0)]))
    report.main(["--routes", "--select", "uniform", str(results)])
    out = capsys.readouterr().out
    assert "| geometric top-4, b8 s16 keep 0.9 pin 2 |" in out and "keep 0.9 |" not in out
    report.main(["--routes", str(results)])
    assert "| geometric top-4, b8 s16 keep 0.9 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        report.main(["--routes", "--select", "best", str(results)])


def test_library_bench_table_names_the_route_geometric_took(tmp_path, capsys):
    run = {"model": "m", "route": "geometric: top-4 regions of 64 tokens + 64 sink + 128 window tokens",
           "peak_rss_bytes": 8.5 * 2**30,
           "library": [{"n_documents": 16, "length": 8192, "n_cells": 113667, "layout": "parallel", "ready_s": 28.1,
                        "kv_bytes": 3.0 * 2**30, "full_tps": 0.44, "geometric_tps": 23.44, "speedup": 52.69,
                        "bytes_reduction": 445.0,
                        "geometric_route": "geometric: top-1 regions of 64 tokens, 1 hinted by the question's rarest words"},
                       {"n_documents": 4, "length": 8192, "n_cells": 28291, "layout": "consecutive", "ready_s": 7.41,
                        "kv_bytes": 773.9 * 2**20, "full_tps": 2.91, "geometric_tps": 14.67, "speedup": 5.05,
                        "bytes_reduction": 12.69}]}
    path = tmp_path / "bench-4-16.json"
    path.write_text(json.dumps(run))
    library_report.main(["--bench", str(path)])
    out = capsys.readouterr().out
    assert ("| bench-4-16 | 16 x 8k | 113,667 | parallel | 3.0 GiB | 28.1 s | top-1, 1 hint | 0.44 | 23.44 | 52.69x "
            "| 445.0x | 8.5 GiB |") in out
    assert "| bench-4-16 | 4 x 8k | 28,291 | consecutive | 773.9 MiB | 7.4 s | top-4 |" in out


def _lab_rule(rule: str, reduction: float) -> dict:
    return {"rule": rule, "top_k": 4, "scan_share_of_k": 1 / 30, "recall_far": 0.2, "recall_far_p10": 0.05,
            "fact_hit": 0.8, "answer_hit": 0.9, "answer_hit_all": 0.6, "out_err": 0.4, "out_err_est": 0.3,
            "out_err_var": 0.4, "fact_rank_median": 1.0, "reduction": reduction}


def _prefill_rule(rule: str, estimates: dict) -> dict:
    return {"rule": rule, "chunk": 512, "top_k": 16, "err_fact": 0.2, "err_fact_p90": 0.5, "err_rest": 0.1,
            "recall_fact": 0.75, "recall_rest": 0.8, "read_share": 0.15, "err_est": estimates}


def test_lab_tables_name_each_file_s_folder(tmp_path, capsys):
    for name, rules in (("lab-8k", ["two64/8x16+qm2", "oracle"]), ("lab-32k", ["two64/8x64+qm2"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "lab.json").write_text(json.dumps([_lab_rule(r, 13.2) for r in rules]))
    lab_report.main(["decode", str(tmp_path / "lab-8k" / "lab.json"), str(tmp_path / "lab-32k" / "lab.json")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| lab | rule | k |") and len(lines) == 5
    assert lines[4].startswith("| lab-32k | two64/8x64+qm2 | 4 | 1/30 |") and lines[4].endswith("| 13.2x |")
    # prefill runs with other estimate columns: a table each
    for name, est in (("p16", {"region": 0.18}), ("p32", {})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "lab-prefill.json").write_text(json.dumps([_prefill_rule("engine", est)]))
    text = lab_report.prefill_table([tmp_path / "p16" / "lab-prefill.json", tmp_path / "p32" / "lab-prefill.json"])
    tables = text.split("\n\n")
    assert len(tables) == 2 and "+ estimate region" in tables[0] and "+ estimate" not in tables[1]
    assert "| p32 | engine | 512 | 16 | 0.200 / 0.500 | 0.100 | 0.750 | 0.800 | 0.150 |" in tables[1]


def test_hints_table_pooled_keeps_the_rows_over_all_seeds(tmp_path):
    rows = [{"seed": s, "scope": "sentence", "probe": p, "n_documents": 16, "length": 8192, "haystack": "",
             "questions": "template", "hint_regions": 1, "in_document": True, "code_read": p > 0,
             "code_in_first_region": False} for s in (0, 1) for p in range(2)]
    path = tmp_path / "hints.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pooled = lab_report.hints_table([path], pooled=True).splitlines()
    assert len(pooled) == 3 and "| 16 x 8k | generated | template | sentence | all | 4 | 100% " in pooled[2]
    assert "| 50% [" in pooled[2]
    assert len(lab_report.hints_table([path]).splitlines()) == 5  # seeds 0, 1 and all


def _probe_row(case: str, probe: int, rule: str, hits: list[float]) -> dict:
    return {"answer_hits": hits, "first_drop": None if min(hits) == 1 else 1, "missed_pairs": {"20.9": 1},
            "fact_rank_median": 1.0, "case": case, "probe": probe, "depth": 0.5, "dense_right": True,
            "rule": rule, "top_k": 4}


def test_answers_put_the_lab_s_probes_beside_full_and_the_uniform_route(tmp_path, capsys):
    folder = tmp_path / "lab-onekey-8k"
    folder.mkdir()
    probes = folder / "probes.jsonl"
    case = "onekey-8192-s1-d10"
    probes.write_text("".join(json.dumps(r) + "\n" for r in [
        _probe_row(case, 3, "two64/8x16+qm2", [1.0, 0.5]), _probe_row(case, 4, "two64/8x16+qm2", [1.0, 1.0]),
        _probe_row(case, 3, "oracle", [1.0, 1.0])]))
    results = tmp_path / "results.jsonl"
    rows = [_row("full", seed=1, probe=3), _row("geometric", seed=1, probe=3, score=0.0, answer="amber-1112"),
            _row("full", seed=1, probe=4), _row("geometric", seed=1, probe=4),
            _row("geometric", seed=1, probe=3, pin=0),  # another route: not the one the lab replays
            _row("full", seed=1, probe=3, haystack="/x/GPL-3", score=0.0)]  # another filler
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lab_report.main(["answers", "--results", str(results), "--summary", str(probes)])
    out = capsys.readouterr().out
    assert "| lab-onekey-8k | two64/8x16+qm2 | 4 | 0.88 (2) | 0.75 (1) |" in out
    assert "| lab-onekey-8k | oracle | 4 | 1.00 (1) | 1.00 (1) |" in out
    by_fact = lab_report.answers_table([probes], results)
    assert "amber-1111 / amber-1112 ✗" in by_fact and by_fact.count("\n") == 3  # two probes under a header


def test_hint_read_lines_name_the_regions_read_and_the_sentence_start():
    filler = [f" w{i}".encode() for i in range(64 * 6)]
    sentence = [f" {w}".encode() for w in "The night-shift locker at the Oslo depot opens with the access code".split()]
    code = [b" amber", b"-12", b"34", b"."]
    at = 64 * 3 - 5  # the sentence starts in region 2 and its code lies in region 3
    pieces = filler[:at] + sentence + code + filler[at:]
    probe = Probe("onekey", "Which access code opens the night-shift locker at the Oslo depot?", ("amber-1234",), 0.5)
    [line] = lab_report.hint_read_lines(pieces, [probe], "The night-sh", 0, region=64, skip_regions=1)
    read = json.loads(re.search(r"read (\[[^]]*\])", line).group(1))
    assert line.startswith("0 0 0.5 amber-1234 read ") and " code (3, 3) start 2" in line
    assert 2 in read and 3 in read and not line.endswith("START-MISSED")
