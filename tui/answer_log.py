"""The scrollable log of the session: notices, and one entry per question with its streamed answer."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.containers import Vertical, VerticalScroll
from textual.events import Click
from textual.message import Message
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from kvlocal.tui.live import ReadMap


def route_label(route: Any) -> str:
    """Mode and budget of a RouteConfig in a few characters ("geometric k=8")."""
    if route.mode == "full":
        return "full (dense)"
    return f"{route.mode} k={route.top_k}"


class Notice(Static):
    """An info or error line in the log."""

    DEFAULT_CSS = """
    Notice {
        margin: 0 1 1 1;
        color: $text-muted;
    }
    Notice.-error {
        color: $text-error;
        background: $error-muted;
        padding: 0 1;
    }
    """

    def __init__(self, text: str, *, error: bool = False) -> None:
        super().__init__(Text(text), classes="-error" if error else None)


class AnswerEntry(Vertical):
    """A question, its streaming answer, and (once done) the route and read summary."""

    DEFAULT_CSS = """
    AnswerEntry {
        height: auto;
        margin: 0 0 1 0;
        padding: 0 1;
        border-left: outer $primary 40%;
    }
    AnswerEntry.-selected {
        border-left: outer $accent;
        background: $boost;
    }
    AnswerEntry > .question {
        text-style: bold;
    }
    AnswerEntry > .meta {
        color: $text-muted;
    }
    AnswerEntry > Markdown {
        margin: 0;
        padding: 0;
        background: transparent;
    }
    AnswerEntry > Markdown > MarkdownParagraph {
        margin: 0;
    }
    """

    class Selected(Message):
        def __init__(self, entry: AnswerEntry) -> None:
            super().__init__()
            self.entry = entry

    def __init__(self, entry_id: int, question: str, route: Any) -> None:
        super().__init__(id=f"entry-{entry_id}")
        self.entry_id = entry_id
        self.question = question
        self.route = route
        self.reads: ReadMap | None = None
        self.summary: Any = None  # kvlocal.session.AnswerSummary once finished
        self.reads_by_document = ""  # in a set: which documents (and pages) the answer read, once finished
        self.text = ""
        self.done = False
        self._stream: MarkdownStream | None = None

    def compose(self):
        yield Static(Text(f"Q: {self.question}"), classes="question")
        yield Static(Text(f"{route_label(self.route)} · answering…"), classes="meta", id="meta")
        yield Markdown("", id="answer")

    @property
    def markdown(self) -> Markdown:
        return self.query_one("#answer", Markdown)

    async def write(self, fragment: str) -> None:
        if not fragment:
            return
        self.text += fragment
        if self._stream is None:
            self._stream = Markdown.get_stream(self.markdown)
        await self._stream.write(fragment)

    async def finish(self, meta: str, *, error: bool = False, reads_by_document: str = "") -> None:
        """The answer is done: `meta` replaces "answering…"; `reads_by_document` (a set's) goes below it."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        if not self.text.strip() and not error:
            await self.markdown.update("*(no answer tokens)*")
        meta_widget = self.query_one("#meta", Static)
        meta_widget.update(Text(meta, style="red" if error else ""))
        if reads_by_document:
            self.reads_by_document = reads_by_document
            await self.mount(Static(Text(reads_by_document), classes="meta", id="reads-by-document"), after=meta_widget)
        self.done = True  # last: the app shows the entry's reads right after, with no await between

    def on_click(self, event: Click) -> None:
        if self.done:
            self.post_message(self.Selected(self))


class AnswerLog(VerticalScroll):
    """Earlier questions stay visible; the view follows the newest answer unless scrolled up."""

    DEFAULT_CSS = """
    AnswerLog {
        height: 1fr;
    }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._entries: dict[int, AnswerEntry] = {}

    def on_mount(self) -> None:
        self.anchor()

    def add_notice(self, text: str, *, error: bool = False) -> Notice:
        notice = Notice(text, error=error)
        self.mount(notice)
        self.anchor()
        return notice

    def add_entry(self, entry_id: int, question: str, route: Any) -> AnswerEntry:
        entry = AnswerEntry(entry_id, question, route)
        self._entries[entry_id] = entry
        self.mount(entry)
        self.anchor()
        return entry

    def entry(self, entry_id: int) -> AnswerEntry | None:
        return self._entries.get(entry_id)

    @property
    def entries(self) -> list[AnswerEntry]:
        return list(self._entries.values())

    def mark_selected(self, entry: AnswerEntry | None) -> None:
        for other in self._entries.values():
            other.set_class(other is entry, "-selected")
