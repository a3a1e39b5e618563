"""The route an answer takes, as the engine is told it: for a table of option combinations (the CLI's
own RouteOptions), on the tiny model with and without a calibrated route, over one document and a
set of two, the parameters that reach the C API (llama_kv_route_set, its budgets per layer and its
hints) equal those recorded in tests/route_params.json.

That file was written from the code before the route was resolved in one place
(`python tests/test_route_resolution.py --write FILE` on that tree), so this pins that resolving the
route once changed nothing the engine is asked to do. The recording forwards every call to the
engine: what is compared is what the engine ran with.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

from kvlocal import engine, route_settings  # noqa: E402
from kvlocal.cli_options import RouteOptions  # noqa: E402
from kvlocal.ingest import Document  # noqa: E402
from kvlocal.library import load_set  # noqa: E402
from kvlocal.session import Session  # noqa: E402

GOLDEN = Path(__file__).with_name("route_params.json")
# a calibrated route the tiny model (2 layers) can take: the default model's shape, its last layer wider
CALIBRATED = route_settings.ModelRoute(top_k=3, layer_top_k="1=8", centroid_type="q8_0", shortlist_floor=48)
A = Document(" ".join(f"entry {i}: the value is {i * 7 % 101}." for i in range(120)), "a.txt", "txt")
B = Document(" ".join(f"line {i} says {i * 13 % 97} apples, zanzibar {i}." if i == 40 else
                      f"line {i} says {i * 13 % 97} apples." for i in range(140)), "b.txt", "txt")
HINTED = "How many apples does zanzibar say?"  # a rare word of B: a hint
UNHINTED = "What is the value?"  # no rare word: no hint

# (name, calibrated, documents, route mode, RouteOptions fields, question)
SCENARIOS = [
    ("default", False, "A", "geometric", {}, HINTED),
    ("full", False, "A", "full", {}, HINTED),
    ("window", False, "A", "window", {}, HINTED),
    ("random", False, "A", "random", {}, HINTED),
    ("top-k 7", False, "A", "geometric", {"top_k": 7}, HINTED),
    ("hints 1", False, "B", "geometric", {"hints": 1}, HINTED),
    ("hints 1 top-k 1 steps", False, "B", "geometric", {"hints": 1, "top_k": 1, "question_pass": "steps"}, HINTED),
    ("question routed", False, "A", "geometric", {"question_pass": "routed", "question_top_k": 3}, HINTED),
    ("layer-top-k", False, "A", "geometric", {"layer_top_k": "1=6"}, HINTED),
    ("fixed shortlist", False, "A", "geometric", {"shortlist": 24, "keep": 0.5, "pin": 1}, HINTED),
    # a set read whole (what the recording ran; a focused answer: tests/test_library_focus.py)
    ("set", False, "AB", "geometric", {"focus": "set"}, HINTED),
    ("set unhinted", False, "AB", "geometric", {"focus": "set"}, UNHINTED),
    ("set top-k 2", False, "AB", "geometric", {"top_k": 2, "focus": "set"}, HINTED),
    ("set full", False, "AB", "full", {"focus": "set"}, HINTED),
    ("set window", False, "AB", "window", {"focus": "set"}, HINTED),
    ("calibrated", True, "A", "geometric", {}, HINTED),
    ("calibrated window", True, "A", "window", {}, HINTED),
    ("calibrated full", True, "A", "full", {}, HINTED),
    ("calibrated top-k 5", True, "A", "geometric", {"top_k": 5}, HINTED),
    ("calibrated layer-top-k", True, "A", "geometric", {"layer_top_k": "0=2"}, HINTED),
    ("calibrated fixed shortlist", True, "A", "geometric", {"shortlist": 16}, HINTED),
    ("calibrated hints 1", True, "B", "geometric", {"hints": 1}, HINTED),
    ("calibrated set", True, "AB", "geometric", {"focus": "set"}, HINTED),
    ("calibrated set unhinted", True, "AB", "geometric", {"focus": "set"}, UNHINTED),
    ("calibrated set question steps", True, "AB", "geometric", {"question_pass": "steps", "focus": "set"}, UNHINTED),
]
PARAMS = ("mode", "region_size", "top_k", "n_window", "n_sink", "seed", "n_shortlist", "keep", "top_k_batch",
          "n_pin", "attn")


class Recorder:
    """The engine's routing API, every call forwarded, the route settings it is given recorded."""

    def __init__(self, api) -> None:
        self.api = api
        self.calls: list[list] = []

    def __getattr__(self, name):
        real = getattr(self.api, name)
        if name == "llama_kv_route_set":
            def route_set(ctx, params):
                self.calls.append(["route", {f: round(getattr(params, f), 6) for f in PARAMS}])
                return real(ctx, params)
            return route_set
        if name in ("llama_kv_route_set_layer_top_k", "llama_kv_route_set_hints"):
            def set_list(ctx, values, n):
                self.calls.append([name.removeprefix("llama_kv_route_set_"), [values[i] for i in range(n)]])
                return real(ctx, values, n)
            return set_list
        return real


def applied(tiny_model: Path, scenario) -> dict:
    """What the engine is told while the scenario's question is answered (2 tokens): each routing call
    in order, and the answer's text."""
    _, calibrated, docs, mode, options, question = scenario
    session = Session(str(tiny_model), threads=2, n_ctx=None if len(docs) > 1 else 4096)
    try:
        load_set(session, [{"A": A, "B": B}[d] for d in docs])
        route = RouteOptions(**options).config(mode)
        recorder = Recorder(engine.route_api())
        real = engine.route_api
        engine.route_api = lambda: recorder
        try:
            text = session.answer(question, route=route, max_tokens=2).text
        finally:
            engine.route_api = real
        return {"calls": recorder.calls, "text": text}
    finally:
        session.close()


def calibrate(monkeypatch, tiny_model: Path, calibrated: bool) -> None:
    if calibrated:
        sha = hashlib.sha256(tiny_model.read_bytes()).hexdigest()
        monkeypatch.setitem(route_settings.MODEL_ROUTES, sha, CALIBRATED)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_the_engine_is_told_the_route_it_was_told_before(cache_dir, tiny_model, monkeypatch, scenario):
    want = json.loads(GOLDEN.read_text())[scenario[0]]
    calibrate(monkeypatch, tiny_model, scenario[1])
    assert applied(tiny_model, scenario) == want


def main() -> None:
    """--write FILE: record every scenario on this tree (a private cache; the tiny model in a temp dir)."""
    import os
    import tempfile

    from synth_gguf import make_tiny_model

    out = Path(sys.argv[sys.argv.index("--write") + 1])
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["KVLOCAL_CACHE_DIR"] = str(Path(tmp) / "cache")
        model = make_tiny_model(Path(tmp) / "models")
        sha = hashlib.sha256(model.read_bytes()).hexdigest()
        table = {}
        for scenario in SCENARIOS:
            if scenario[1]:
                route_settings.MODEL_ROUTES[sha] = CALIBRATED
            else:
                route_settings.MODEL_ROUTES.pop(sha, None)
            table[scenario[0]] = applied(model, scenario)
    out.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
