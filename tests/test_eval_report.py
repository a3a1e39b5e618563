"""The eval report: which rows make the main table, and the budget sweep over top-k and centroid block."""

from __future__ import annotations

import math

import pytest

from kvlocal.evals import intervals, report


def _row(mode: str, score: float, *, top_k: int = 4, block: int | None = 16, depth: float = 0.5,
         bytes_read: int = 100, bytes_meta: int = 0) -> dict:
    row = {"length": 4096, "task": "passkey", "mode": mode, "top_k": top_k, "score": score, "depth": depth,
           "n_tokens": 4000, "sinks": 64, "window": 128, "bytes_dense": 1000, "bytes_read": bytes_read,
           "bytes_meta": bytes_meta, "decode_tps": 10.0, "prefill_tps": 50.0}
    if block is not None:
        row["centroid_block"] = block
    return row


def test_sweep_counts_centroid_block_as_part_of_the_budget():
    rows = [
        _row("full", 1.0, bytes_read=1000),
        _row("window", 0.0, bytes_read=50),
        _row("random", 0.0, bytes_read=50),
        _row("geometric", 1.0, block=None, bytes_read=80, bytes_meta=30),  # written before blocks were recorded
        _row("geometric", 1.0, block=64, bytes_read=58, bytes_meta=8),
        _row("geometric", 0.0, top_k=2, block=64, bytes_read=40, bytes_meta=8),
    ]
    summary = report.summarize(rows)
    assert summary["main_top_k"] == 4 and summary["main_centroid_block"] == 16
    geo = [c for c in summary["cells"] if c["mode"] == "geometric"]
    assert len(geo) == 1 and geo[0]["n"] == 1 and geo[0]["reduction"] == 1000 / 80  # the block-16 row only
    [sweep] = summary["sweep"]
    assert [(p["top_k"], p["centroid_block"]) for p in sweep["points"]] == [(4, 16), (2, 64), (4, 64)]
    assert sweep["scoring_at_match"] == "/b64 steps"  # rows before the question pass: token by token
    # the matching budget with the largest reduction: top-4 with one centroid per 64 tokens
    assert (sweep["smallest_matching_top_k"], sweep["centroid_block_at_match"]) == (4, 64)
    text = report.markdown(summary)
    assert "4/b64 steps: 100% [21–100] x17.2" in text and "| 4/b64 steps | 17.2x |" in text
    assert report.check_ordering(summary) == []


def test_main_cells_use_the_default_scoring_when_others_ran_too():
    from kvlocal.route_settings import DEFAULT_CENTROID_TYPE, DEFAULT_KEEP, DEFAULT_SHORTLIST

    default = dict(_row("geometric", 0.0, block=report.DEFAULT_CENTROID_BLOCK, bytes_read=80, bytes_meta=30),
                   shortlist=DEFAULT_SHORTLIST, keep=DEFAULT_KEEP,
                   centroid_type=DEFAULT_CENTROID_TYPE, pin=report.DEFAULT_PIN)
    rows = [
        _row("full", 1.0, bytes_read=1000),
        _row("window", 0.0, bytes_read=50),
        default,
        _row("geometric", 1.0, block=8, bytes_read=110, bytes_meta=60),
        _row("geometric", 1.0, block=16, bytes_read=110, bytes_meta=60),
    ]
    summary = report.summarize(rows)
    assert summary["main_centroid_block"] == report.DEFAULT_CENTROID_BLOCK
    [geo] = [c for c in summary["cells"] if c["mode"] == "geometric"]
    assert geo["accuracy"] == 0.0 and geo["reduction"] == 1000 / 80
    # without a row of the default scoring, the finest block run makes the main cells
    assert report.summarize([r for r in rows if r is not default])["main_centroid_block"] == 8


@pytest.mark.parametrize("successes, n", [(12, 24), (0, 10), (10, 10), (3, 11), (1, 1)])
def test_wilson_interval_is_the_score_interval(successes: int, n: int):
    lo, hi = intervals.wilson_interval(successes / n, n)
    # the Wilson interval's ends are the proportions p whose z-test accepts the observed one at 95 %
    for end in (lo, hi):
        if 0.0 < end < 1.0:
            assert math.isclose(abs(successes / n - end), 1.959964 * math.sqrt(end * (1 - end) / n), rel_tol=1e-6)
    assert 0.0 <= lo <= successes / n <= hi <= 1.0
    assert (lo == 0.0) == (successes == 0) and (hi == 1.0) == (successes == n)


