"""Command-line arguments checked before any work: bounds of every number, text that is not UTF-8, the TUI's terminal.

None of these tests needs the engine or a model: `cli_common.open_session` is replaced by one that fails the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvlocal import cli, cli_common, route_settings
from kvlocal.cli import app
from kvlocal.errors import UsageError

DOC = "Line 1: the gauge at post 1 read 13 units.\nLine 2: the gauge at post 2 read 26 units.\n"
HUGE = "99999999999999999999"  # wrapped silently to 1661992959 in ctypes


@pytest.fixture
def doc(tmp_path) -> Path:
    path = tmp_path / "report.txt"
    path.write_text(DOC)
    return path


@pytest.fixture
def no_engine(monkeypatch):
    """Opening a session (loading the model, prefilling) fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("engine work started before the arguments were checked")

    monkeypatch.setattr(cli_common, "open_session", refuse)


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def assert_usage_error(result, option: str) -> None:
    """Exit 2 with a one-line message naming the option, no traceback."""
    assert result.exit_code == 2, (option, result.output)
    assert option in result.stderr and "Traceback" not in result.stderr


# -- bounds -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option, value",
    [
        ("--top-k", "2147483648"),
        ("--top-k", HUGE),
        ("--top-k", "-1"),
        ("--window", "4294967040"),
        ("--window", HUGE),
        ("--sinks", "4294967040"),
        ("--shortlist", "2147483648"),
        ("--region", "4294967296"),
        ("--centroid-block", "4294967296"),
        ("--seed", "4294967296"),
        ("--ctx", "2147483648"),
        ("--ctx", HUGE),
        ("--ctx", "100"),
        ("--max-tokens", "2147483648"),
        ("--max-tokens", HUGE),
        ("--question-top-k", "2147483648"),
        ("--prefill-top-k", "0"),
        ("--prefill-top-k", HUGE),
        ("--prefill-from", HUGE),
    ],
)
def test_ask_refuses_out_of_range_numbers_before_any_work(no_engine, doc, option, value):
    result = run("ask", str(doc), "What did post 1 read?", option, value)
    assert_usage_error(result, option)


def test_ask_refuses_an_unknown_question_pass_before_any_work(no_engine, doc):
    result = run("ask", str(doc), "What did post 1 read?", "--question-pass", "sideways")
    assert_usage_error(result, "the question pass must be one of dense, routed, steps (got 'sideways') "
                               "(option --question-pass)")


@pytest.mark.parametrize("command", ["ask", "eval", "tui"])
def test_an_unknown_prefill_is_refused_before_any_work(no_engine, doc, tmp_path, command):
    args = {"ask": ["ask", str(doc), "What did post 1 read?"], "eval": ["eval", "--out", str(tmp_path / "ev")],
            "tui": ["tui", str(doc)]}[command]
    result = run(*args, "--prefill", "sparse")
    assert_usage_error(result, "the prefill must be one of dense, routed (got 'sparse') (option --prefill)")


@pytest.mark.parametrize("command", ["ask", "eval", "bench"])
def test_an_unknown_centroid_type_is_refused_before_any_work(no_engine, doc, tmp_path, command):
    args = {"ask": ["ask", str(doc), "What did post 1 read?"], "eval": ["eval", "--out", str(tmp_path / "ev")],
            "bench": ["bench"]}[command]
    result = run(*args, "--centroid-type", "q4_0")
    assert_usage_error(result, "the centroid type must be one of f16, q8_0 (got 'q4_0') (option --centroid-type)")
    assert not (tmp_path / "ev").exists()


@pytest.mark.parametrize("option", ["--pin", "--follow"])
@pytest.mark.parametrize("value", ["-1", str(route_settings.MAX_TOP_K + 1)])
def test_pins_and_followers_out_of_bounds_are_refused_before_any_work(no_engine, doc, option, value):
    result = run("ask", str(doc), "What did post 1 read?", option, value)
    assert result.exit_code == 2, result.output


def test_the_pin_setting_is_bounded_and_part_of_top_k():
    from kvlocal.routing import Route, RouteConfig

    with pytest.raises(UsageError) as info:
        RouteConfig(pin=-1)
    assert info.value.setting == "pin"
    assert "2 pinned by the question" in Route(top_k=4, pin=2, keep=0.9, question="dense").describe()
    assert "1 pinned by the question" in Route(top_k=1, pin=2, keep=0.9, question="dense").describe()
    assert "pinned" not in Route(top_k=4, pin=2, keep=0.9, question="steps").describe()


