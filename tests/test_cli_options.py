"""The command line's options: declared once, shared by ask, tui, eval and bench, grouped in --help.

No engine or model: a command is stopped at its first engine work by a stand-in.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import typer
from typer.models import OptionInfo
from typer.testing import CliRunner

from kvlocal import cli, cli_common, cli_measure, cli_options
from kvlocal.cli import app
from kvlocal.cli_options import DISTRIBUTED, PREFILL, ROUTING, PrefillOptions, RouteOptions
from kvlocal.errors import UsageError

# every command with options: the measuring ones by their group and command (`eval grid`: what `eval` runs)
SHARED = ("ask", "tui", "demo", "eval grid", "eval quick", "eval library", "bench document", "bench library",
          "lab decode", "lab prefill", "lab hints")
ROUTING_OPTIONS = {"--top-k", "--region", "--window", "--sinks", "--shortlist", "--keep", "--follow", "--pin", "--hints", "--layer-top-k",
                   "--centroid-block", "--centroid-type", "--seed", "--question-pass", "--question-top-k", "--attention", "--focus"}
PREFILL_OPTIONS = {"--prefill", "--prefill-top-k", "--prefill-from", "--prefill-ubatch"}


def run(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "160", "TERM": "dumb"})


def panels(help_text: str) -> dict[str, list[str]]:
    """--help's panels, each with the options (long names) it lists, in order."""
    out: dict[str, list[str]] = {}
    name = None
    for line in help_text.splitlines():
        if title := re.match(r"\s*╭─ (.+?) ─", line):
            name = title.group(1)
            out[name] = []
        elif name and (option := re.match(r"\s*│ (?:\* *)?(--[\w-]+)", line)):
            out[name].append(option.group(1))
    return out


def command_options(name: str) -> dict[str, OptionInfo]:
    """The typer Option objects a command declares, by long name (as typer reads its signature)."""
    group, _, command = name.rpartition(" ")
    typers = [g.typer_instance for g in app.registered_groups if g.name == group] if group else [app]
    [info] = [c for t in typers for c in t.registered_commands if (c.name or c.callback.__name__.rstrip("_")) == command]
    found = {}
    for param in inspect.signature(info.callback, eval_str=True).parameters.values():
        for meta in getattr(param.annotation, "__metadata__", ()):
            if isinstance(meta, OptionInfo):
                long_names = [d for d in (meta.default, *(meta.param_decls or ())) if str(d).startswith("--")]
                found[long_names[0].split("/")[0]] = meta
    return found


def test_ask_help_shows_the_everyday_options_first_then_routing_then_prefill():
    result = run("ask", "--help")
    assert result.exit_code == 0, result.output
    shown = panels(result.output)
    assert list(shown) == ["Arguments", "Options", ROUTING, PREFILL, DISTRIBUTED]
    assert len(shown["Options"]) <= 10, shown["Options"]
    assert set(shown[DISTRIBUTED]) == {"--rpc", "--tensor-split"}
    assert {"--model", "--max-tokens", "--route", "--no-cache", "--ctx", "--threads"} <= set(shown["Options"])
    assert set(shown[ROUTING]) == ROUTING_OPTIONS
    assert set(shown[PREFILL]) == PREFILL_OPTIONS
    # defaults are shown, the model's route and a set's own too
    assert "[default: (the model's route, else 4; a set read whole: 1)]" in result.output


@pytest.mark.parametrize("command", ["tui", "eval grid", "bench document"])
def test_every_shared_command_puts_routing_and_prefill_tuning_in_their_panels(command):
    shown = panels(run(*command.split(), "--help").output)
    assert set(shown[ROUTING]) <= ROUTING_OPTIONS and {"--top-k", "--pin", "--shortlist"} <= set(shown[ROUTING])
    assert {"--prefill-top-k", "--prefill-from", "--prefill-ubatch"} <= set(shown[PREFILL])
    assert not (set(shown["Options"]) & (ROUTING_OPTIONS | PREFILL_OPTIONS))


def test_each_option_is_declared_once_and_shared():
    """An option two commands take is the same typer Option object in both (one declaration)."""
    by_name: dict[str, set[int]] = {}
    for command in SHARED:
        for name, option in command_options(command).items():
            by_name.setdefault(name, set()).add(id(option))
    assert {name for name, objects in by_name.items() if len(objects) > 1} == set()
    assert len(by_name) > 25
    assert {"--pin", "--top-k", "--prefill-top-k"} <= set(command_options("bench document")) & set(command_options("tui"))
    assert {"--lengths", "--out", "--seeds", "--haystack"} <= set(command_options("lab decode")) & set(command_options("eval library"))


