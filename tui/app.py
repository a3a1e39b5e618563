"""The kvlocal app: open a document, ask questions, watch which KV regions each decode step reads.

Engine work (opening the model, prefill, decoding) runs in thread workers; they post messages (see
messages.py) or, for the per-token stream, write into a `LiveAnswer` that a UI timer drains, so widgets
are only touched on the app's thread.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import signal
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.timer import Timer
from textual.widgets import Footer, Header, Input, OptionList

from kvlocal.errors import CancelledError, KvlocalError
from kvlocal.units import human_seconds
from kvlocal.route_settings import DEFAULT_MODE, MODES
from kvlocal.route_settings import UNCALIBRATED_ROUTE
from kvlocal.routing import DEFAULT_ROUTE, PrefillConfig, Route, RouteConfig, resolve_route
from kvlocal.tui.answer_log import AnswerEntry, AnswerLog, route_label
from kvlocal.tui.counters import ReadCounters
from kvlocal.tui.file_picker import FilePicker
from kvlocal.tui.heatmap import NOW, SHADES, KvHeatmap
from kvlocal.tui.help_screen import HelpScreen
from kvlocal.tui.live import LiveAnswer, ReadMap, regions_for
from kvlocal.tui.load_screen import LoadScreen
from kvlocal.tui.messages import (
    AnswerFailed,
    AnswerFinished,
    DocumentFailed,
    DocumentLoaded,
    DocumentRead,
    DocumentSkipped,
    LoadedDocument,
    ModelProgress,
    PrefillProgressed,
    SessionFailed,
    SessionOpened,
)
from kvlocal.tui.region_view import RegionView
from kvlocal.tui.sources import Source, SourcesList, rank_sources

# the order the mode key cycles through: the default first
MODE_CYCLE = (DEFAULT_MODE,) + tuple(m for m in MODES if m != DEFAULT_MODE)
TOP_K_STEPS = (0, 1, 2, 4, 8, 16, 32, 64)
DRAIN_INTERVAL = 0.08  # seconds between heatmap / answer repaints while decoding

ModelProgressFn = Callable[[int, int, str], None]
SessionFactory = Callable[[ModelProgressFn], Any]  # returns a kvlocal.session.Session

WELCOME = "No document loaded. Press ctrl+o to open one (pdf, txt, md, html, epub); f1 shows help."


def default_session_factory(model: str | None, threads: int | None = None, **settings: Any) -> SessionFactory:
    """Opens the session of `model` (it loads a document, or a set through kvlocal.library); `settings`
    are its other keyword arguments (n_ctx, kv_type, centroids)."""

    def factory(progress: ModelProgressFn):
        from kvlocal.session import Session

        return Session(model, threads=threads, model_progress=progress, **settings)

    return factory


def _load_failed(path: Path, err: Exception) -> DocumentFailed:
    """The message for a load that failed: cancelled, a kvlocal error in its words, or anything else by its type."""
    if isinstance(err, CancelledError):
        return DocumentFailed(path, str(err), cancelled=True)
    return DocumentFailed(path, str(err) if isinstance(err, KvlocalError) else f"{type(err).__name__}: {err}")


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


class KvlocalApp(App[None]):
    """See the module docstring. `session_factory(model_progress)` builds the Session (tests inject one)."""

    CSS_PATH = "kvlocal.tcss"
    TITLE = "kvlocal"
    ENABLE_COMMAND_PALETTE = False
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall"), (48, "-very-tall")]

    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit", priority=True),
        # ctrl+c copies selected text; with nothing selected it interrupts as in the CLI: exit code 130,
        # a running prefill cancelled. A priority binding: it also works over the progress screen
        # (a modal screen hides the app's other bindings).
        Binding("ctrl+c", "interrupt", "Interrupt", show=False, priority=True),
        Binding("f1,question_mark", "help", "Help", key_display="f1"),
        Binding("ctrl+o", "open", "Open"),
        Binding("f2,m", "cycle_mode", "Mode", key_display="f2"),
        Binding("f3,minus", "budget(-1)", "-k", key_display="f3"),
        Binding("f4,plus", "budget(1)", "+k", key_display="f4"),
        Binding("f5,r", "reask", "Re-ask", key_display="f5"),
        Binding("escape", "cancel", "Cancel", show=False),
    ]

    def __init__(
        self,
        document: Path | str | list[Path | str] | None = None,
        *,
        model: str | None = None,
        threads: int | None = None,
        session_factory: SessionFactory | None = None,
        route: RouteConfig | Route | None = None,
        prefill: PrefillConfig | None = None,
        max_tokens: int = 256,
        handle_sigint: bool = False,
        max_kv: int | None = None,
    ) -> None:
        """`document`: a path, or several (files and folders) opened as one set. `handle_sigint`: a SIGINT
        to the process interrupts the app (see `interrupt`); `run_app` sets it. `max_kv`: the most KV
        bytes a set may take (None: docset's default, half the memory)."""
        super().__init__()
        self.handle_sigint = handle_sigint
        self._sigint_loop: Any = None  # the event loop the SIGINT handler is installed on
        paths = [] if document is None else list(document) if isinstance(document, (list, tuple)) else [document]
        self.initial_documents = [Path(p) for p in paths]
        self.max_kv = max_kv
        self.session_factory = session_factory or default_session_factory(model, threads)
        self.session: Any = None
        self.document: LoadedDocument | None = None
        # the defaults: a set's answer reads the hinted document, and the model takes its calibrated budget
        self.route = route or DEFAULT_ROUTE
        self.prefill = prefill or PrefillConfig()
        self.max_tokens = max_tokens
        self.busy: str | None = None  # "load" or "answer" while a worker runs
        self.last_question: str | None = None
        self.live: LiveAnswer | None = None
        self.live_entry: AnswerEntry | None = None
        self.shown_entry: AnswerEntry | None = None  # the finished answer whose reads the heatmap shows
        self._cancel = threading.Event()
        self._entry_ids = itertools.count(1)
        self._region_text: dict[int, str] = {}
        self._load_screen: LoadScreen | None = None
        self._drain_timer: Timer | None = None
        self._welcome = None
        self._read_stage = ""

    # -- layout -------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(icon="▦")
        with Vertical(id="heat-panel"):
            yield KvHeatmap(id="heatmap")
            yield ReadCounters(id="counters")
        with Horizontal(id="main"):
            yield AnswerLog(id="log")
            with Vertical(id="side"):
                yield RegionView(id="region")
                yield SourcesList(id="sources")
        yield Input(placeholder="Ask a question about the document (enter)", id="question")
        yield Footer()

    def on_mount(self) -> None:
        panel = self.query_one("#heat-panel")
        panel.border_subtitle = f"[{NOW}]■[/] this step  [{SHADES[-1]}]■[/]/[{SHADES[1]}]■[/] this answer"
        self.query_one(RegionView).border_title = "region text"
        self.query_one(SourcesList).border_title = "where the answer read"
        self.query_one(SourcesList).set_sources([], empty="most-read regions appear after an answer")
        self._update_route_title()
        self._welcome = self.log_widget.add_notice(WELCOME)
        self._drain_timer = self.set_interval(DRAIN_INTERVAL, self._drain_live, pause=True)
        self.query_one("#question", Input).focus()
        if self.handle_sigint:
            self._install_sigint()
        if len(self.initial_documents) == 1 and not self.initial_documents[0].is_dir():
            self.open_document(self.initial_documents[0])
        elif self.initial_documents:
            self.open_set(self.initial_documents)

    def _install_sigint(self) -> None:
        """Route SIGINT (kill -INT; the terminal's ctrl+c is a key in raw mode) to `interrupt`: asyncio's own
        handler cancels the app's task, which Textual ends with exit code 0."""
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGINT, self.interrupt)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            return
        self._sigint_loop = loop

    def _remove_sigint(self) -> None:
        loop, self._sigint_loop = self._sigint_loop, None
        if loop is not None and not loop.is_closed():
            # a second SIGINT while the workers stop raises KeyboardInterrupt (the CLI exits 130 at once)
            loop.remove_signal_handler(signal.SIGINT)

    @property
    def log_widget(self) -> AnswerLog:
        return self.query_one("#log", AnswerLog)

    @property
    def heatmap(self) -> KvHeatmap:
        return self.query_one("#heatmap", KvHeatmap)

    @property
    def counters(self) -> ReadCounters:
        return self.query_one("#counters", ReadCounters)

    def _route_for_documents(self) -> Route:
        """The route the next answer takes, before the question (Session.route_for): a set of several
        documents has its own unless it was tuned, and the model its calibrated budget where the route
        follows the model."""
        if self.session is None:
            return resolve_route(self.route, UNCALIBRATED_ROUTE)
        return self.session.route_for(self.route)

    def _update_route_title(self) -> None:
        r = self._route_for_documents()
        if r.mode == "full":
            budget = "dense attention"
        else:
            budget = f"k={r.top_k} × R{r.region} · sinks {r.sinks} · window {r.window}"
            if r.layer_top_k:
                budget += f" · layers {r.layer_top_k}"
            if r.hinted:
                budget += f" · hints {r.hinted}"
        self.query_one("#heat-panel").border_title = f"KV reads · {r.mode} · {budget}"

    def _update_subtitle(self) -> None:
        doc = self.document
        if doc is None:
            self.sub_title = "no document"
            return
        how = "cache hit" if doc.cache_hit else "prefilled"
        if doc.prefill != "dense":
            how += f" ({doc.prefill} prefill)"
        self.sub_title = f"{doc.name} · {doc.n_tokens:,} tokens · ctx {doc.n_ctx:,} · {how}"

    # -- opening documents --------------------------------------------------------------------------

    def action_open(self) -> None:
        if self.busy:
            self.notify("Wait for the current work to finish (esc cancels it).", severity="warning")
            return
        start = self.document.path.parent if self.document else None
        self.push_screen(FilePicker(start), self._picked)

    def _picked(self, path: Path | None) -> None:
        if path is not None:
            self.open_document(path)

    def open_document(self, path: Path) -> None:
        """Read, prefill (or restore) the document in a worker, behind the progress screen."""
        if self.busy:
            self.notify("Busy; esc cancels the current work.", severity="warning")
            return
        path = Path(path).expanduser()
        self.busy = "load"
        self._cancel = threading.Event()
        self._load_screen = LoadScreen(f"Opening {path.name}")
        self.push_screen(self._load_screen)
        self._load_worker(path, self._cancel)

    @work(thread=True, group="engine", exit_on_error=False)
    def _load_worker(self, path: Path, cancel: threading.Event) -> None:
        from kvlocal.ingest import load_document

        try:
            doc = load_document(path)
        except KvlocalError as err:
            self.post_message(DocumentFailed(path, str(err)))
            return
        except Exception as err:  # noqa: BLE001 - anything unexpected is shown, not raised
            self.post_message(DocumentFailed(path, f"{type(err).__name__}: {err}"))
            return
        self.post_message(DocumentRead(path, doc.kind, len(doc.text)))
        session = self._open_session()
        if session is None:
            return
        try:
            if cancel.is_set():
                raise CancelledError("cancelled: the document was not loaded")
            result = session.load_document(
                doc.text,
                label=str(path),
                pages=doc.pages,
                progress=lambda p: self.post_message(PrefillProgressed(p)),
                cancel=cancel,
                prefill=self.prefill,
            )
        except Exception as err:  # noqa: BLE001 - anything unexpected is shown, not raised
            self.post_message(_load_failed(path, err))
            return
        loaded = LoadedDocument(
            path=path,
            kind=doc.kind,
            n_tokens=result.n_tokens,
            n_ctx=result.n_ctx,
            cache_hit=result.cache_hit,
            seconds=result.seconds,
            rebuilt_reason=result.rebuilt_reason,
            saved=result.saved,
            prefill=result.prefill.mode,
        )
        self.post_message(DocumentLoaded(loaded))

    def open_set(self, paths: list[Path]) -> None:
        """Read the documents (folders expanded), then load them as one set in a worker."""
        if self.busy:
            self.notify("Busy; esc cancels the current work.", severity="warning")
            return
        paths = [Path(p).expanduser() for p in paths]
        self.busy = "load"
        self._cancel = threading.Event()
        self._load_screen = LoadScreen(f"Opening {len(paths)} documents" if len(paths) > 1 else f"Opening {paths[0].name}")
        self.push_screen(self._load_screen)
        self._load_set_worker(paths, self._cancel)

    @work(thread=True, group="engine", exit_on_error=False)
    def _load_set_worker(self, paths: list[Path], cancel: threading.Event) -> None:
        from kvlocal.docset import default_max_kv, expand_documents
        from kvlocal.library import check_set_fits, load_set

        first = paths[0]
        try:
            docs = expand_documents(paths)
        except KvlocalError as err:
            self.post_message(DocumentFailed(first, str(err)))
            return
        for skipped in docs.skipped:
            self.post_message(DocumentSkipped(skipped.message))
        self.post_message(DocumentRead(first, "set" if len(docs.documents) > 1 else docs.documents[0].kind, docs.n_chars))
        session = self._open_session()
        if session is None:
            return
        try:
            if cancel.is_set():
                raise CancelledError("cancelled: the set was not loaded")
            limit = self.max_kv if self.max_kv is not None else default_max_kv()
            check_set_fits(session, docs.documents, limit)
            result = load_set(session, docs.documents, progress=lambda p: self.post_message(PrefillProgressed(p)),
                              cancel=cancel, prefill=self.prefill)
        except Exception as err:  # noqa: BLE001 - anything unexpected is shown, not raised
            self.post_message(_load_failed(first, err))
            return
        loaded = LoadedDocument(
            path=Path(docs.documents[0].source),
            kind=docs.documents[0].kind if len(docs.documents) == 1 else "set",
            n_tokens=result.n_cells,
            n_ctx=result.n_ctx,
            cache_hit=result.cache_hits == len(result.documents),
            seconds=result.seconds,
            rebuilt_reason="; ".join(d.rebuilt_reason for d in result.documents if d.rebuilt_reason) or None,
            saved=all(d.saved or d.cache_hit for d in result.documents),
            prefill=self.prefill.mode if len(docs.documents) == 1 else "dense",
            documents=tuple(d.source for d in docs.documents) if len(docs.documents) > 1 else (),
        )
        self.post_message(DocumentLoaded(loaded))

    def _open_session(self):
        """The session, opened on first use (posting SessionOpened or SessionFailed); None if it failed."""
        if self.session is not None:
            return self.session
        try:
            session = self.session_factory(lambda done, total, stage: self.post_message(ModelProgress(done, total, stage)))
        except KvlocalError as err:
            self.post_message(SessionFailed(str(err)))
            return None
        except Exception as err:  # noqa: BLE001
            self.post_message(SessionFailed(f"{type(err).__name__}: {err}"))
            return None
        self.post_message(SessionOpened(session))
        return session

    def on_document_skipped(self, message: DocumentSkipped) -> None:
        self.log_widget.add_notice(message.message, error=True)

    def on_model_progress(self, message: ModelProgress) -> None:
        if self._load_screen is not None:
            self._load_screen.set_model_progress(message.done, message.total, message.stage)

    def on_session_opened(self, message: SessionOpened) -> None:
        self.session = message.session
        if self._load_screen is not None:
            self._load_screen.set_stage(f"{self._read_stage} · prefilling (or restoring the saved state)…")

    def on_document_read(self, message: DocumentRead) -> None:
        self._read_stage = f"{message.kind} · {message.n_chars:,} characters"
        if self._load_screen is not None:
            stage = "opening the model…" if self.session is None else "prefilling (or restoring the saved state)…"
            self._load_screen.set_stage(f"{self._read_stage} · {stage}")

    def on_prefill_progressed(self, message: PrefillProgressed) -> None:
        p = message.progress
        if self._load_screen is not None:
            self._load_screen.set_prefill(p.done, p.total, p.rate, p.eta, p.prefill)

    def _close_load_screen(self) -> None:
        if self._load_screen is not None:
            typed = self._load_screen.typed
            if self.screen is self._load_screen:
                self.pop_screen()
            self._load_screen = None
            if typed:  # what was typed while loading goes on in the question box
                box = self.query_one("#question", Input)
                box.value += typed
                box.cursor_position = len(box.value)

    def on_session_failed(self, message: SessionFailed) -> None:
        self.busy = None
        self._close_load_screen()
        self.log_widget.add_notice(f"The model could not be opened: {message.error}", error=True)
        self.notify(message.error, title="model", severity="error", timeout=10)

    def on_document_failed(self, message: DocumentFailed) -> None:
        self.busy = None
        self._close_load_screen()
        if message.cancelled:
            self.notify(f"Loading {message.path.name} was cancelled.", severity="warning")
            self.log_widget.add_notice(f"Loading {message.path.name} was cancelled.")
        else:
            self.log_widget.add_notice(f"Could not open {message.path.name}: {message.error}", error=True)
            self.notify(message.error, title="document", severity="error", timeout=10)
        if self.document is not None and (self.session is None or not self.session.n_prefix):
            # the session dropped the previous document when the new prefill started
            self.log_widget.add_notice(f"{self.document.name} is no longer loaded; open a document again.")
            self._set_document(None)

    def on_document_loaded(self, message: DocumentLoaded) -> None:
        self.busy = None
        self._close_load_screen()
        doc = message.document
        if self._welcome is not None:
            self._welcome.remove()
            self._welcome = None
        self._set_document(doc)
        if doc.cache_hit:
            detail = "cache hit: restored the saved KV state"
            toast = f"{detail} in {doc.seconds:.1f} s"
        else:
            detail = "prefilled; KV state saved" if doc.saved else "prefilled; KV state not saved"
            how = "prefilled" if doc.prefill == "dense" else f"prefilled ({doc.prefill})"
            toast = f"{how} in {human_seconds(doc.seconds)} ({doc.n_tokens / max(doc.seconds, 1e-9):,.0f} tok/s)"
        self.log_widget.add_notice(f"Loaded {doc.name}: {doc.n_tokens:,} tokens, context {doc.n_ctx:,} ({detail}).")
        if doc.rebuilt_reason:
            self.log_widget.add_notice(doc.rebuilt_reason)
        self.notify(toast, title=doc.name)
        self.query_one("#question", Input).focus()

    def _set_document(self, doc: LoadedDocument | None) -> None:
        self.document = doc
        self._update_route_title()  # a set of several documents may route otherwise
        self._region_text.clear()
        self.shown_entry = None
        self.log_widget.mark_selected(None)
        self._update_subtitle()
        region_view = self.query_one(RegionView)
        if doc is None or self.session is None:
            self.heatmap.set_reads(None)
            region_view.show_empty("No document loaded.")
        else:
            self.heatmap.set_reads(self._empty_reads())
            region_view.show_empty()
        self.heatmap.selected = None
        self.counters.show_idle()
        self.query_one(SourcesList).set_sources([], empty="most-read regions appear after an answer")

    def _prefix_cells(self) -> int:
        """Cells of the loaded prompt prefix (a library's set holds more cells than positions)."""
        return getattr(self.session, "prefix_cells", self.session.n_prefix)

    def _empty_reads(self) -> ReadMap:
        n_prefix = self._prefix_cells()
        R = self.route.region
        return ReadMap.empty(self.session.n_layer, regions_for(n_prefix, R), R, regions_for(self.document.n_ctx, R))

    # -- asking -------------------------------------------------------------------------------------

    @on(Input.Submitted, "#question")
    def _question_submitted(self, event: Input.Submitted) -> None:
        question = event.value.strip()
        if not question:
            return
        if self.ask(question):
            event.input.value = ""

    def ask(self, question: str) -> bool:
        """Start answering `question` with the current route; False (with a notice) when not possible."""
        question = question.strip()
        if not question:
            return False
        if self.busy:
            self.notify("Busy; esc cancels the current work.", severity="warning")
            return False
        if self.document is None or self.session is None:
            self.notify("Open a document first (ctrl+o).", severity="warning")
            return False
        self.last_question = question
        entry_id = next(self._entry_ids)
        route = self._route_for_documents()
        entry = self.log_widget.add_entry(entry_id, question, route)
        self.live_entry = entry
        self.live = LiveAnswer(self.session.n_layer, self.document.n_ctx, self._prefix_cells(), route.region)
        # a set's answer also says which documents (and pages) it read
        tally = self.session.read_tally() if self._is_set() and hasattr(self.session, "read_tally") else None
        self.shown_entry = None
        self.log_widget.mark_selected(None)
        self.heatmap.set_reads(self.live.reads())
        self.counters.show_idle("decoding the question…")
        self.busy = "answer"
        self._cancel = threading.Event()
        self._ask_worker(self.session, question, self.route, self.live, entry_id, self._cancel, tally)
        if self._drain_timer is not None:
            self._drain_timer.resume()
        return True

    @work(thread=True, group="engine", exit_on_error=False)
    def _ask_worker(self, session, question: str, route: RouteConfig | Route, live: LiveAnswer, entry_id: int, cancel,
                    tally=None) -> None:
        """`tally`: a set's SetReads (kvlocal.library), counting each step's reads by document."""
        try:
            answer = session.ask(question, route=route, max_tokens=self.max_tokens, want_regions=True, cancel=cancel)
            for piece in answer:
                live.add(piece)
                if tally is not None:
                    tally.add(piece.stats)
            summary = answer.summary()
        except KvlocalError as err:
            self.post_message(AnswerFailed(entry_id, str(err)))
            return
        except Exception as err:  # noqa: BLE001
            self.post_message(AnswerFailed(entry_id, f"{type(err).__name__}: {err}"))
            return
        by_document = tally.describe(4, rest=False, basename=True) if tally is not None and tally.steps else ""
        self.post_message(AnswerFinished(entry_id, summary, cancel.is_set(), by_document))

    async def _drain_live(self) -> None:
        """Timer: move what the worker decoded since the last tick into the widgets."""
        live, entry = self.live, self.live_entry
        if live is None or entry is None:
            return
        update = live.take()
        if update is None:
            return
        if update.text:
            await entry.write(update.text)
        if update.reads is not None:
            self.heatmap.set_reads(update.reads)
            self._refresh_region_view()
        if update.step is not None:
            self.counters.show_live(update.step, update.totals, update.n_tokens, update.rate)

    async def on_answer_finished(self, message: AnswerFinished) -> None:
        await self._drain_live()
        entry = self.log_widget.entry(message.entry_id)
        live = self.live
        self._stop_live()
        if entry is None:
            return
        summary = message.summary
        reads = live.reads() if live is not None else None
        entry.reads = reads
        entry.summary = summary
        parts = [route_label(entry.route), f"{summary.n_answer_tokens} tok", f"{summary.decode_rate:,.1f} tok/s"]
        if summary.focus:  # a set's answer read one document (--focus hinted)
            parts.insert(1, f"from {summary.focus}")
        if entry.route.mode == "full":
            parts.append("dense KV read")
        elif summary.bytes_dense:
            parts.append(f"{summary.reduction:.1f}× less KV read")
        if message.cancelled:
            parts.append("stopped")
        if summary.fallback:
            parts.append(f"dense fallback: {summary.fallback}")
        await entry.finish(" · ".join(parts), reads_by_document=message.reads_by_document)
        self._show_entry(entry, select=False)

    async def on_answer_failed(self, message: AnswerFailed) -> None:
        await self._drain_live()
        entry = self.log_widget.entry(message.entry_id)
        self._stop_live()
        if entry is not None:
            await entry.finish(f"error: {message.error}", error=True)
        self.notify(message.error, title="answer", severity="error", timeout=10)

    def _stop_live(self) -> None:
        self.busy = None
        self.live = None
        self.live_entry = None
        if self._drain_timer is not None:
            self._drain_timer.pause()

    def on_answer_entry_selected(self, message: AnswerEntry.Selected) -> None:
        if self.busy != "answer":
            self._show_entry(message.entry, select=True)

    def _show_entry(self, entry: AnswerEntry, *, select: bool) -> None:
        """Show a finished answer's reads in the heatmap, counters and sources."""
        self.shown_entry = entry
        self.log_widget.mark_selected(entry if select else None)
        reads = entry.reads
        summary = entry.summary
        if reads is not None:
            self.heatmap.set_reads(reads)
        if summary is not None:
            self.counters.show_live(
                None,
                summary,
                summary.n_answer_tokens,
                summary.decode_rate,
                label=f"answer {entry.entry_id} · {route_label(entry.route)}",
            )
        self._update_sources(entry)

    def _update_sources(self, entry: AnswerEntry) -> None:
        sources_list = self.query_one(SourcesList)
        reads = entry.reads
        route = entry.route
        if route.mode == "full":
            sources_list.set_sources([], empty="full attention: every step read every region")
            self._refresh_region_view()
            return
        n_sink = regions_for(route.sinks, route.region)
        ranked = rank_sources(reads, n_sink_regions=n_sink)
        sources = [Source(r, n, share, fixed, self._source_snippet(r)) for r, n, share, fixed in ranked]
        sources_list.set_sources(sources, empty="no document region was read beyond the sinks")
        if sources:
            sources_list.highlighted = 0
        else:
            self._refresh_region_view()

    def _is_set(self) -> bool:
        return self.document is not None and bool(self.document.documents)

    def _where_in_set(self, region: int) -> str:
        """In a set: the document (and page, where known) that region `region` lies in; "" otherwise."""
        if not self._is_set() or not hasattr(self.session, "document_at"):
            return ""
        cell = region * self.route.region
        span = self.session.document_at(cell)
        if span is None:
            return ""
        name = Path(span.label).name
        first = span.page_at(cell) if hasattr(span, "page_at") else None
        if first is None:
            return name
        last = span.page_at(min(cell + self.route.region, span.end) - 1) or first
        return f"{name} p. {first}" if last == first else f"{name} pp. {first}–{last}"

    def _source_snippet(self, region: int) -> str:
        """A region's text for the sources list; in a set, after the name of the document it lies in
        (and its page, for a PDF)."""
        text = _one_line(self.region_text(region))
        where = self._where_in_set(region)
        if where:
            text = f"[{where}] {text}"
        return text[:120]

    @on(OptionList.OptionHighlighted, "#sources")
    def _source_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        source = self.query_one(SourcesList).source_at(event.option_index)
        if source is not None:
            self.heatmap.select(source.region)

    # -- regions ------------------------------------------------------------------------------------

    def region_text(self, region: int) -> str:
        """The text of a region of the context (cached for document regions)."""
        if self.session is None:
            return ""
        R = self.route.region
        if region in self._region_text:
            return self._region_text[region]
        start, end = region * R, (region + 1) * R
        try:
            text = self.session.span_text(start, end)
        except Exception as err:  # noqa: BLE001 - a display helper must not take the app down
            return f"(text unavailable: {err})"
        if end <= self._prefix_cells():
            self._region_text[region] = text
        return text

    def on_kv_heatmap_region_selected(self, message: KvHeatmap.RegionSelected) -> None:
        self._refresh_region_view()

    def _refresh_region_view(self) -> None:
        region = self.heatmap.selected
        view = self.query_one(RegionView)
        reads = self.heatmap.reads
        if region is None or reads is None or self.session is None:
            return
        R = reads.region_size
        n_sink = regions_for(self.route.sinks, R)
        if region < n_sink:
            where = "sink"
        elif region < reads.doc_regions:
            where = self._where_in_set(region) or "document"
        else:
            where = "question/answer"
        view.show_region(
            region,
            R,
            self.region_text(region),
            reads=reads.region_total(region),
            layers=reads.layers_reading(region),
            n_layer=reads.n_layer,
            steps=reads.steps,
            where=where,
        )

    # -- route controls -----------------------------------------------------------------------------

    def action_cycle_mode(self) -> None:
        mode = MODE_CYCLE[(MODE_CYCLE.index(self.route.mode) + 1) % len(MODE_CYCLE)]
        self.route = replace(self.route, mode=mode)
        self._route_changed()

    def action_budget(self, direction: int) -> None:
        k = self._route_for_documents().top_k
        if direction > 0:
            bigger = [s for s in TOP_K_STEPS if s > k]
            k = bigger[0] if bigger else k
        else:
            smaller = [s for s in TOP_K_STEPS if s < k]
            k = smaller[-1] if smaller else k
        self.route = replace(self._route_for_documents(), top_k=k)  # tuned: taken as it is
        self._route_changed()

    def _route_changed(self) -> None:
        self._update_route_title()
        hint = " · f5 asks the last question again" if self.last_question else ""
        self.notify(f"route: {self._route_for_documents().describe()}{hint}", timeout=3)

    def action_reask(self) -> None:
        if self.last_question is None:
            self.notify("Ask a question first.", severity="warning")
            return
        self.ask(self.last_question)

    # -- misc ---------------------------------------------------------------------------------------

    def action_help(self) -> None:
        if not isinstance(self.screen, (HelpScreen, LoadScreen)):
            self.push_screen(HelpScreen())

    def action_cancel(self) -> None:
        if self.busy:
            self._cancel.set()
            if self.busy == "answer":
                self.notify("Stopping the answer…", timeout=2)
            return
        focused = self.focused
        if isinstance(focused, Input):
            self.heatmap.focus()

    async def action_quit(self) -> None:
        self._cancel.set()  # a running prefill or answer stops at its next step
        self.exit()

    def action_interrupt(self) -> None:
        focused = self.focused
        if isinstance(focused, Input) and focused.selected_text:
            self.copy_to_clipboard(focused.selected_text)
            return
        selected = self.screen.get_selected_text()
        if selected:
            self.copy_to_clipboard(selected)
            return
        self.interrupt()

    def interrupt(self) -> None:
        """Ctrl-C / SIGINT: stop a running prefill or answer at its next step (the prefill saves nothing) and
        exit with code 130, as the CLI does."""
        self._cancel.set()
        self.exit(return_code=INTERRUPTED)

    def on_unmount(self) -> None:
        self._cancel.set()
        self._remove_sigint()


INTERRUPTED = 130  # the exit code of an interrupted kvlocal command


def run_app(documents: list[Path] | None = None, model: str | None = None, *, route: RouteConfig | None = None,
            prefill: PrefillConfig | None = None, max_tokens: int = 256, session_settings: dict | None = None,
            max_kv: int | None = None) -> int:
    """Entry point of `kvlocal tui`; returns the exit code (130: interrupted). `documents`: a document,
    or several (files and folders) opened as one set. `session_settings`: the Session's keyword arguments
    (threads, n_ctx, kv_type, centroid_block, centroid_type)."""
    app = KvlocalApp(list(documents or []), session_factory=default_session_factory(model, **(session_settings or {})),
                     route=route, prefill=prefill, max_tokens=max_tokens, handle_sigint=True, max_kv=max_kv)
    app.run()
    return app.return_code or 0
