"""Messages that the engine workers (threads) post to the app; the app updates widgets on its own thread.

Per-token answer text and read statistics do not travel as messages: the ask worker writes them into a
`LiveAnswer` buffer that a UI timer drains (see live.py), so decoding never waits for the UI.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textual.message import Message


class ModelProgress(Message):
    """Model download / verification progress while the session opens."""

    def __init__(self, done: int, total: int, stage: str) -> None:
        super().__init__()
        self.done = done
        self.total = total
        self.stage = stage


class SessionOpened(Message):
    def __init__(self, session: Any) -> None:
        super().__init__()
        self.session = session


class SessionFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class DocumentRead(Message):
    """The document's text was extracted; prefill (or the cache lookup) starts."""

    def __init__(self, path: Path, kind: str, n_chars: int) -> None:
        super().__init__()
        self.path = path
        self.kind = kind
        self.n_chars = n_chars


class DocumentSkipped(Message):
    """A file of a set that could not be used (its one-line message); the others are loaded."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message


class PrefillProgressed(Message):
    def __init__(self, progress: Any) -> None:  # kvlocal.session.PrefillProgress
        super().__init__()
        self.progress = progress


@dataclass(frozen=True)
class LoadedDocument:
    """What the UI keeps about the prefilled document."""

    path: Path
    kind: str
    n_tokens: int
    n_ctx: int
    cache_hit: bool
    seconds: float
    rebuilt_reason: str | None = None
    saved: bool = True  # the prefilled state went to the cache
    prefill: str = "dense"  # how it was prefilled: dense, or routed (PrefillConfig.mode)
    documents: tuple[str, ...] = ()  # a set's documents (empty: one document, `path`)

    @property
    def name(self) -> str:
        return f"{len(self.documents)} documents" if self.documents else self.path.name


class DocumentLoaded(Message):
    def __init__(self, document: LoadedDocument) -> None:
        super().__init__()
        self.document = document


class DocumentFailed(Message):
    def __init__(self, path: Path, error: str, cancelled: bool = False) -> None:
        super().__init__()
        self.path = path
        self.error = error
        self.cancelled = cancelled


class AnswerFinished(Message):
    def __init__(self, entry_id: int, summary: Any, cancelled: bool, reads_by_document: str = "") -> None:
        super().__init__()  # summary: kvlocal.session.AnswerSummary
        self.entry_id = entry_id
        self.summary = summary
        self.cancelled = cancelled
        self.reads_by_document = reads_by_document  # a set's one-line read summary (SetReads.describe)


class AnswerFailed(Message):
    def __init__(self, entry_id: int, error: str) -> None:
        super().__init__()
        self.entry_id = entry_id
        self.error = error