def test_the_follow_setting_is_bounded_acts_with_the_memory_and_keys_its_rows():
    from kvlocal.evals.report import route_label
    from kvlocal.evals.runner import route_key
    from kvlocal.routing import Route, RouteConfig

    with pytest.raises(UsageError) as info:
        RouteConfig(follow=-1)
    assert info.value.setting == "follow"
    assert Route(top_k=3, follow=1, keep=0.9, question="dense").follows == 1
    assert Route(top_k=1, follow=2, keep=0.9, question="dense").follows == 1  # at most top-k
    assert Route(top_k=3, follow=1, keep=0.0, question="dense").follows == 0  # only with the selection memory
    assert Route(mode="window", top_k=3, follow=1, keep=0.9, question="dense").follows == 0
    assert "the next region of the first 1 read too" in Route(top_k=3, follow=1, keep=0.9, question="dense").describe()
    row = {"mode": "geometric", "top_k": 3, "region": 64, "window": 128, "sinks": 64, "keep": 0.9}
    assert route_key({**row, "follow": 1}) != route_key(row) == route_key({**row, "follow": 0})
    assert "follow 1" in route_label({**row, "follow": 1}) and "follow" not in route_label(row)


def test_ask_refuses_an_unknown_centroid_block_before_any_work(no_engine, doc):
    result = run("ask", str(doc), "What did post 1 read?", "--centroid-block", "5", "--region", "64")
    assert result.exit_code == 2, result.output
    assert "the centroid block must be one of" in result.stderr and "(option --centroid-block)" in result.stderr


@pytest.mark.parametrize(
    "args, option",
    [
        (["--depths", "1000000"], "--depths"),
        (["--max-tokens", HUGE], "--max-tokens"),
        (["--sweep", f"2,{HUGE}"], "--sweep"),
        (["--sweep", "4294967296"], "--sweep"),
        (["--lengths", "2147483648"], "--lengths"),
        (["--lengths", "8k,99999999k"], "--lengths"),
        (["--top-k", "2147483648"], "--top-k"),
        (["--window", "4294967040"], "--window"),
        (["--shortlist", HUGE], "--shortlist"),
    ],
)
def test_eval_refuses_out_of_range_numbers_before_any_work(no_engine, tmp_path, args, option):
    out = tmp_path / "ev"
    result = run("eval", "--lengths", "2k", "--depths", "2", "--no-plots", "--out", str(out), *args)
    assert_usage_error(result, option)
    assert not out.exists()


@pytest.mark.parametrize(
    "args, option",
    [
        (["--budgets", "4,2147483648"], "--budgets"),
        (["--budgets", HUGE], "--budgets"),
        (["--depths", "1000000"], "--depths"),
        (["--lengths", "4294967296"], "--lengths"),
        (["--window", "4294967040"], "--window"),
        (["--sinks", HUGE], "--sinks"),
        (["--region", "48"], "--region"),
        (["--region", "4294967296"], "--region"),
    ],
)
def test_lab_refuses_out_of_range_numbers_before_any_work(no_engine, tmp_path, args, option):
    out = tmp_path / "lab"
    result = run("lab", "--out", str(out), *args)
    assert_usage_error(result, option)
    assert not out.exists()


@pytest.mark.parametrize(
    "args, option",
    [
        (["--tokens", "2147483648"], "--tokens"),
        (["--top-k", "2147483648"], "--top-k"),
        (["--sinks", "4294967040"], "--sinks"),
        (["--lengths", "2147483648"], "--lengths"),
        (["--prefill-top-k", "0"], "--prefill-top-k"),
        (["--prefill-from", HUGE], "--prefill-from"),
    ],
)
def test_bench_refuses_out_of_range_numbers_before_any_work(no_engine, args, option):
    result = run("bench", "--lengths", "2k", *args)
    assert_usage_error(result, option)


