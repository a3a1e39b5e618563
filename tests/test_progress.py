"""stderr progress and summaries (engine-free): the status line, the prefill bar, the summaries."""

from __future__ import annotations

import dataclasses
import io

import numpy as np

from kvlocal.answer import AnswerSummary
from kvlocal.progress import StatusLine, answer_summary, download_text, load_summary, prefill_text
from kvlocal.routing import PrefillConfig, ReadStats, Route, RouteMode
from kvlocal.session import LoadResult, PrefillProgress, PrefillReads


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_line_rewrites_one_line_on_a_terminal():
    out = Terminal()
    line = StatusLine(out, min_interval=0.0)
    line.show("prefill 10%")
    line.show("x")
    line.done()
    # the shorter text pads over the longer one; done() blanks what is left and returns the cursor
    assert out.getvalue() == "\rprefill 10%" + "\rx" + " " * 10 + "\r \r"


def test_status_line_writes_plain_lines_elsewhere_and_rarely():
    out = io.StringIO()
    line = StatusLine(out)
    line.show("first")
    line.show("dropped: within the interval of a log")
    line.show("forced", force=True)
    line.done()
    assert out.getvalue() == "first\nforced\n"


def test_prefill_and_download_text():
    text = prefill_text(PrefillProgress(done=500, total=1000, elapsed=10.0), width=10)
    assert text == "prefill █████░░░░░ 500/1,000 tokens  50 tok/s  ETA 0:10"
    assert prefill_text(PrefillProgress(0, 1000, 0.0), width=4).endswith("0 tok/s  ETA --:--")
    assert download_text(512 * 1024, 1024 * 1024, "download") == "downloading model: 512.0 KiB / 1.0 MiB (50%)"
    assert download_text(0, 0, "verify") == "verifying model: 0 B / 0 B (100%)"


def test_load_summary_says_how_the_document_got_there():
    assert load_summary(LoadResult(1000, 2048, True, 0.5)) == (
        "document: 1,000 tokens, context 2,048; loaded saved KV state in 0.5 s (cache hit, no prefill)")
    assert load_summary(LoadResult(1000, 2048, False, 4.0, saved=True)) == (
        "document: 1,000 tokens, context 2,048; prefilled in 4.0 s (250 tok/s), state saved")
    routed = PrefillConfig(mode="routed", top_k=8, start=4096)
    reads = PrefillReads(steps=60, ubatches_routed=52, bytes_read=2 * 1024**3, bytes_dense=10 * 1024**3)
    assert load_summary(LoadResult(30000, 31000, False, 400.0, saved=True, prefill=routed, reads=reads)) == (
        "document: 30,000 tokens, context 31,000; prefilled routed (top-8 regions per ubatch from token 4,096) "
        "in 400.0 s (75 tok/s); 52 of 60 ubatches routed, attention read 2.0 GiB vs 10.0 GiB dense = 5.0x fewer "
        "bytes, state saved")
    assert load_summary(LoadResult(30000, 31000, True, 3.0, prefill=routed)).endswith(
        "(cache hit, no prefill); it was prefilled routed (top-8 regions per ubatch from token 4,096)")
    assert prefill_text(PrefillProgress(500, 1000, 10.0, "routed"), width=2).startswith("prefill (routed) █░ 500/1,000")


def test_answer_summary_adds_the_reads_of_every_step():
    route = Route(mode="geometric", top_k=2, region=64)
    s = AnswerSummary("hi", n_question_tokens=5, n_answer_tokens=4, decode_seconds=2.0, route=route)
    regions = np.array([[[0, 3, 9]], [[0, 3, 4]]], np.int32)  # [layer, head, n_sel]
    for _ in range(2):
        s.add(ReadStats(RouteMode.GEOMETRIC, 0, 2, 2, 1, 1024, 64, 3, 384, 2048, 98_304, 4096, 524_288,
                        np.array([0, 1], np.int32), regions))
    assert (s.steps, s.rows_read, s.bytes_read, s.bytes_meta) == (2, 768, 204_800, 8192)
    assert s.reduction == 1_048_576 / 204_800
    assert s.region_reads[(0, 9)] == 2 and s.region_reads[(1, 4)] == 2 and (0, 4) not in s.region_reads
    text = answer_summary(s)
    assert "answer: 4 tokens at 2.0 tok/s (question 5 tokens" in text
    assert "KV reads over 2 steps: 200.0 KiB (centroids 8.0 KiB) vs 1.0 MiB dense = 5.1x fewer bytes" in text
    assert "note:" not in text
    # the first step was the question's dense batch: the answer's steps alone read the rest
    s.question_bytes_read, s.question_bytes_dense = 102_400, 524_288
    assert s.answer_reduction == 524_288 / 102_400
    assert ("of which the question read in one dense pass: 100.0 KiB; the answer's 4 steps: 100.0 KiB "
            "= 5.1x fewer bytes than dense steps") in answer_summary(s)
    assert "of which" not in answer_summary(dataclasses.replace(s, route=Route(question="steps")))
    s.context_full = True
    assert "context is full" in answer_summary(s)
