"""Budgets per layer (llama_kv_route_set_layer_top_k, `--layer-top-k`) on the tiny synthetic model:
each layer gathers its own number of regions, the controls gather as many per layer, every region
in every layer is dense attention, and the read counts are what the layers gathered."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytestmark = pytest.mark.engine

from engine_probe import RawContext, context_with_document, routed_steps  # noqa: E402

from kvlocal.engine import apply_route, llama_cpp, route_api  # noqa: E402
from kvlocal.errors import UsageError  # noqa: E402
from kvlocal.routing import Route, RouteConfig  # noqa: E402

N_DOC = 1500  # 24 regions of 64 cells: region 0 the sinks, 22-23 the window
N_LAYER, N_HEAD_KV, HEAD_DIM = 2, 2, 16  # the tiny qwen2
FIXED = 3  # regions read whatever the route: 1 sink, 2 window


@pytest.fixture(scope="module")
def raw(tiny_model):
    ctx = context_with_document(tiny_model, N_DOC)
    yield ctx
    ctx.close()


def steps(raw: RawContext, route: Route, tokens=(5,), hints: list[int] | None = None):
    """Decode `tokens` after the document under `route` (and hinted cells); rewound after."""
    m = llama_cpp()
    cells = (ctypes.c_int32 * max(1, len(hints or [])))(*(hints or []))
    route_api().llama_kv_route_set_hints(raw.ctx, cells, len(hints or []))
    try:
        return routed_steps(raw, list(tokens), route)
    finally:
        m.llama_memory_seq_rm(m.llama_get_memory(raw.ctx), 0, N_DOC, -1)
        raw.n_past = N_DOC
        route_api().llama_kv_route_set_hints(raw.ctx, cells, 0)


def per_layer(stats) -> list[list[list[int]]]:
    """The regions each layer and head gathered, the padding left out."""
    return [[[int(r) for r in head if r >= 0] for head in layer] for layer in stats.regions]


def test_each_layer_gathers_its_own_budget_and_the_counts_are_exact(raw):
    [(_, st)] = steps(raw, Route(mode="geometric", top_k=2, region=64, layer_top_k="1=5"))
    assert st.n_sel == FIXED + 5  # the layer that gathers the most
    layers = per_layer(st)
    for head in range(N_HEAD_KV):
        assert len(layers[0][head]) == FIXED + 2 and len(layers[1][head]) == FIXED + 5
        assert list(st.regions[0, head, FIXED + 2:]) == [-1] * 3  # the smaller layer's padding
        for layer in layers:
            assert len(set(layer[head])) == len(layer[head]) and {0, 22, 23} <= set(layer[head])
    assert st.rows_read == N_HEAD_KV * 64 * ((FIXED + 2) + (FIXED + 5))
    assert st.bytes_kv == st.rows_read * 2 * HEAD_DIM * 2  # K and V rows, f16


@pytest.mark.parametrize("mode", ["window", "random"])
def test_the_controls_read_as_many_regions_per_layer(raw, mode):
    [(_, geo)] = steps(raw, Route(mode="geometric", top_k=2, region=64, layer_top_k="0=4"))
    [(_, ctl)] = steps(raw, Route(mode=mode, top_k=2, region=64, layer_top_k="0=4", seed=3))
    assert (ctl.n_sel, ctl.rows_read, ctl.bytes_kv) == (geo.n_sel, geo.rows_read, geo.bytes_kv)
    layers = per_layer(ctl)
    for head in range(N_HEAD_KV):
        assert [len(layer[head]) for layer in layers] == [FIXED + 4, FIXED + 2]
        if mode == "window":  # the regions just before the window, as many as the layer's budget
            assert sorted(layers[0][head]) == [0, 18, 19, 20, 21, 22, 23]
            assert sorted(layers[1][head]) == [0, 20, 21, 22, 23]
        else:
            for layer in layers:
                assert len(set(layer[head])) == len(layer[head]) and max(layer[head]) <= 23


def test_every_region_in_every_layer_is_dense_attention_and_one_layer_is_not(raw):
    tokens = (5, 17, 42)
    dense = steps(raw, Route(mode="full"), tokens)
    every = steps(raw, Route(mode="geometric", top_k=1, region=64, shortlist=0, layer_top_k="0-1=1000"), tokens)
    one = steps(raw, Route(mode="geometric", top_k=1, region=64, shortlist=0, layer_top_k="0=1000"), tokens)
    diff = max(float(np.max(np.abs(a[0] - b[0]))) for a, b in zip(dense, every))
    assert diff <= 5e-3, diff  # the flash-attention summation order, as in test_routing's oracle
    assert max(float(np.max(np.abs(a[0] - b[0]))) for a, b in zip(dense, one)) > diff
    assert all(s.n_layer_routed == N_LAYER for _, s in every)


def test_the_same_budget_in_every_layer_is_the_route_without_budgets(raw):
    tokens = (5, 17)
    plain = steps(raw, Route(mode="geometric", top_k=3, region=64), tokens)
    same = steps(raw, Route(mode="geometric", top_k=1, region=64, pin=1, layer_top_k="0-1=3"), tokens)
    for (la, sa), (lb, sb) in zip(plain, same):
        assert np.array_equal(la, lb)
        assert np.array_equal(sa.regions, sb.regions) and sa.rows_read == sb.rows_read
    # and the budgets are cleared by a route without them (the next step reads top-k everywhere)
    [(_, after)] = steps(raw, Route(mode="geometric", top_k=1, region=64))
    assert after.n_sel == FIXED + 1 and (after.regions >= 0).all()


def test_a_layer_whose_budget_the_hints_take_routes_nothing_more(raw):
    route = Route(mode="geometric", top_k=1, region=64, pin=1, layer_top_k="1=3")
    [(_, plain)] = steps(raw, route)
    unread = sorted(set(range(1, 22)) - {r for layer in per_layer(plain) for head in layer for r in head})[0]
    [(_, hinted)] = steps(raw, route, hints=[unread * 64 + 5])
    layers = per_layer(hinted)
    for head in range(N_HEAD_KV):
        assert sorted(layers[0][head]) == sorted([0, 22, 23, unread])  # the hint took layer 0's one region
        assert unread in layers[1][head] and len(layers[1][head]) == FIXED + 3
    assert hinted.rows_read == plain.rows_read


def test_budgets_the_engine_or_the_model_cannot_take_are_refused(raw):
    api = route_api()
    values = (ctypes.c_int32 * 3)(2, 2, 2)
    assert api.llama_kv_route_set_layer_top_k(raw.ctx, values, 3) == -1  # the model has 2 layers
    zero = (ctypes.c_int32 * 2)(2, 0)
    assert api.llama_kv_route_set_layer_top_k(raw.ctx, zero, 2) == -1
    assert api.llama_kv_route_set_layer_top_k(raw.ctx, values, 0) == 0  # clears
    with pytest.raises(UsageError, match="layers 0-1"):
        apply_route(raw.ctx, Route(layer_top_k="2=4"))
    for spec in ("x", "3-1=2", "1=0", "16-23"):
        with pytest.raises(UsageError, match="--layer-top-k"):
            Route(layer_top_k=spec)
    with pytest.raises(UsageError, match="top-k of at least 1"):
        Route(top_k=0, layer_top_k="1=2")


def test_a_model_with_a_calibrated_route_answers_with_its_budget_by_default(tiny_model, tmp_path, monkeypatch):
    """route_settings.MODEL_ROUTES gives a model file (by its sha256) a route of its own: the session
    keeps its centroids in the route's type, an answer at the defaults gathers the route's regions per
    layer with the shortlist's floor, and a route given with a top-k reads as given."""
    from kvlocal import route_settings
    from kvlocal.session import Session

    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(tmp_path))
    text = " ".join(f"entry {i}: value {i * 7 % 101}." for i in range(120))  # about 2.4k tokens
    plain = Session(str(tiny_model), threads=2)
    assert plain.calibrated_route == route_settings.UNCALIBRATED_ROUTE and plain.centroid_type == "f16"
    calibrated = route_settings.ModelRoute(top_k=1, layer_top_k="1=3", centroid_type="q8_0", shortlist_floor=48)
    monkeypatch.setitem(route_settings.MODEL_ROUTES, plain.model.sha256, calibrated)
    plain.close()
    session = Session(str(tiny_model), threads=2)
    try:
        assert session.calibrated_route == calibrated and session.centroid_type == "q8_0"
        session.load_document(text)
        assert session.n_prefix > 64 * 12
        answer = session.ask("which value?", max_tokens=2, want_regions=True)
        default = [piece.stats for piece in answer if piece.stats is not None]
        summary = answer.summary()
        given = session.ask("which value?", route=RouteConfig(mode="geometric", top_k=2), max_tokens=2,
                            want_regions=True)
        as_given = [piece.stats for piece in given if piece.stats is not None]
    finally:
        session.close()
    assert (summary.route.top_k, summary.route.layer_top_k, summary.route.shortlist) == (1, "1=3", 48)
    assert default and as_given
    for st in default:  # the sinks' region and the window's, then the layer's own budget
        assert [len(layer[head]) for layer in per_layer(st) for head in range(N_HEAD_KV)] == [FIXED + 1] * 2 + [FIXED + 3] * 2
    for st in as_given:
        assert [len(layer[head]) for layer in per_layer(st) for head in range(N_HEAD_KV)] == [FIXED + 2] * 4