def test_each_option_name_is_spelled_in_one_declaration():
    """In the command line's sources, a long name is declared once."""
    source = inspect.getsource(cli) + inspect.getsource(cli_measure) + inspect.getsource(cli_options)
    shared = {name for command in SHARED for name in command_options(command)}
    declared = re.findall(r'typer\.Option\(\s*"(--[\w-]+)', source)
    assert sorted(n for n in declared if declared.count(n) > 1) == []
    assert set(declared) >= shared - {"--help"}


def test_ask_and_its_help_do_not_import_textual():
    code = ("import sys\n"
            "from typer.testing import CliRunner\n"
            "from kvlocal.cli import app\n"
            "assert CliRunner().invoke(app, ['ask', '--help']).exit_code == 0\n"
            "print('textual' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("command", ["ask", "eval", "bench", "tui"])
@pytest.mark.parametrize("option", ["--estimate", "--no-estimate", "--prefill-estimate"])
def test_the_retired_estimate_switches_are_gone(command, option):
    args = ["ask", "doc.txt", "q?"] if command == "ask" else [command]
    result = run(*args, option)
    assert result.exit_code == 2 and "No such option" in result.output, result.output


def test_tui_parses_the_route_options_and_still_needs_a_terminal():
    result = run("tui", "--top-k", "8", "--pin", "1", "--route", "window", "--prefill", "routed",
                 "--prefill-top-k", "16", "--centroid-block", "16")
    assert result.exit_code == 2, result.output
    assert cli.TUI_NEEDS_TERMINAL in result.stderr
    bad = run("tui", "--top-k", "-1")
    assert bad.exit_code == 2 and "--top-k" in bad.output


def test_tui_hands_the_route_and_session_settings_to_the_app(monkeypatch):
    import kvlocal.tui.app as tui_app

    seen = {}
    monkeypatch.setattr(cli, "_check_terminal", lambda: None)
    monkeypatch.setattr(tui_app, "run_app", lambda **kwargs: seen.update(kwargs) or 0)
    result = run("tui", "--top-k", "8", "--pin", "1", "--route", "window", "--seed", "5", "--prefill", "routed",
                 "--prefill-top-k", "16", "--centroid-block", "16", "--centroid-type", "q8_0", "-n", "9")
    assert result.exit_code == 0, result.output
    route, prefill = seen["route"], seen["prefill"]
    assert (route.mode, route.top_k, route.pin, route.seed) == ("window", 8, 1, 5)
    assert (prefill.mode, prefill.top_k) == ("routed", 16)
    assert seen["max_tokens"] == 9
    assert seen["session_settings"]["centroid_block"] == 16 and seen["session_settings"]["centroid_type"] == "q8_0"


class _Stop(Exception):
    pass


def _stop_at_the_session(monkeypatch) -> list:
    """open_session records its arguments and hands back a session whose first use stops the command."""
    opened = []

    def open_session(*args):
        opened.append(args)
        return SimpleNamespace(trained_ctx=1 << 20, prefill_tag=lambda p: "dense")

    monkeypatch.setattr(cli_common, "open_session", open_session)
    return opened


def test_eval_hands_one_route_config_to_the_grid(monkeypatch, tmp_path):
    from kvlocal.evals import runner

    opened = _stop_at_the_session(monkeypatch)
    grids = []

    def run_grid(session, config, out, **kwargs):
        grids.append(config)
        raise UsageError("stop")

    monkeypatch.setattr(runner, "run_grid", run_grid)
    result = run("eval", "--out", str(tmp_path / "ev"), "--lengths", "2k", "--top-k", "3", "--pin", "1",
                 "--question-pass", "steps", "--prefill", "routed", "--prefill-top-k", "16", "--centroid-block", "16",
                 "--sweep", "2")
    assert result.exit_code == 2 and "stop" in result.stderr, result.output
    [config] = grids
    assert (config.route.top_k, config.route.pin, config.route.question) == (3, 1, "steps")
    assert (config.prefill.mode, config.prefill.top_k) == ("routed", 16)
    assert opened[0][-2:] == (16, None)  # None: the centroids of the model's route
    from kvlocal.route_settings import UNCALIBRATED_ROUTE
    from kvlocal.routing import resolve_route

    routes = list(replace(config, route=resolve_route(config.route, UNCALIBRATED_ROUTE)).routes())  # as run_grid
    assert [(r.mode, r.top_k) for r in routes] == [("full", 3), ("geometric", 3), ("window", 3), ("random", 3),
                                                  ("geometric", 2)]
    assert all(r.question == "steps" and r.region == config.route.region for r in routes)
    # `eval quick` runs its own grid: passkey at 2k, every mode at top-4
    grids.clear()
    run("eval", "quick", "--out", str(tmp_path / "quick"))
    assert (grids[0].route.top_k, grids[0].lengths, grids[0].tasks) == (4, [2048], ["passkey"])
    assert grids[0].modes == ["full", "geometric", "window", "random"]
    assert run("eval", "quick", "--top-k", "9").exit_code == 2  # no route tuning: the check is of the defaults


def test_eval_checks_every_mode_before_any_work(monkeypatch, tmp_path):
    opened = _stop_at_the_session(monkeypatch)
    result = run("eval", "--out", str(tmp_path / "ev"), "--modes", "full,sideways")
    assert result.exit_code == 2 and "unknown route mode 'sideways'" in result.stderr
    assert not opened


def test_option_groups_build_the_cores_configs():
    route = RouteOptions(top_k=3, question_pass="steps").config("random", seed=7)
    assert (route.mode, route.top_k, route.question, route.seed) == ("random", 3, "steps", 7)
    with pytest.raises(UsageError) as info:
        RouteOptions(region=32, centroid_block=64).config("geometric")
    assert info.value.setting == "region"
    with pytest.raises(UsageError):
        RouteOptions(centroid_type="q4_0").config("geometric")
    prefill = PrefillOptions(prefill_top_k=16, prefill_from=0, prefill_ubatch=128).config("routed")
    assert (prefill.mode, prefill.top_k, prefill.start, prefill.ubatch) == ("routed", 16, 0, 128)


def test_a_command_with_an_option_group_still_gets_its_own_options():
    """option_groups shows typer the group's fields in the group parameter's place."""
    from kvlocal.cli_options import option_groups

    @option_groups
    def command(name: str, routing: RouteOptions = RouteOptions(), loud: bool = False):
        return name, routing, loud

    names = list(inspect.signature(command).parameters)
    assert names[0] == "name" and names[-1] == "loud" and names[1:-1] == [f for f in RouteOptions.__dataclass_fields__]
    assert command("x", top_k=2, loud=True) == ("x", RouteOptions(top_k=2), True)
    small = typer.Typer()
    small.command()(command)
    assert CliRunner().invoke(small, ["x", "--pin", "0"]).exit_code == 0


def test_the_option_groups_cover_the_cores_settings():
    """RouteOptions mirrors RouteConfig's settings (apart, so --help loads no numpy or engine): every
    setting but the mode and the seed (a command's own options) has its option, with the same default."""
    import dataclasses

    from kvlocal.routing import DEFAULT_ROUTE, PrefillConfig, RouteConfig

    core = {f.name for f in dataclasses.fields(RouteConfig)} - {"mode", "seed"}  # a command's own options
    cli_names = {"question" if f.name == "question_pass" else f.name for f in dataclasses.fields(RouteOptions)}
    assert cli_names - {"centroid_block", "centroid_type"} == core  # the centroids are the session's
    assert RouteOptions().config(RouteConfig().mode) == DEFAULT_ROUTE  # nothing given
    assert len(dataclasses.fields(PrefillOptions)) == len(dataclasses.fields(PrefillConfig)) - 1  # but the mode
    assert PrefillOptions().config(PrefillConfig().mode) == PrefillConfig()


def _resolved(options: dict, mode: str = "geometric", n_documents: int = 1, calibrated=None, hints=None,
              n_cells=None):
    """The route `options` resolve to (kvlocal.routing.resolve_route), `hints` the cells the question's
    words would hint (None: no question yet)."""
    from kvlocal.route_settings import UNCALIBRATED_ROUTE
    from kvlocal.routing import RouteFacts, resolve_route

    finder = None if hints is None else (lambda n, region, skip: hints[:2 * n])
    facts = RouteFacts(n_documents, n_cells, finder)
    return resolve_route(RouteOptions(**options).config(mode), calibrated or UNCALIBRATED_ROUTE, facts)


def test_a_set_route_follows_the_set_until_top_k_hints_or_the_question_pass_is_given():
    """--top-k, --hints and --question-pass default to None: a route at its defaults follows the set.
    Read whole (--focus set), the library route over several documents, the single-document one for a
    question without hints; giving any of them takes the route as given, the others at their
    single-document defaults. Focused on the hinted document (the default), the single-document route:
    the session resolves the focused answer as one document of the cells it sees."""
    from kvlocal.route_settings import DEFAULT_QUESTION, DEFAULT_TOP_K, LIBRARY_HINTS, LIBRARY_QUESTION, LIBRARY_TOP_K

    one = _resolved({})
    assert (one.top_k, one.hints, one.question, one.focus) == (DEFAULT_TOP_K, 0, DEFAULT_QUESTION, "set")
    assert _resolved({}, n_documents=4) == replace(one, focus="hinted")  # before the question: its intent
    whole = {"focus": "set"}
    library = _resolved(whole, n_documents=4)
    assert (library.top_k, library.hints, library.question) == (LIBRARY_TOP_K, LIBRARY_HINTS, LIBRARY_QUESTION)
    hinted = _resolved(whole, n_documents=4, hints=[640, 650], n_cells=64 * 40)
    assert hinted == replace(library, hint_cells=(640, 650), shortlist=16)
    assert _resolved(whole, n_documents=4, hints=[], n_cells=64 * 40) == replace(one, shortlist=16)
    assert _resolved(whole, "full", n_documents=4) == _resolved({}, "full")
    for given in ({"top_k": 4}, {"hints": 0}, {"question_pass": "dense"}):
        assert _resolved({**whole, **given}, n_documents=4) == _resolved(given) == one
    assert "a set read whole: 1" in " ".join(run("ask", "--help").output.split())


def test_a_route_follows_the_model_until_top_k_or_layer_top_k_is_given():
    """--top-k and --layer-top-k default to None: the route takes the model's calibrated budget (top-k,
    budgets per layer, the automatic shortlist's floor); giving either takes the route as given. A set's
    library route keeps its own top-k and no budget per layer, and its fallback for an unhinted
    question takes the model's."""
    from kvlocal.route_settings import LIBRARY_TOP_K, SHORTLIST_AUTO, ModelRoute
    from kvlocal.routing import Route

    calibrated = ModelRoute(top_k=3, layer_top_k="2-3=8", centroid_type="q8_0", shortlist_floor=48)
    own = _resolved({}, calibrated=calibrated)
    assert (own.top_k, own.layer_top_k, own.shortlist_floor, own.shortlist) == (3, "2-3=8", 48, SHORTLIST_AUTO)
    assert own.shortlist_at(8192) == 48  # the floor: an eighth of 128 regions is 16
    assert own.shortlist_at(32768 * 4) == 256  # past the floor: an eighth of 2,048 regions
    assert _resolved({}, calibrated=calibrated, n_cells=8192).shortlist == 48
    assert _resolved({}) == Route(focus="set")  # one document: nothing to focus on
    assert _resolved({"shortlist": 32}, calibrated=calibrated).shortlist_floor == 0
    for given in ({"top_k": 4}, {"layer_top_k": ""}, {"layer_top_k": "0=2"}):
        assert _resolved(given, calibrated=calibrated) == _resolved(given)
    library = _resolved({"focus": "set"}, n_documents=4, calibrated=calibrated)
    assert (library.top_k, library.layer_top_k, library.shortlist_floor) == (LIBRARY_TOP_K, "", 0)
    unhinted = _resolved({"focus": "set"}, n_documents=4, calibrated=calibrated, hints=[])
    assert unhinted == own
    assert _resolved({}, "window", calibrated=calibrated).layer_top_k == "2-3=8"  # the controls: same budget


def test_a_route_resolved_before_is_taken_as_it_is():
    """A Route (resolved before, perhaps tuned: the TUI's keys, an eval's sweep) keeps its settings;
    only the document's and the question's facts are added."""
    from kvlocal.route_settings import ModelRoute
    from kvlocal.routing import Route, RouteFacts, resolve_route

    calibrated = ModelRoute(top_k=3, layer_top_k="2-3=8", shortlist_floor=48)
    tuned = replace(_resolved({}, n_documents=4), top_k=5)
    assert resolve_route(tuned, calibrated, RouteFacts(4)) == tuned
    found = resolve_route(tuned, calibrated, RouteFacts(4, 64 * 40, lambda n, region, skip: []))
    assert found == replace(tuned, shortlist=16)  # no fallback: a tuned route was asked for
    assert resolve_route(Route(mode="window"), calibrated) == Route(mode="window", focus="set")  # one document