def test_wilson_interval_known_values():
    assert intervals.wilson_interval(0.5, 24) == pytest.approx([0.3143, 0.6857], abs=1e-4)
    assert intervals.wilson_interval(0.0, 10) == pytest.approx([0.0, 0.2775], abs=1e-4)
    assert intervals.wilson_interval(0.75, 4) == pytest.approx([0.3006, 0.9544], abs=1e-4)


def test_fractional_scores_count_as_their_mean_over_n():
    half_found = report.summarize([_row("geometric", 0.5)] * 24)["cells"][0]  # e.g. 2 of 4 values each
    twelve_of_24 = report.summarize([_row("geometric", 1.0)] * 12 + [_row("geometric", 0.0)] * 12)["cells"][0]
    assert half_found["accuracy_ci"] == pytest.approx(twelve_of_24["accuracy_ci"])
    assert half_found["accuracy_ci"] == pytest.approx([0.3143, 0.6857], abs=1e-4)


def test_cells_count_rows_and_rows_outside_the_window():
    # 24 geometric rows, 15 right; the 18 at depth 0.5 lie outside the window, of which 9 right
    rows = ([_row("geometric", 1.0, depth=0.5)] * 9 + [_row("geometric", 0.0, depth=0.5)] * 9
            + [_row("geometric", 1.0, depth=1.0)] * 6)
    [cell] = report.summarize(rows)["cells"]
    assert (cell["n"], cell["accuracy"], cell["n_outside"], cell["accuracy_outside_window"]) == (24, 0.625, 18, 0.5)
    assert cell["accuracy_ci"] == intervals.wilson_interval(0.625, 24)
    assert cell["accuracy_outside_window_ci"] == intervals.wilson_interval(0.5, 18)
    text = report.markdown(report.summarize(rows))
    assert "| 4,096 | passkey | geometric | 62% [43–79] (n=24) | 50% [29–71] (n=18) | 10.0x |" in text
    [near] = report.summarize([_row("geometric", 1.0, depth=1.0)])["cells"]
    assert (near["n_outside"], near["accuracy_outside_window"], near["accuracy_outside_window_ci"]) == (0, None, None)
    assert "| 100% [21–100] (n=1) | – |" in report.markdown(report.summarize([_row("geometric", 1.0, depth=1.0)]))


def test_sweep_points_carry_their_interval_and_a_differing_n():
    rows = ([_row("full", 1.0, bytes_read=1000)] * 4 + [_row("geometric", 1.0, top_k=2)] * 3
            + [_row("geometric", 0.0, top_k=2)] + [_row("geometric", 1.0, top_k=8)] * 2)
    [sweep] = report.summarize(rows)["sweep"]
    assert sweep["full_n"] == 4 and sweep["full_accuracy_ci"] == intervals.wilson_interval(1.0, 4)
    assert [(p["top_k"], p["n"], p["accuracy_ci"]) for p in sweep["points"]] == [
        (2, 4, intervals.wilson_interval(0.75, 4)), (8, 2, intervals.wilson_interval(1.0, 2))]
    text = report.markdown(report.summarize(rows))
    # rows without shortlist and keep scanned every centroid, kept no memory and decoded the question
    # token by token: labelled so
    assert "| 100% [51–100] (n=4) | 2/b16 steps: 75% [30–95] x10.0, 8/b16 steps: 100% [34–100] n=2 x10.0 |" in text