def test_route_config_refuses_what_the_cli_refuses():
    """The core holds the same bounds (route_settings), so no caller can hand the engine a wrapped int;
    its errors name the setting (for a front end's hint), not a command-line option."""
    from kvlocal.routing import RouteConfig, check_region_block

    rs = route_settings
    RouteConfig(top_k=rs.MAX_TOP_K, window=rs.MAX_WINDOW, sinks=rs.MAX_SINKS, shortlist=rs.MAX_SHORTLIST,
                seed=rs.MAX_SEED)
    RouteConfig(top_k=0, window=0, sinks=0, shortlist=0)
    def refused(setting, call, *args, **kwargs):
        with pytest.raises(UsageError) as info:
            call(*args, **kwargs)
        assert info.value.setting == setting and "--" not in str(info.value)

    for field, top in (("top_k", rs.MAX_TOP_K), ("window", rs.MAX_WINDOW), ("sinks", rs.MAX_SINKS),
                       ("shortlist", rs.MAX_SHORTLIST), ("seed", rs.MAX_SEED)):
        wrapping = (2**31, 2**32 - 256) if field != "seed" else ()  # wrap in an int32
        below = -2 if field == "shortlist" else -1  # -1 is SHORTLIST_AUTO
        for value in (top + 1, 10**20, below, *wrapping):
            refused(field, RouteConfig, **{field: value})
    for region in (0, 48, 512, 2**32):
        refused("region", RouteConfig, region=region)
    refused("centroid_block", check_region_block, 64, 5)
    refused("centroid_block", check_region_block, 64, 2**32)
    refused("region", check_region_block, 32, 64)
    check_region_block(64, 0)
    check_region_block(64, 16)


def test_an_automatic_shortlist_follows_the_document():
    """auto: an eighth of the document's regions, rounded up to a multiple of 16 (at least 16),
    resolved once per answer from the document's length."""
    from dataclasses import replace

    from kvlocal.routing import Route, RouteConfig, RouteFacts, resolve_route

    rs = route_settings
    assert [rs.auto_shortlist(n) for n in (0, 1, 128, 129, 256, 482, 1024)] == [16, 16, 16, 32, 32, 64, 128]
    auto = Route(shortlist=rs.SHORTLIST_AUTO)
    assert [auto.shortlist_at(n) for n in (6_967, 16_000, 30_836)] == [16, 32, 64]
    assert Route(shortlist=rs.SHORTLIST_AUTO, region=32).shortlist_at(16_000) == 64
    assert Route(shortlist=24).shortlist_at(30_836) == 24
    assert replace(auto, shortlist_floor=48).shortlist_at(16_000) == 48  # a calibrated route's floor
    assert "shortlist by document" in auto.describe() and "shortlist 64" in replace(auto, shortlist=64).describe()
    resolved = resolve_route(RouteConfig(), rs.UNCALIBRATED_ROUTE, RouteFacts(n_cells=30_836))
    assert resolved.shortlist == 64


def test_shortlist_option_takes_a_number_or_auto():
    from kvlocal.cli_options import _shortlist_value

    assert _shortlist_value("auto") == _shortlist_value("AUTO") == route_settings.SHORTLIST_AUTO
    assert _shortlist_value("0") == 0 and _shortlist_value("32") == 32
    for bad in ("-1", "many", str(route_settings.MAX_SHORTLIST + 1)):
        with pytest.raises(typer.BadParameter):
            _shortlist_value(bad)


def test_cli_bounds_are_route_settings():
    """The CLI's limits are route_settings' names (one home), and the engine's 32-bit ints hold them."""
    from kvlocal import cli_options as opts

    rs = route_settings
    assert (opts.MAX_TOP_K, opts.MAX_WINDOW, opts.MAX_SINKS, opts.MAX_SHORTLIST, opts.MAX_SEED, opts.MAX_CTX) == (
        rs.MAX_TOP_K, rs.MAX_WINDOW, rs.MAX_SINKS, rs.MAX_SHORTLIST, rs.MAX_SEED, rs.MAX_CTX)
    assert max(rs.MAX_TOP_K, rs.MAX_WINDOW, rs.MAX_SINKS, rs.MAX_SHORTLIST, rs.MAX_CTX, rs.MAX_ANSWER_TOKENS) < 2**31
    assert rs.MAX_SEED == 2**32 - 1


# -- text that is not UTF-8 -------------------------------------------------------------------------


