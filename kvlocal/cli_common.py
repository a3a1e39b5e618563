"""What every kvlocal command shares: one-line errors with their exit codes, the session opened with a
status line, and the checks made before any engine work. (Tests replace `open_session`: commands call
it through this module.)"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import typer
from typer.core import TyperGroup

from kvlocal.errors import KvlocalError, UsageError
from kvlocal.route_settings import DEFAULT_CENTROID_BLOCK


class DefaultGroup(TyperGroup):
    """A command group whose first command runs when the next word names none of its commands:
    `kvlocal eval --lengths 8k` is `kvlocal eval grid --lengths 8k`; `--help` alone shows the group."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ctx.help_option_names):
            args = [next(iter(self.commands)), *args]
        return super().parse_args(ctx, args)


def err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def option_hint(setting: str | None) -> str:
    """The option that sets a core setting, as a hint after a core error (RouteConfig and Session
    fields are named as the options are: top_k is --top-k)."""
    return f" (option --{setting.replace('_', '-')})" if setting else ""


def handles_errors(fn):
    """One-line errors with the error's exit code; Ctrl-C exits 130 without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KvlocalError as e:
            err(f"kvlocal: error: {e}{option_hint(e.setting)}")
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err("\nkvlocal: interrupted")
            raise typer.Exit(130) from None
        except OSError as e:  # a file or folder kvlocal had to write or read (cache dir, --out)
            where = f": {e.filename}" if e.filename else ""
            err(f"kvlocal: error: {e.strerror or e}{where}")
            raise typer.Exit(1) from None

    return wrapper


def check_out_file(path: Path) -> None:
    """A file the command writes at its end: refuse a bad path before any work is done."""
    if path.is_dir():
        raise UsageError(f"--out {path} is a folder; give a file name")
    if not path.parent.is_dir():
        raise UsageError(f"--out {path}: the folder {path.parent} does not exist")


def check_lengths_fit(session, lengths: list[int]):
    """`session`, once every length fits its model's trained context."""
    too_long = [n for n in lengths if n > session.trained_ctx]
    if too_long:
        raise UsageError(f"context lengths {', '.join(map(str, too_long))} exceed the model's trained context "
                         f"{session.trained_ctx}")
    return session


def open_session(model, ctx, threads, kv_type, centroid_block=DEFAULT_CENTROID_BLOCK, centroid_type=None,
                 placement=None):
    """The session of `model` (it loads a document, or a set through kvlocal.library); centroids of
    `centroid_type`, or (None) the type of the model's route; layers on RPC servers by `placement`."""
    from kvlocal.progress import StatusLine, download_text
    from kvlocal.session import Session

    line = StatusLine()
    session = Session(
        model, n_ctx=ctx, threads=threads, kv_type=kv_type, centroid_block=centroid_block, centroid_type=centroid_type,
        placement=placement, model_progress=lambda d, t, s: line.show(download_text(d, t, s)),
    )
    line.done()
    return session