def test_scoring_configurations_are_told_apart():
    """Two-level scoring and the selection memory are part of a budget point; the default scoring
    makes the main cells and carries no label."""
    from kvlocal.route_settings import (
        DEFAULT_CENTROID_BLOCK, DEFAULT_CENTROID_TYPE, DEFAULT_KEEP, DEFAULT_QUESTION,
        DEFAULT_QUESTION_TOP_K, DEFAULT_SHORTLIST,
    )

    default = {"centroid_block": DEFAULT_CENTROID_BLOCK, "shortlist": DEFAULT_SHORTLIST, "keep": DEFAULT_KEEP,
               "question": DEFAULT_QUESTION, "question_top_k": DEFAULT_QUESTION_TOP_K,
               "centroid_type": DEFAULT_CENTROID_TYPE, "pin": report.DEFAULT_PIN}
    other_type = "f16" if DEFAULT_CENTROID_TYPE == "q8_0" else "q8_0"
    rows = [
        _row("full", 1.0, bytes_read=1000),
        _row("window", 0.0, bytes_read=50),
        dict(_row("geometric", 1.0, bytes_read=60), **default),
        dict(_row("geometric", 0.0, bytes_read=80), centroid_block=16, shortlist=0, keep=0.0),
        dict(_row("geometric", 0.0, bytes_read=40), **dict(default, centroid_type=other_type)),
    ]
    summary = report.summarize(rows)
    [geo] = [c for c in summary["cells"] if c["mode"] == "geometric"]
    assert geo["accuracy"] == 1.0
    labels = sorted(report.scoring_label(p) for p in summary["sweep"][0]["points"])
    other_label = (f"/b{DEFAULT_CENTROID_BLOCK} s auto keep {DEFAULT_KEEP:g} dense" + (" q8_0" if other_type == "q8_0" else "")
                   + (f" pin {report.DEFAULT_PIN}" if report.DEFAULT_PIN else ""))
    assert labels == sorted(["", other_label, "/b16 steps"])
    table = report.points_markdown(summary)
    assert "| 4,096 | passkey | top-4, default scoring | 100% [21–100] (n=1) | 100% [21–100] (n=1) | 16.7x |" in table
    assert "| 4,096 | passkey | top-4, b16 steps | 0% [0–79] (n=1) |" in table


def _probe(mode: str, score: float, answer: str, *, seed: int = 0, depth: float = 0.5, expected: str = "amber-1111",
           pin: int = 0, steps: int = 5, q_read: int = 400, **extra) -> dict:
    """A row of a dense-question run: 1000 dense bytes, of which the question's one dense read is 400."""
    row = {"length": 8192, "task": "lookalike", "seed": seed, "probe": int(depth * 10), "depth": depth,
           "mode": mode, "top_k": 4, "region": 64, "score": score, "answer": answer, "expected": [expected],
           "n_tokens": 8000, "sinks": 64, "window": 128, "question": "dense", "question_top_k": 32,
           "bytes_dense": 1000, "bytes_read": 1000, "bytes_meta": 0, "steps": steps,
           "question_bytes_read": q_read, "question_bytes_dense": 400, "decode_tps": 10.0, "prefill_tps": None,
           "prefill": "dense"}
    if mode == "geometric":
        row.update(centroid_block=8, shortlist=-1, shortlist_used=16, keep=0.9, pin=pin, centroid_type="f16",
                   bytes_read=q_read + 100, bytes_meta=(q_read - 400) + 40)
    return dict(row, **extra)