def test_text_arg_turns_escaped_bytes_into_replacement_characters():
    assert cli._text_arg("caf\udce9?") == "caf\ufffd?"  # b"caf\xe9?" from a Latin-1 terminal
    assert cli._text_arg("café?") == "café?"  # valid text is kept
    assert cli._text_arg("\udcc3\udca9") == "é"  # escaped bytes are read back as UTF-8 where they are UTF-8
    assert cli._text_arg("\udce9\udce9") == "\ufffd\ufffd"
    assert cli._text_arg("a\ud800b") == "a?b"  # a lone surrogate surrogateescape did not make
    for text in ("caf\udce9?", "a\ud800b"):
        cli._text_arg(text).encode("utf-8")  # never raises


class _RecordingSession:
    """Records what the CLI asks; the answer step stops the command with a usage error."""

    def __init__(self):
        self.questions: list[str] = []

    def ask(self, question, **kwargs):
        question.encode("utf-8")  # what the tokenizer does: UnicodeEncodeError on a lone surrogate
        self.questions.append(question)
        raise UsageError("stop: the question reached the answer step")
        yield  # a generator, as Session.ask


@pytest.mark.parametrize("name", ["report.txt", os.fsdecode(b"caf\xe9-report.txt")])
def test_a_question_with_bytes_that_are_not_utf8_reaches_the_answer(monkeypatch, tmp_path, name):
    """`kvlocal ask doc.txt $'caf\\xe9?'`: the question is decoded with U+FFFD; the document path (which may
    hold such bytes too) still opens its file."""
    path = tmp_path / name
    path.write_text(DOC)
    session = _RecordingSession()
    loaded = []
    monkeypatch.setattr(cli_common, "open_session", lambda *a, **k: session)
    monkeypatch.setattr(cli, "_load", lambda s, text, label, use_cache, prefill=None, pages=(): loaded.append((text, label)))
    result = run("ask", str(path), "What did post 1 read at the caf\udce9?")
    assert "UnicodeEncodeError" not in repr(result.exception), result.exception
    assert result.exit_code == 2, (result.output, result.exception)
    assert "reached the answer step" in result.stderr
    assert session.questions == ["What did post 1 read at the caf\ufffd?"]
    assert loaded and loaded[0][0].startswith("Line 1:")


# -- the TUI needs a terminal -----------------------------------------------------------------------


def test_tui_refuses_without_a_terminal_before_importing_textual(tmp_path):
    """CliRunner's stdin and stdout are not TTYs: one-line usage error, exit 2, textual not imported."""
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from kvlocal.cli import app\n"
        "r = CliRunner().invoke(app, ['tui'])\n"
        "print(r.exit_code)\n"
        "print(repr(r.stderr))\n"
        "print('textual' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TERM": "xterm-256color"})
    assert out.returncode == 0, out.stderr
    exit_code, stderr, textual = out.stdout.strip().splitlines()
    assert exit_code == "2"
    assert eval(stderr) == f"kvlocal: error: {cli.TUI_NEEDS_TERMINAL}\n"  # one line
    assert "\x1b[" not in eval(stderr)
    assert textual == "False"


class _Tty:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(
    "stdin, stdout, term, ok",
    [
        (True, True, "xterm-256color", True),
        (True, True, "dumb", False),
        (False, True, "xterm", False),
        (True, False, "xterm", False),
    ],
)
def test_tui_terminal_check(monkeypatch, stdin, stdout, term, ok):
    monkeypatch.setattr(sys, "stdin", _Tty(stdin))
    monkeypatch.setattr(sys, "stdout", _Tty(stdout))
    monkeypatch.setenv("TERM", term)
    if ok:
        cli._check_terminal()
    else:
        with pytest.raises(UsageError, match="needs an interactive terminal"):
            cli._check_terminal()


def test_tui_exit_code_130_when_interrupted(monkeypatch):
    import kvlocal.tui.app as tui_app

    monkeypatch.setattr(cli, "_check_terminal", lambda: None)
    monkeypatch.setattr(tui_app, "run_app", lambda **kwargs: 130)
    result = run("tui")
    assert result.exit_code == 130 and "interrupted" in result.stderr
    monkeypatch.setattr(tui_app, "run_app", lambda **kwargs: 0)
    assert run("tui").exit_code == 0
