"""The Textual app: pilot tests and snapshots.

Most tests drive the app with `FakeSession`, a stand-in with the Session API (words are tokens, reads
are deterministic), so they need no engine and their snapshots are stable. The `engine` tests run the
real Session on the tiny synthetic model (its answers are gibberish: they check structure only).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from textual.widgets import Input, Static

from kvlocal.answer import Answer, AnswerPiece, AnswerSummary
from kvlocal.errors import CancelledError, ModelError, UsageError
from kvlocal.route_settings import DEFAULT_TOP_K as K, UNCALIBRATED_ROUTE
from kvlocal.routing import PrefillConfig, ReadStats, Route, RouteMode
from kvlocal.session import LoadResult, PrefillProgress, Session
from kvlocal.tui.answer_log import Notice
from kvlocal.tui.app import KvlocalApp
from kvlocal.tui.heatmap import KvHeatmap, bucket_ends, bucket_starts
from kvlocal.tui.live import LiveAnswer, ReadMap
from kvlocal.tui.region_view import RegionView
from kvlocal.tui.sources import SourcesList, rank_sources

DOC = "\n".join(f"Line {i}: the gauge at post {i} read {i * 13 % 97} units." for i in range(40))
QUESTION = "What did post 7 read?"
LONG_DOC = "\n".join(f"Line {i}: the gauge at post {i} read {i * 13 % 97} units." for i in range(200))


# -- a Session stand-in ----------------------------------------------------------------------------


class FakeSession:
    """The Session API the app uses, without the engine: whitespace-separated words are the tokens."""

    def __init__(self, n_layer: int = 4, n_head_kv: int = 2, prefill_delay: float = 0.0, answer: str | None = None):
        self.n_layer = n_layer
        self.n_head_kv = n_head_kv
        self.prefill_delay = prefill_delay
        self.hold_prefill = False  # prefill waits for the cancel event (or `release`) after its first chunk
        self.release = threading.Event()  # lets a held prefill go on to the end
        self.answer_words = (answer or "The gauge at post seven read ninety one units.").split()
        self.tokens: list[str] = []
        self.n_prefix = 0
        self.n_documents = 1  # documents the loaded prefix holds (Session.n_documents)
        self.saved: set[str] = set()
        self.asked: list[tuple[str, Route]] = []
        self.prefills: list[PrefillConfig] = []
        self.calibrated_route = UNCALIBRATED_ROUTE  # the tiny models' route (Session.calibrated_route)

    route_for = Session.route_for  # the session's own rule: which route an answer takes

    def load_document(self, text, *, label="", pages=(), progress=None, cancel=None, use_cache=True, prefill=None):
        prefill = prefill or PrefillConfig()
        self.prefills.append(prefill)
        words = ["<sys>"] * 16 + text.split()
        n = len(words)
        n_ctx = -(-(n + 768) // 256) * 256
        if text in self.saved:
            self.tokens, self.n_prefix = words, n
            return LoadResult(n, n_ctx, True, 0.01, prefill=prefill)
        self.n_prefix = 0
        for i in range(0, n, 64):
            if cancel is not None and cancel.is_set():
                raise CancelledError("cancelled: the document was not loaded")
            time.sleep(self.prefill_delay)
            if progress:
                progress(PrefillProgress(min(i + 64, n), n, 0.5, prefill.mode))
            if self.hold_prefill and cancel is not None:
                deadline = time.monotonic() + 30
                while not (cancel.is_set() or self.release.wait(0.01)) and time.monotonic() < deadline:
                    pass
        self.tokens, self.n_prefix = words, n
        self.saved.add(text)
        return LoadResult(n, n_ctx, False, 0.5, saved=True, prefill=prefill)

    def span_text(self, start: int, end: int) -> str:
        return " ".join(self.tokens[start:end])

    def ask(self, question, *, route=None, max_tokens=256, want_regions=False, cancel=None, **_):
        return Answer(self._decode(question, route, max_tokens, cancel))

    def _decode(self, question, route, max_tokens, cancel):
        if not self.n_prefix:
            raise UsageError("no document is loaded")
        route = self.route_for(route)  # resolved as the session resolves it (without the question's hints)
        self.asked.append((question, route))
        R = route.region
        self.tokens = self.tokens[: self.n_prefix] + question.split()
        summary = AnswerSummary("", len(question.split()), 0, 0.0, route)
        pieces = []
        for i, word in enumerate(self.answer_words[:max_tokens]):
            if cancel is not None and cancel.is_set():
                break
            self.tokens.append(word)
            n_kv = -(-len(self.tokens) // 256) * 256
            doc_reg = -(-self.n_prefix // R)
            last = -(-len(self.tokens) // R) - 1
            row = 256  # bytes per K+V row
            if route.mode == "full":
                dense = self.n_layer * n_kv * self.n_head_kv
                stats = ReadStats(RouteMode.FULL, 1, self.n_layer, 0, self.n_head_kv, n_kv, R, 0,
                                  dense, dense, dense * row, 0, dense * row)
            else:
                k = min(route.top_k, max(doc_reg - 2, 0))
                regions = np.zeros((self.n_layer, self.n_head_kv, 2 + k), np.int32)
                for layer in range(self.n_layer):
                    for head in range(self.n_head_kv):
                        routed = [1 + (i * 3 + layer * 5 + head * 7 + j * 11) % max(doc_reg - 1, 1) for j in range(k)]
                        regions[layer, head] = [0, last] + routed
                rows = self.n_layer * (2 + k) * R * self.n_head_kv
                dense = self.n_layer * n_kv * self.n_head_kv
                stats = ReadStats(RouteMode[route.mode.upper()], 0, self.n_layer, self.n_layer, self.n_head_kv, n_kv,
                                  R, 2 + k, rows, dense, rows * row, 1024, dense * row,
                                  np.arange(self.n_layer, dtype=np.int32), regions)
            summary.add(stats)
            summary.n_answer_tokens += 1
            text = (" " if i else "") + word
            pieces.append(text)
            yield AnswerPiece(text, i, stats)
        summary.text = "".join(pieces)
        summary.decode_seconds = summary.n_answer_tokens / 20.0  # a fixed 20 tok/s keeps snapshots stable
        return summary


# -- helpers ---------------------------------------------------------------------------------------


@pytest.fixture
def doc(tmp_path) -> Path:
    path = tmp_path / "report.txt"
    path.write_text(DOC)
    return path


def fake_app(doc: Path | None, session: FakeSession | None = None, **kwargs) -> KvlocalApp:
    session = session or FakeSession()
    return KvlocalApp(doc, session_factory=lambda progress: session, **kwargs)


async def wait_for(pilot, condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.02)


def notices(app: KvlocalApp) -> list[str]:
    return [str(n.render()) for n in app.query(Notice)]


def region_text(app: KvlocalApp) -> str:
    return str(app.query_one("#region-text", Static).render())


async def settle(pilot) -> None:
    """Make a screenshot independent of timing: no toasts, no blinking cursor."""
    app = pilot.app
    app.query_one("#question", Input).cursor_blink = False
    for _ in range(3):  # a toast raised while the progress screen closes reaches the main screen a bit later
        await pilot.pause()
        app.clear_notifications()
    await pilot.pause()


# -- units -----------------------------------------------------------------------------------------


def test_buckets_cover_every_region_once():
    for n_items, n_slots in [(1, 80), (49, 116), (116, 116), (500, 76), (3, 7)]:
        starts = bucket_starts(n_items, n_slots)
        ends = bucket_ends(starts, n_items)
        assert len(starts) == n_slots and starts[0] == 0 and ends[-1] == n_items
        covered = set()
        for lo, hi in zip(starts, ends):
            assert hi > lo
            covered.update(range(lo, hi))
        assert covered == set(range(n_items))


def test_live_answer_accumulates_steps_and_marks_dense_layers():
    live = LiveAnswer(n_layer=3, n_ctx=1024, n_prefix=600, region_size=64)
    routed = ReadStats(RouteMode.GEOMETRIC, 0, 3, 2, 1, 768, 64, 2, 10, 100, 1000, 10, 10000,
                       np.array([0, 2], np.int32), np.array([[[0, 5]], [[0, 7]]], np.int32))
    live.add(AnswerPiece("a", 1, routed))
    live.add(AnswerPiece("b", 2, routed))
    update = live.take()
    assert update.text == "ab" and update.n_tokens == 2
    reads = update.reads
    assert reads.acc.shape == (3, 16) and reads.steps == 2 and reads.doc_regions == 10
    assert reads.acc[0, 5] == 2 and reads.acc[2, 7] == 2 and reads.acc[0, 7] == 0
    assert reads.acc[1, :10].tolist() == [2] * 10  # layer 1 is not routed: it reads every region
    assert live.take() is None  # nothing new
    full = ReadStats(RouteMode.FULL, 1, 3, 0, 1, 768, 64, 0, 100, 100, 10000, 0, 10000)
    live.add(AnswerPiece("c", 3, full))
    assert live.take().reads.now[:, :10].all()


def test_rank_sources_puts_routed_regions_before_fixed_ones():
    reads = ReadMap.empty(2, 8, 64, 10)
    reads.steps = 4
    reads.acc[:, 0] = 4  # sink
    reads.acc[:, 7] = 4  # window: every step, every layer
    reads.acc[0, 3] = 3
    reads.acc[1, 5] = 1
    ranked = rank_sources(reads, n_sink_regions=1)
    assert [r for r, *_ in ranked] == [3, 5, 7]
    assert ranked[-1][3] is True and ranked[0][2] == pytest.approx(3 / 8)


# -- pilot tests on the stand-in -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_open_ask_stream_and_inspect_regions(doc):
    session = FakeSession()
    app = fake_app(doc, session)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.document is not None)
        assert app.document.n_tokens == session.n_prefix and not app.document.cache_hit
        heatmap = app.query_one(KvHeatmap)
        assert heatmap.reads.extent == -(-session.n_prefix // 64)

        await pilot.click("#question")
        await pilot.press(*QUESTION, "enter")
        await wait_for(pilot, lambda: app.busy is None and app.log_widget.entries and app.log_widget.entries[0].done)
        entry = app.log_widget.entries[0]
        assert entry.question == QUESTION
        assert entry.text == " ".join(session.answer_words)
        assert entry.reads.steps == len(session.answer_words)
        assert entry.reads.acc.shape[0] == session.n_layer
        assert f"geometric k={K}" in str(entry.query_one("#meta", Static).render())

        # after the answer, the most-read region is highlighted and its text shown
        sources = app.query_one(SourcesList)
        assert sources.sources and sources.highlighted == 0
        top = sources.sources[0].region
        assert heatmap.selected == top
        assert region_text(app) == session.span_text(top * 64, (top + 1) * 64)

        # keys move the selection; the region view follows
        heatmap.focus()
        await pilot.press("home", "right", "right")
        assert heatmap.selected == 2
        assert app.query_one(RegionView).shown_region == 2
        assert region_text(app) == session.span_text(128, 192)
        # a click selects the region under the pointer
        await pilot.click(KvHeatmap, offset=(heatmap.content_size.width - 1, 0))
        assert heatmap.selected == heatmap.reads.extent - 1


@pytest.mark.asyncio
async def test_mode_budget_and_reask_make_comparable_entries(doc):
    session = FakeSession()
    app = fake_app(doc, session)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.document is not None)
        assert app.ask("   ") is False
        app.ask(QUESTION)
        await wait_for(pilot, lambda: app.busy is None)
        app.query_one(KvHeatmap).focus()
        await pilot.press("m")  # geometric -> full
        assert app.route.mode == "full"
        await pilot.press("r")
        await wait_for(pilot, lambda: app.busy is None and len(app.log_widget.entries) == 2)
        await pilot.press("m", "minus", "minus")  # window, k halved twice
        assert app.route.mode == "window" and app.route.top_k == K // 4
        await pilot.press("f5")
        await wait_for(pilot, lambda: app.busy is None and len(app.log_widget.entries) == 3)
        await pilot.press("plus")
        assert app.route.top_k == K // 2
        assert [(q, r.mode, r.top_k) for q, r in session.asked] == [
            (QUESTION, "geometric", K),
            (QUESTION, "full", K),
            (QUESTION, "window", K // 4),
        ]
        metas = [str(e.query_one("#meta", Static).render()) for e in app.log_widget.entries]
        assert metas[0].startswith(f"geometric k={K}") and metas[1].startswith("full")
        assert metas[2].startswith(f"window k={K // 4}")
        assert all("× less KV" in m for m in (metas[0], metas[2])) and "dense KV read" in metas[1]
        # the full answer read every document region in every layer
        full = app.log_widget.entries[1].reads
        assert (full.acc[:, : full.doc_regions] == full.steps).all()
        # clicking an earlier answer shows what it read
        await pilot.click(app.log_widget.entries[0])
        assert app.shown_entry is app.log_widget.entries[0]
        assert app.query_one(KvHeatmap).reads is app.log_widget.entries[0].reads


@pytest.mark.asyncio
async def test_escape_cancels_prefill_cleanly(doc):
    session = FakeSession()
    session.hold_prefill = True  # the prefill is still running when escape arrives, however slow the machine
    app = fake_app(doc, session)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.busy == "load" and app._load_screen is not None)
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.busy is None)
        assert app.document is None and session.n_prefix == 0
        assert any("cancelled" in text for text in notices(app))
        assert app.screen is app.screen_stack[0]  # the progress screen is gone
        # the app still works: opening again loads (the cancelled prefill saved nothing)
        session.hold_prefill = False
        app.open_document(doc)
        await wait_for(pilot, lambda: app.document is not None)
        assert not app.document.cache_hit


@pytest.mark.asyncio
async def test_cached_document_opens_at_once(doc):
    session = FakeSession()
    session.saved.add(DOC)
    app = fake_app(doc, session)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.document is not None)
        assert app.document.cache_hit
        assert "cache hit" in app.sub_title
        assert any("cache hit" in text for text in notices(app))


@pytest.mark.asyncio
async def test_the_app_prefills_as_told_and_says_how(doc):
    session = FakeSession()
    app = fake_app(doc, session, prefill=PrefillConfig(mode="routed", top_k=8))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.document is not None)
        assert session.prefills == [PrefillConfig(mode="routed", top_k=8)]
        assert app.document.prefill == "routed"
        assert "prefilled (routed prefill)" in app.sub_title


@pytest.mark.asyncio
async def test_errors_are_shown_in_the_app(tmp_path, doc):
    bad = tmp_path / "bad.pdf"
    bad.write_bytes(b"not a pdf at all")

    def broken_factory(progress):
        raise ModelError("model file missing: /nowhere/model.gguf")

    app = KvlocalApp(bad, session_factory=broken_factory)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.busy is None and len(notices(app)) >= 2)
        assert any("Could not open bad.pdf" in text for text in notices(app))
        assert app.document is None
        # asking without a document is refused politely
        assert app.ask(QUESTION) is False
        # a good file with a missing model: the model error is shown, nothing crashes
        app.open_document(doc)
        await wait_for(pilot, lambda: app.busy is None and any("model could not be opened" in t for t in notices(app)))
        assert app.session is None and app.is_running
        app.open_document(tmp_path / "missing.txt")
        await wait_for(pilot, lambda: app.busy is None and any("missing.txt" in t for t in notices(app)))


@pytest.mark.asyncio
async def test_file_picker_and_help_screen(doc):
    app = fake_app(None)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("f1")
        assert type(app.screen).__name__ == "HelpScreen"
        await pilot.press("escape")
        await pilot.press("ctrl+o")
        assert type(app.screen).__name__ == "FilePicker"
        picker_input = app.screen.query_one("#picker-path", Input)
        picker_input.value = str(doc)
        picker_input.focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.document is not None)
        assert app.document.path == doc


# -- snapshots (stand-in session: deterministic) ---------------------------------------------------


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_snapshot_empty(snap_compare, size):
    app = fake_app(None)
    assert snap_compare(app, terminal_size=size, run_before=settle)


def test_snapshot_help(snap_compare):
    app = fake_app(None)

    async def run_before(pilot):
        await pilot.press("f1")
        await settle(pilot)

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_snapshot_after_answer(snap_compare, tmp_path, size):
    # the live rate is not shown once an answer ends, the summary's is: the stand-in fixes it at 20 tok/s
    doc = tmp_path / "report.txt"
    doc.write_text(LONG_DOC)
    app = fake_app(doc, FakeSession(n_layer=24))

    async def run_before(pilot):
        await wait_for(pilot, lambda: app.document is not None)
        app.ask(QUESTION)
        await wait_for(pilot, lambda: app.busy is None)
        await pilot.pause()
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


# -- the real session on the tiny model ------------------------------------------------------------


def tiny_app(tiny_model: Path, doc: Path) -> KvlocalApp:
    from kvlocal.session import Session

    # a short answer keeps the test quick on a busy machine (the tiny model never stops by itself)
    return KvlocalApp(doc, session_factory=lambda progress: Session(str(tiny_model), threads=2, model_progress=progress),
                      max_tokens=48)


@pytest.mark.engine
@pytest.mark.asyncio
async def test_tiny_model_open_ask_stream_and_regions(cache_dir, doc, tiny_model, monkeypatch):
    seen: list[ReadStats] = []
    add = LiveAnswer.add

    def recording_add(self, piece):
        if piece.stats is not None:
            seen.append(piece.stats)
        add(self, piece)

    monkeypatch.setattr(LiveAnswer, "add", recording_add)
    app = tiny_app(tiny_model, doc)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.document is not None or (app.busy is None and len(notices(app)) > 1))
        assert app.document is not None, notices(app)
        session = app.session
        assert session.n_prefix == app.document.n_tokens > 0

        await pilot.click("#question")
        await pilot.press(*QUESTION, "enter")
        await wait_for(pilot, lambda: app.busy is None and app.log_widget.entries[0].done)
        entry = app.log_widget.entries[0]
        summary = entry.summary
        assert summary.n_answer_tokens >= 1 and entry.text == summary.text

        # the heatmap got per-step stats shaped [routed layers, KV heads, regions per head]
        assert seen and len(seen) == entry.reads.steps
        for stats in seen:
            assert stats.regions.shape == (stats.n_layer_routed, stats.n_head_kv, stats.n_sel)
            assert stats.n_layer == session.n_layer and stats.n_layer_routed == session.n_layer
            assert stats.reduction > 1.0
        assert entry.reads.acc.shape == (session.n_layer, -(-app.document.n_ctx // 64))
        heatmap = app.query_one(KvHeatmap)
        assert heatmap.reads is entry.reads and heatmap.reads.acc.sum() > 0

        # region inspection: the region view shows the document's text
        heatmap.focus()
        await pilot.press("home", *["right"] * 5)
        assert heatmap.selected == 5
        shown = region_text(app)
        assert shown == session.span_text(5 * 64, 6 * 64)
        assert len(shown) > 20 and shown[2:-2] in session.span_text(0, session.n_prefix)
        assert shown[2:-2] in DOC

    # a second app on the same document restores the saved state
    app = tiny_app(tiny_model, doc)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.document is not None or (app.busy is None and len(notices(app)) > 1))
        assert app.document is not None and app.document.cache_hit


@pytest.mark.engine
@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_snapshot_tiny_model_loaded(snap_compare, cache_dir, doc, tiny_model, size):
    app = tiny_app(tiny_model, doc)

    async def run_before(pilot):
        await wait_for(pilot, lambda: app.document is not None)
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


@pytest.mark.asyncio
async def test_typing_during_the_load_is_kept_for_the_question(doc):
    session = FakeSession()
    session.hold_prefill = True
    app = fake_app(doc, session)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.busy == "load" and app._load_screen is not None)
        await pilot.press(*"who wrx", "backspace", "o", "t", "e", "space", "i", "t", "?")
        assert "your question so far: who wrote it?" in str(app._load_screen.query_one("#load-hint").render())
        app._cancel.set()  # release the held prefill: it ends as cancelled, the text must survive that too
        await wait_for(pilot, lambda: app.busy is None)
        assert app.query_one("#question", Input).value == "who wrote it?"
        session.hold_prefill = True
        app.open_document(doc)  # a load that succeeds keeps what is typed during it as well
        await wait_for(pilot, lambda: app.busy == "load" and app._load_screen is not None)
        await pilot.press("x")
        session.release.set()
        await wait_for(pilot, lambda: app.document is not None and app.busy is None)
        box = app.query_one("#question", Input)
        assert box.value == "who wrote it?x" and box.cursor_position == len(box.value)


@pytest.mark.engine
@pytest.mark.asyncio
async def test_tiny_model_opens_a_set_and_names_the_documents_its_sources_lie_in(cache_dir, tmp_path, tiny_model):
    from kvlocal.session import Session

    folder = tmp_path / "set"
    folder.mkdir()
    (folder / "a.txt").write_text("\n".join(DOC.splitlines()[:20]))
    (folder / "b.txt").write_text("\n".join(line.replace("gauge", "meter") for line in DOC.splitlines()[:20]))
    (folder / "c.bin").write_bytes(b"not a document")
    app = KvlocalApp([folder], session_factory=lambda progress: Session(str(tiny_model), threads=2,
                                                                        model_progress=progress), max_tokens=8)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.document is not None or (app.busy is None and len(notices(app)) > 2), 120)
        assert app.document is not None, notices(app)
        assert [Path(d).name for d in app.document.documents] == ["a.txt", "b.txt"]
        assert app.document.name == "2 documents" and app.document.n_tokens == app.session.prefix_cells
        assert any("skipped" in n and "c.bin" in n for n in notices(app))
        app.route = dataclasses.replace(app.route, mode="window")  # the sources list is for routed modes
        assert app.ask(QUESTION)
        await wait_for(pilot, lambda: app.busy is None and app.log_widget.entries[0].done)
        entry = app.log_widget.entries[0]
        assert entry.reads.doc_regions == -(-app.session.prefix_cells // 64)
        sources = app.query_one(SourcesList).sources
        assert sources and any(s.snippet.startswith(("[a.txt]", "[b.txt]")) for s in sources)
        span = app.session.layout.spans[1]
        assert app.region_text(span.start // 64).startswith(app.session.span_text(span.start, span.start + 4))
