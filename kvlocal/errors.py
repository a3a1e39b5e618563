"""Errors that the CLI reports as one line on stderr, with an exit code."""

from __future__ import annotations


class KvlocalError(Exception):
    """A failure the user can act on; `str(err)` is the one-line message, in the core's words.

    `setting` names the setting at fault (a RouteConfig or Session field such as "top_k" or "ctx"),
    so that a front end can point at its own control for it (the CLI names its option).
    """

    exit_code = 1

    def __init__(self, message: str = "", *, setting: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting


class UsageError(KvlocalError):
    """Bad command-line usage (wrong option value, unknown format): exit code 2."""

    exit_code = 2


class DocumentError(KvlocalError):
    """The document cannot be read or has no usable text."""


class ModelError(KvlocalError):
    """The model file is missing, damaged, not GGUF, or fails verification."""


class EngineError(KvlocalError):
    """The llama.cpp engine is missing, stock (unpatched) or failed."""


class ContextOverflowError(KvlocalError):
    """The document does not fit in the context window."""


class CancelledError(KvlocalError):
    """The user interrupted a long operation (Ctrl-C / Esc)."""

    exit_code = 130
