"""Route hints inside the engine (patch 0012) and through the session, on the tiny synthetic model."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytestmark = pytest.mark.engine

from engine_probe import RawContext, context_with_document  # noqa: E402

from kvlocal.engine import apply_route, llama_cpp, read_stats, route_api  # noqa: E402
from kvlocal.routing import Route  # noqa: E402

N_DOC = 1500  # 24 regions of 64 cells: region 0 the sinks, 22-23 the window


@pytest.fixture(scope="module")
def raw(tiny_model):
    ctx = context_with_document(tiny_model, N_DOC)
    yield ctx
    ctx.close()


def step(raw: RawContext, route: Route, hints: list[int]):
    """One decode step after the document with these hinted cells; the cache is rewound after it."""
    m = llama_cpp()
    cells = (ctypes.c_int32 * max(1, len(hints)))(*hints)
    assert route_api().llama_kv_route_set_hints(raw.ctx, cells, len(hints)) == 0
    apply_route(raw.ctx, route)
    try:
        raw.decode([5])
        return read_stats(raw.ctx, with_regions=True)
    finally:
        m.llama_memory_seq_rm(m.llama_get_memory(raw.ctx), 0, N_DOC, -1)
        raw.n_past = N_DOC
        route_api().llama_kv_route_set_hints(raw.ctx, cells, 0)


def regions_read(stats) -> set[int]:
    return {int(r) for r in np.unique(stats.regions)}


def test_a_hinted_region_is_read_by_every_layer_and_head_in_place_of_a_choice(raw):
    route = Route(mode="geometric", top_k=2, region=64)
    plain = step(raw, route, [])
    unread = sorted(set(range(1, 22)) - regions_read(plain))[0]
    hinted = step(raw, route, [unread * 64 + 5])
    assert all(unread in heads for layer in hinted.regions for heads in layer)
    assert unread not in regions_read(plain)
    # the same budget: sinks + window + top_k regions, the same rows and bytes
    assert hinted.n_sel == plain.n_sel
    assert (hinted.rows_read, hinted.bytes_kv) == (plain.rows_read, plain.bytes_kv)


def test_hints_are_capped_at_top_k_and_skip_the_sinks_and_the_window(raw):
    route = Route(mode="geometric", top_k=2, region=64)
    plain = step(raw, route, [])
    # sinks (region 0), window (23), out of range, negative: nothing to hint; the plan is unchanged
    ignored = step(raw, route, [3, 23 * 64 + 1, 10**6, -5])
    np.testing.assert_array_equal(ignored.regions, plain.regions)
    # three hints at top-2: the first two are read by every head, the third is not forced
    three = step(raw, route, [5 * 64, 7 * 64, 9 * 64])
    for layer in three.regions:
        for heads in layer:
            assert {5, 7} <= set(heads.tolist())
    assert three.rows_read == plain.rows_read


@pytest.mark.parametrize("mode", ["window", "random"])
def test_the_controls_ignore_hints(raw, mode):
    route = Route(mode=mode, top_k=2, region=64)
    np.testing.assert_array_equal(step(raw, route, []).regions, step(raw, route, [10 * 64]).regions)


def test_every_region_selected_with_hints_still_reproduces_dense(raw):
    dense = step(raw, Route(mode="full"), [])
    every = step(raw, Route(mode="geometric", top_k=1000, region=64), [10 * 64, 12 * 64])
    assert every.rows_read == dense.rows_dense


def test_the_session_hints_the_region_that_names_the_asked_word(tiny_model, tmp_path, monkeypatch):
    from kvlocal.session import Session

    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(tmp_path))
    lines = [f"entry {i}: the value is {i * 7 % 101}." for i in range(120)]
    lines[60] = "entry 60: the zanzibar value is 4242."
    route = Route(mode="geometric", top_k=2, region=64, hints=1)
    session = Session(str(tiny_model), threads=2, n_ctx=4096)
    try:
        session.load_document(" ".join(lines))
        answer = session.ask("Which value does Zanzibar have?", route=route, max_tokens=3, want_regions=True)
        steps = [piece.stats for piece in answer if piece.stats is not None]
        hinted = answer.summary().hint_cells
        assert hinted, "the rare word names no region"
        region = hinted[0] // 64
        assert session.span_text(hinted[0], hinted[0] + 24).lower().lstrip().startswith("zanzibar")
        plain = session.answer("Which value?", route=route, max_tokens=2)  # no rare word: no hint
    finally:
        session.close()
    # every head of every routed layer read the word's region at every answer step
    assert steps and all(region in heads for st in steps for layer in st.regions for heads in layer)
    assert plain.hint_cells == ()


def test_at_top_1_a_hint_whose_sentence_runs_on_reads_the_next_region_too(tiny_model, tmp_path, monkeypatch):
    """Top-1 used to leave room for the rare word's region only: a value past that region's end was
    not read (the library's copy losses). The session raises top-k to the hinted regions' number."""
    from kvlocal.hints import FOLLOW
    from kvlocal.session import Session

    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(tmp_path))
    lines = [f"entry {i}: the value is {i * 7 % 101}." for i in range(120)]
    lines[60] = "entry 60: the zanzibar value is 4242."
    route = Route(mode="geometric", top_k=1, region=64, hints=1, question="steps")
    question = "Which value does Zanzibar have?"
    session = Session(str(tiny_model), threads=2, n_ctx=4096)
    try:
        session.load_document(" ".join(lines), use_cache=False)
        cell = session.answer(question, route=route, max_tokens=1).hint_cells[0]
        # move the word to 8 cells before its region's end ('#' is one token a character here)
        pad = (64 - 8 - cell % 64) % 64
        session.load_document("#" * pad + " " + " ".join(lines), use_cache=False)
        answer = session.ask(question, route=route, max_tokens=3, want_regions=True)
        steps = [piece.stats for piece in answer if piece.stats is not None]
        summary = answer.summary()
        a, b = summary.hint_cells[:2]
        assert a % 64 > 64 - FOLLOW and b == a + FOLLOW and b // 64 == a // 64 + 1
        assert session.span_text(a, a + 8).lower().lstrip().startswith("zanzibar")
        unhinted = Route(mode="geometric", top_k=1, region=64, question="steps")
        plain = [p.stats for p in session.ask(question, route=unhinted, max_tokens=1, want_regions=True) if p.stats]
    finally:
        session.close()
    assert summary.route.top_k == 2
    # every head of every routed layer read both regions at every answer step, and nothing else routed
    for st in steps:
        for layer in st.regions:
            for heads in layer:
                assert {a // 64, b // 64} <= set(heads.tolist())
    # the second region is counted like any read: one region more than the unhinted top-1 step
    assert steps[0].n_sel == plain[0].n_sel + 1
