"""The answer object (engine-free): iterate for pieces, read the totals afterwards."""

from __future__ import annotations

import numpy as np
import pytest

from kvlocal.answer import Answer, AnswerPiece, AnswerSummary, ReadTotals
from kvlocal.routing import ReadStats, Route, RouteMode

ROUTE = Route(mode="geometric", top_k=2, region=64)


def stats(fallback: int = 0, bytes_kv: int = 1000) -> ReadStats:
    return ReadStats(RouteMode.GEOMETRIC, fallback, 1, 1, 1, 256, 64, 2, 128, 256, bytes_kv, 24, 4000,
                     np.array([0], np.int32), np.array([[[0, 3]]], np.int32))


def decode(words, finished: list):
    summary = AnswerSummary("", 3, 0, 0.0, ROUTE)
    for i, word in enumerate(words):
        st = stats()
        summary.add(st)
        summary.n_answer_tokens += 1
        yield AnswerPiece(word, i, st)
    summary.text = "".join(words)
    finished.append(True)
    return summary


def test_iterating_yields_pieces_and_the_summary_follows():
    finished: list = []
    answer = Answer(decode(["a", "b", "c"], finished))
    assert [p.text for p in answer] == ["a", "b", "c"]
    summary = answer.summary()
    assert (summary.text, summary.n_answer_tokens, summary.steps) == ("abc", 3, 3)
    assert (summary.bytes_read, summary.bytes_dense) == (3 * 1024, 3 * 4000)
    assert list(answer) == []  # exhausted: no piece twice
    assert answer.summary() is summary


def test_summary_and_text_decode_what_is_left():
    finished: list = []
    answer = Answer(decode(["x", "y"], finished))
    assert next(answer).text == "x"
    assert answer.text() == "xy" and finished == [True]


def test_a_closed_answer_has_no_summary():
    finished: list = []
    answer = Answer(decode(["x", "y", "z"], finished))
    next(answer)
    answer.close()
    assert finished == [] and list(answer) == []
    with pytest.raises(RuntimeError, match="abandoned"):
        answer.summary()


def test_read_totals_report_only_fallbacks_nobody_chose():
    totals = ReadTotals()
    totals.add(stats(fallback=6))  # the question's dense batch: chosen
    totals.add(stats(fallback=1))  # full mode: chosen
    assert totals.fallback == "" and totals.steps == 2
    totals.add(stats(fallback=2))
    assert totals.fallback and totals.reduction == 3 * 4000 / (3 * 1024)


def test_a_summary_also_counts_the_regions_each_layer_read():
    summary = AnswerSummary("", 3, 0, 0.0, ROUTE)
    for _ in range(3):
        summary.add(stats())
    assert summary.steps == 3 and summary.region_reads == {(0, 0): 3, (0, 3): 3}
