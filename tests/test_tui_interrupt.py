"""Interrupting the app: ctrl+c and SIGINT exit with code 130 (as the CLI does) and cancel a running prefill."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from test_tui import DOC, FakeSession, fake_app, wait_for
from textual.widgets import Input

from kvlocal.errors import CancelledError


class HeldSession(FakeSession):
    """A FakeSession whose prefill waits for the cancel event, recording how load_document ended."""

    def __init__(self):
        super().__init__()
        self.hold_prefill = True
        self.ended = threading.Event()
        self.outcome: str | None = None

    def load_document(self, text, **kwargs):
        try:
            result = super().load_document(text, **kwargs)
        except CancelledError:
            self.outcome = "cancelled"
            raise
        else:
            self.outcome = "loaded"
            return result
        finally:
            self.ended.set()


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "report.txt"
    path.write_text(DOC)
    return path


def _assert_prefill_cancelled(session: HeldSession) -> None:
    # the prefill returned well before the 30 s it holds without a cancel
    assert session.ended.wait(timeout=10), "the prefill was not cancelled"
    assert session.outcome == "cancelled"
    assert session.n_prefix == 0 and not session.saved  # nothing loaded, nothing saved


@pytest.mark.asyncio
async def test_ctrl_c_during_prefill_cancels_it_and_exits_130(doc):
    session = HeldSession()
    app = fake_app(doc, session)
    started = time.monotonic()
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.busy == "load" and app._load_screen is not None)
        await pilot.press("ctrl+c")
    _assert_prefill_cancelled(session)
    assert app.return_code == 130
    assert time.monotonic() - started < 20


@pytest.mark.asyncio
async def test_ctrl_c_copies_a_selection_in_the_input_and_otherwise_exits_130(doc):
    app = fake_app(None)
    async with app.run_test(size=(80, 24)) as pilot:
        question = app.query_one("#question", Input)
        question.focus()
        await pilot.press(*"post 7")
        question.select_all()
        await pilot.pause()
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert app.clipboard == "post 7" and app.return_code is None  # copied, still running
        await pilot.press("end")  # no selection: ctrl+c interrupts
        await pilot.press("ctrl+c")
    assert app.return_code == 130


@pytest.mark.asyncio
async def test_sigint_during_prefill_cancels_it_and_exits_130(doc):
    """kill -INT: the handler the app installs cancels the prefill and exits 130, with no KeyboardInterrupt."""
    session = HeldSession()
    app = fake_app(doc, session, handle_sigint=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.busy == "load" and app._load_screen is not None)
        assert app._sigint_loop is not None, "no SIGINT handler installed"  # else the kill below stops pytest
        os.kill(os.getpid(), signal.SIGINT)
        await wait_for(pilot, lambda: app.return_code is not None, timeout=10)
    _assert_prefill_cancelled(session)
    assert app.return_code == 130
    # the handler is gone with the app: SIGINT is Python's KeyboardInterrupt again
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.asyncio
async def test_quit_exits_0_and_cancels_the_prefill(doc):
    session = HeldSession()
    app = fake_app(doc, session)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.busy == "load" and app._load_screen is not None)
        await pilot.press("ctrl+q")
    _assert_prefill_cancelled(session)
    assert not app.return_code
