"""A modal to pick a document: a path input and a directory tree of supported files."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DirectoryTree, Input, Label

from kvlocal.ingest import KIND_BY_SUFFIX


class DocumentTree(DirectoryTree):
    """Directories and files kvlocal can read; hidden entries are left out."""

    def filter_paths(self, paths: Iterable[Path]) -> Iterable[Path]:
        keep = []
        for path in paths:
            if path.name.startswith("."):
                continue
            try:
                if path.is_dir() or path.suffix.lower() in KIND_BY_SUFFIX:
                    keep.append(path)
            except OSError:
                continue
        return keep


class FilePicker(ModalScreen[Path | None]):
    BINDINGS = [Binding("escape", "close", "Close")]

    DEFAULT_CSS = """
    FilePicker {
        align: center middle;
    }
    FilePicker > Vertical {
        width: 90;
        max-width: 100%;
        height: 90%;
        border: round $primary;
        background: $surface;
    }
    FilePicker Input {
        margin: 0 0 1 0;
    }
    FilePicker DocumentTree {
        height: 1fr;
    }
    FilePicker #picker-hint {
        color: $text-muted;
    }
    """

    def __init__(self, start: Path | None = None) -> None:
        super().__init__()
        start = (start or Path.cwd()).expanduser()
        self.start = start if start.is_dir() else start.parent

    def compose(self) -> ComposeResult:
        with Vertical() as box:
            box.border_title = "open a document"
            box.border_subtitle = "enter opens · esc closes"
            yield Input(value=str(self.start), placeholder="path to a .pdf .txt .md .html .epub file", id="picker-path")
            yield DocumentTree(self.start, id="picker-tree")
            yield Label("pdf · txt · md · html · epub", id="picker-hint")

    def on_mount(self) -> None:
        self.query_one(DocumentTree).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        path = Path(event.value.strip()).expanduser()
        if path.is_dir():
            self.query_one(DocumentTree).path = path
            self.query_one(DocumentTree).focus()
        elif path.exists():
            self.dismiss(path)
        else:
            self.notify(f"{path} does not exist", severity="error")

    def on_directory_tree_file_selected(self, event: DirectoryTree.FileSelected) -> None:
        event.stop()
        self.dismiss(event.path)

    def on_directory_tree_directory_selected(self, event: DirectoryTree.DirectorySelected) -> None:
        event.stop()
        self.query_one("#picker-path", Input).value = str(event.path)

    def action_close(self) -> None:
        self.dismiss(None)