def test_routes_put_answer_step_and_total_reductions_side_by_side():
    rows = [
        _probe("full", 1.0, "amber-1111", prefill_tps=50.0),
        _probe("full", 0.0, "amber-1111", depth=0.3, expected="amber-3333"),
        _probe("geometric", 1.0, "amber-1111"),
        _probe("geometric", 0.0, "amber-1111", depth=0.3, expected="amber-3333"),  # full's answer, another fact's code
        # with pins the question pass reads K once more (200 bytes here), counted as metadata
        _probe("geometric", 1.0, "amber-1111", pin=2, q_read=600),
        _probe("geometric", 0.0, "amber-3334", depth=0.3, expected="amber-3333", pin=2, q_read=600),  # a near-copy
        _probe("window", 0.0, "amber-2222", bytes_read=450),
    ]
    entries = {e["route"]: e for e in report.routes(rows)}
    assert list(entries) == ["full", "geometric top-4, b8 s16 keep 0.9", "geometric top-4, b8 s16 keep 0.9 pin 2",
                             "window top-4"]
    plain, pinned = entries["geometric top-4, b8 s16 keep 0.9"], entries["geometric top-4, b8 s16 keep 0.9 pin 2"]
    # answer steps: (1000 - 400) dense bytes over the 100 the 4 steps read; total: 1000 over 500 (or 700 with pins)
    assert plain["answer_reduction"] == pinned["answer_reduction"] == 6.0
    assert plain["total_reduction"] == 2.0 and pinned["total_reduction"] == pytest.approx(1000 / 700)
    # per answer step: 60 bytes of K/V rows and 40 of metadata over 4 steps, the pins' question read left out
    assert plain["step_mib"] == pytest.approx((15 / 2**20, 10 / 2**20))
    assert pinned["step_mib"] == pytest.approx(plain["step_mib"])
    assert (plain["n_outside"], plain["accuracy_outside_window"]) == (2, 0.5)
    assert plain["accuracy_outside_window_ci"] == intervals.wilson_interval(0.5, 2)
    assert (plain["same_as_full"], plain["n_paired"]) == (1.0, 2) and pinned["same_as_full"] == 0.5
    assert (plain["wrong_other_fact"], plain["wrong_else"]) == (1, 0)
    assert (pinned["wrong_other_fact"], pinned["wrong_else"]) == (0, 1)
    assert entries["full"]["prefill_tps"] == 50.0 and entries["full"]["n_prefilled"] == 1
    assert entries["window top-4"]["answer_reduction"] == 12.0
    text = report.routes_markdown(report.routes(rows))
    assert "| 8,192 | lookalike | geometric top-4, b8 s16 keep 0.9 pin 2 | 50% [9–91] (n=2) | 50% (2) | 6.0x | 1.4x |" in text
    assert "| 8,192 | lookalike | full | 50% [9–91] (n=2) | – | 1.0x | 1.0x |" in text


def test_routes_count_a_rerun_probe_once_and_tell_prefills_apart():
    first = _probe("geometric", 0.0, "amber-2222")
    rerun = _probe("geometric", 1.0, "amber-1111")
    routed = _probe("full", 1.0, "amber-1111", prefill="routed:top64:from4096:region64:ubatch512", prefill_tps=40.0)
    small = _probe("full", 1.0, "amber-1111", prefill="routed:top16:from4096:routed-ubatch128", prefill_tps=60.0)
    entries = {e["route"]: e for e in report.routes([first, rerun, _probe("full", 1.0, "amber-1111"), routed, small])}
    assert entries["geometric top-4, b8 s16 keep 0.9"]["n_outside"] == 1
    assert entries["geometric top-4, b8 s16 keep 0.9"]["accuracy_outside_window"] == 1.0
    assert entries["full, prefill top-64"]["same_as_full"] == 1.0  # paired with the dense prefill's full answer
    assert entries["full, prefill top-16/u128"]["prefill_tps"] == 60.0
    # two models' rows are two routes, each named with its model and paired with its own full rows
    other = [dict(r, model="small") for r in (_probe("full", 0.0, "amber-2222"), _probe("geometric", 0.0, "amber-2222"))]
    mixed = {e["route"]: e for e in report.routes([dict(r, model="big") for r in (_probe("full", 1.0, "amber-1111"), rerun)]
                                                   + other)}
    assert sorted(mixed) == ["big: full", "big: geometric top-4, b8 s16 keep 0.9", "small: full",
                             "small: geometric top-4, b8 s16 keep 0.9"]
    assert mixed["small: geometric top-4, b8 s16 keep 0.9"]["same_as_full"] == 1.0
    assert mixed["small: full"]["n_outside"] == 1
    # a probe in the window counts towards the reductions, not the accuracy
    [near] = report.routes([_probe("geometric", 1.0, "amber-1111", depth=1.0)])
    assert near["n_outside"] == 0 and near["accuracy_outside_window"] is None and near["answer_reduction"] == 6.0
    # another window or sinks is another route, not a rerun of the default one
    narrow = dict(_probe("geometric", 0.0, "amber-2222"), window=32)
    few = dict(_probe("geometric", 0.0, "amber-2222"), sinks=16)
    apart = {e["route"]: e for e in report.routes([rerun, narrow, few])}
    assert sorted(apart) == ["geometric top-4, b8 s16 keep 0.9", "geometric top-4, b8 s16 keep 0.9 sinks 16",
                             "geometric top-4, b8 s16 keep 0.9 window 32"]
    assert apart["geometric top-4, b8 s16 keep 0.9"]["accuracy_outside_window"] == 1.0
    # a question decoded token by token through the route: every step is an answer-like step
    [steps] = report.routes([_probe("geometric", 1.0, "amber-1111", question="steps", bytes_read=250)])
    assert steps["answer_reduction"] == steps["total_reduction"] == 4.0 and steps["step_mib"] is None


