"""The modal shown while the model opens and the document is prefilled: progress, tok/s, ETA; Esc cancels.

What the user types meanwhile is kept (shown under the bar) and handed to the question box when the
screen closes, so a question started during a long prefill is not lost."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.events import Key
from textual.screen import ModalScreen
from textual.widgets import Label, ProgressBar, Static

from kvlocal.units import human_bytes, human_seconds


class LoadScreen(ModalScreen[None]):
    """Shows progress; the app owns the worker and dismisses this screen when loading ends."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    DEFAULT_CSS = """
    LoadScreen {
        align: center middle;
    }
    LoadScreen > Vertical {
        width: 64;
        max-width: 100%;
        height: auto;
        padding: 1 2;
        border: round $primary;
        background: $surface;
    }
    LoadScreen #load-title {
        text-style: bold;
        width: 100%;
    }
    LoadScreen #load-stage, LoadScreen #load-stats {
        color: $text-muted;
        width: 100%;
    }
    LoadScreen ProgressBar {
        margin: 1 0;
    }
    LoadScreen ProgressBar Bar {
        width: 1fr;
    }
    LoadScreen #load-hint {
        color: $text-muted;
        text-style: italic;
    }
    """

    def __init__(self, title: str) -> None:
        super().__init__()
        self._title = title
        self.cancelling = False
        self.typed = ""  # the start of a question, typed while loading

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(Text(self._title), id="load-title")
            yield Static("opening the model…", id="load-stage")
            yield ProgressBar(total=None, show_eta=False, id="load-bar")
            yield Static("", id="load-stats")
            yield Label("esc cancels", id="load-hint")

    def on_mount(self) -> None:
        self.query_one(Vertical).border_title = "kvlocal"

    def set_title(self, title: str) -> None:
        self._title = title
        self.query_one("#load-title", Label).update(Text(title))

    def set_stage(self, text: str, total: float | None = None) -> None:
        self.query_one("#load-stage", Static).update(Text(text))
        bar = self.query_one(ProgressBar)
        bar.update(total=total, progress=0)
        self.query_one("#load-stats", Static).update("")

    def set_model_progress(self, done: int, total: int, stage: str) -> None:
        verb = {"download": "downloading the model", "assemble": "assembling the model", "verify": "verifying the model"}
        self.query_one("#load-stage", Static).update(Text(verb.get(stage, stage)))
        self.query_one(ProgressBar).update(total=max(total, 1), progress=done)
        self.query_one("#load-stats", Static).update(f"{human_bytes(done)} of {human_bytes(total)}")

    def set_prefill(self, done: int, total: int, rate: float, eta: float, prefill: str = "dense") -> None:
        self.query_one(ProgressBar).update(total=max(total, 1), progress=done)
        how = "" if prefill == "dense" else f"{prefill} prefill · "
        self.query_one("#load-stats", Static).update(
            f"{how}{done:,} / {total:,} tokens · {rate:,.0f} tok/s · ETA {human_seconds(eta)}"
        )

    def on_key(self, event: Key) -> None:
        if event.key == "backspace":
            self.typed = self.typed[:-1]
        elif event.is_printable and event.character:
            self.typed += event.character
        else:
            return  # escape and the app's keys keep their bindings
        event.stop()
        event.prevent_default()
        hint = "cancelling…" if self.cancelling else "esc cancels"
        if self.typed:
            hint += f" · your question so far: {self.typed}"
        self.query_one("#load-hint", Label).update(Text(hint))

    def action_cancel(self) -> None:
        if not self.cancelling:
            self.cancelling = True
            self.query_one("#load-hint", Label).update("cancelling…")
            self.app.action_cancel()