def test_routes_report_a_task_per_filler():
    """The same task, seed and probe planted in generated prose and in a user's document are two
    haystacks: reported apart, each paired with its own full answers."""
    mine = {"task": "onekey", "haystack": "/docs/GPL-3"}
    rows = [_probe("full", 1.0, "amber-1111", task="onekey"), _probe("geometric", 0.0, "amber-1112", task="onekey"),
            _probe("full", 0.0, "amber-1112", **mine), _probe("geometric", 0.0, "amber-1112", **mine)]
    entries = {(e["task"], e["route"]): e for e in report.routes(rows)}
    assert sorted(entries) == [("onekey", "full"), ("onekey", "geometric top-4, b8 s16 keep 0.9"),
                               ("onekey (GPL-3)", "full"), ("onekey (GPL-3)", "geometric top-4, b8 s16 keep 0.9")]
    assert entries[("onekey", "geometric top-4, b8 s16 keep 0.9")]["same_as_full"] == 0.0
    assert entries[("onekey (GPL-3)", "geometric top-4, b8 s16 keep 0.9")]["same_as_full"] == 1.0
    assert "| 8,192 | onekey (GPL-3) | full | 0% [0–79] (n=1) |" in report.routes_markdown(report.routes(rows))


def test_bench_markdown_has_decode_and_prefill_rows():
    run = {"model": "m", "lengths": [{"n_tokens": 30836, "full_tps": 4.0, "geometric_tps": 20.0, "speedup": 5.0,
                                      "bytes_reduction": 16.4}],
           "prefill": "routed (top-64 regions per ubatch from token 4,096)",
           "prefill_lengths": [{"n_tokens": 1034, "dense_s": 11.0, "routed_s": 11.0, "speedup": 1.0,
                                "bytes_reduction": 1.0},
                               {"n_tokens": 15099, "dense_s": 459.08, "routed_s": 335.63, "speedup": 1.3678,
                                "bytes_reduction": 1.72}],
           "ttft_fresh_s": 42.55, "ttft_cached_s": 2.34, "peak_rss_bytes": 2.5 * 2**30}
    text = report.bench_markdown([("bench-x", run)])
    assert "| bench-x | m | 30,836 | 4.00 | 20.00 | 5.00x | 16.4x | 42.5 s / 2.3 s | 2.5 GiB |" in text
    assert "| bench-x | routed (top-64 regions per ubatch from token 4,096) | 1,034 | 11.0 | 94.0 (1.00x) | 11.0 | 1.00x | 1.0x |" in text
    # 15,099 / 459.08 = 32.9 tok/s, 0.35x the 1,034-token prefill's 94.0
    assert "| bench-x | routed (top-64 regions per ubatch from token 4,096) | 15,099 | 459.1 | 32.9 (0.35x) | 335.6 | 1.37x | 1.7x |" in text


def test_main_routes_and_bench(tmp_path, capsys):
    import json

    results = tmp_path / "results.jsonl"
    results.write_text("\n".join(json.dumps(r) for r in [_probe("full", 1.0, "amber-1111"),
                                                         _probe("geometric", 1.0, "amber-1111")]) + "\n")
    report.main(["--routes", str(results)])
    assert "| 8,192 | lookalike | geometric top-4, b8 s16 keep 0.9 | 100% [21–100] (n=1) | 100% (1) |" in capsys.readouterr().out
    bench = tmp_path / "bench-a.json"
    bench.write_text(json.dumps({"model": "m", "lengths": [], "prefill_lengths": []}))
    report.main(["--bench", str(bench)])
    assert capsys.readouterr().out.startswith("| run | model |")
