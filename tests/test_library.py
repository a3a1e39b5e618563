"""kvlocal.library on the tiny model: a set of one is the single-document path, an assembled set matches
its documents prefilled fresh at the positions the layout gives them, the cache is reused whatever the
order, reads are attributed to documents, and a model whose memory cannot be composed is refused."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.engine

from synth_gguf import write_tiny_olmo2_swa  # noqa: E402
from test_library_upstream import _Ctx  # noqa: E402

from kvlocal import kvstate  # noqa: E402
from kvlocal.engine import SequenceStep, decode_batch, llama_cpp, route_api  # noqa: E402
from kvlocal.errors import ContextOverflowError, ModelError, UsageError  # noqa: E402
from kvlocal.ingest import Document  # noqa: E402
from kvlocal.layout import DocumentSpan, SetReads  # noqa: E402
from kvlocal.library import LAYOUT_UNIT, load_set  # noqa: E402
from kvlocal.prompt import Segment  # noqa: E402
from kvlocal.progress import answer_summary  # noqa: E402
from kvlocal.routing import Fallback, ReadStats, Route, RouteConfig, RouteMode  # noqa: E402
from kvlocal.session import Session  # noqa: E402

A = Document(" ".join(f"entry {i}: value {i * 7 % 101}." for i in range(50)), "a.txt", "txt")
B = Document(" ".join(f"line {i} says {i * 13 % 97} apples." for i in range(70)), "b.txt", "txt")
C = Document(" ".join(f"row {i} holds {i * 5 % 89} coins." for i in range(30)), "c.txt", "txt")
QUESTION = "which value?"
ROUTE = Route(mode="geometric", top_k=2, region=64)
# the assembled set's K are moved by the engine's K-shift: re-rotated and rounded to f16 again, not
# bit-exact against a fresh RoPE (see test_library_upstream). Measured here: 6e-4 at a shift of about
# 1.2k positions, on logits of magnitude ~0.3 (attending across documents, which a set does not, moves
# them by ~4e-2), so logits within this of the documents prefilled fresh at the same positions
SET_TOL = 2e-3


@pytest.fixture
def lib(cache_dir, tiny_model):
    library = Session(str(tiny_model), threads=2)
    yield library
    library.close()


def question_logits(session: Session) -> np.ndarray:
    """The logits after the question (read in one dense batch), the way Session.ask reads it."""
    session._rewind()
    q = session.tokenize_prompt(session.parts.question_segments(QUESTION), bos=False)
    session.context.decode(q)
    return session.context.last_logits().copy()


def test_a_set_of_one_is_the_single_document_path(cache_dir, tiny_model, lib):
    single = Session(str(tiny_model), threads=2)
    try:
        want = single.load_document(A.text, label=A.source)
        want_tokens = single.context.tokens(0, single.n_prefix)
        want_logits = question_logits(single)
        want_answer = single.answer(QUESTION, route=ROUTE, max_tokens=8).text
    finally:
        single.close()
    got = load_set(lib, [A])
    assert got.layout == "single" and got.single is not None
    assert got.single.cache_hit  # the state the single-document path saved: the same key
    assert lib.n_prefix == want.n_tokens and lib.context.tokens(0, lib.n_prefix) == want_tokens
    np.testing.assert_array_equal(question_logits(lib), want_logits)
    assert lib.answer(QUESTION, route=ROUTE, max_tokens=8).text == want_answer
    [span] = lib.layout.spans  # the document's own tokens, between the template's head and middle
    assert lib.span_text(span.start, span.end) == A.text


class _Ref(_Ctx):
    """A fresh reference: the head in seq 0, each body prefilled fresh in a sequence of its own at the
    positions given (after the head moved there with it), all shared with seq 0; then the middle and
    the question decode in seq 0."""

    def __init__(self, lib: Session, positions: list[int], bodies: list[list[int]], head: list[int]) -> None:
        m = llama_cpp()
        super().__init__(SimpleNamespace(model=lib.context.raw_model, n_vocab=lib.context.n_vocab), 1 + len(bodies), 4096)
        self.decode(head, 0, 0)
        for s, (pos, body) in enumerate(zip(positions, bodies), start=1):
            # the body after a copy of the head moved with it (what the body's K/V saw when it was
            # prefilled: the same distances), the copy then dropped
            shift = pos - len(head)
            self.decode(head, shift, s)
            for i in range(0, len(body), 512):
                self.decode(body[i:i + 512], pos + i, s)
            m.llama_memory_seq_rm(self.mem, s, shift, pos)
        for s in range(1, len(bodies) + 1):
            m.llama_memory_seq_cp(self.mem, s, 0, -1, -1)


def _reference(lib: Session, layout: str) -> np.ndarray:
    pad = lib.tokenize("\n", bos=False)[-1]  # the library pads with newlines to whole LAYOUT_UNITs

    def padded(tokens: list[int]) -> list[int]:
        return tokens + [pad] * (-len(tokens) % LAYOUT_UNIT)

    head = padded(lib.tokenize_prompt([Segment(lib.parts.head, True)], bos=True))
    bodies = [padded(lib.tokenize(d.text, bos=False)) for d in (A, B)]
    positions = [len(head), len(head) + len(bodies[0])] if layout == "consecutive" else [len(head)] * 2
    ref = _Ref(lib, positions, bodies, head)
    try:
        middle = lib.tokenize_prompt([Segment(lib.parts.middle, True)], bos=False)
        q = lib.tokenize_prompt(lib.parts.question_segments(QUESTION), bos=False)
        end = max(p + len(b) for p, b in zip(positions, bodies))
        return ref.decode(middle + q, end, 0)
    finally:
        ref.close()


@pytest.mark.parametrize("layout", ["consecutive", "parallel"])
def test_an_assembled_set_matches_its_documents_prefilled_at_their_positions(lib, layout):
    load = load_set(lib, [A, B], layout=layout)
    assert load.layout == layout and [d.cache_hit for d in load.documents] == [False, False]
    head = load.spans[0].start
    assert head % LAYOUT_UNIT == 0 and all(s.start % LAYOUT_UNIT == 0 for s in load.spans)
    assert [s.start for s in load.spans] == [head, load.spans[0].end]  # load order, no hole
    want_positions = [head, load.spans[0].end] if layout == "consecutive" else [head, head]
    assert [s.position for s in load.spans] == want_positions
    got = question_logits(lib)
    want = _reference(lib, layout)
    assert np.abs(got - want).max() < SET_TOL
    assert got.argmax() == want.argmax()
    assert lib.span_text(load.spans[1].start, load.spans[1].start + 8) == B.text[:len(lib.span_text(
        load.spans[1].start, load.spans[1].start + 8))]


def test_the_set_comes_from_the_cache_whatever_its_order_and_a_new_document_costs_its_own_prefill(lib):
    load_set(lib, [A, B])
    first = question_logits(lib)
    again = load_set(lib, [B, A])
    assert again.cache_hits == 2 and again.spans[0].label == "b.txt"
    again = load_set(lib, [A, B])
    assert again.cache_hits == 2
    assert np.abs(question_logits(lib) - first).max() < SET_TOL
    more = load_set(lib, [C, A, B])
    assert [d.cache_hit for d in more.documents] == [False, True, True]
    assert lib.answer(QUESTION, route=ROUTE, max_tokens=4).n_answer_tokens >= 0


def test_the_layout_follows_the_trained_context(lib):
    assert load_set(lib, [A, B]).layout == "consecutive"
    lib.trained_ctx = 2600  # the two bodies (about 2.7k tokens) no longer fit one after the other
    load = load_set(lib, [A, B])
    assert load.layout == "parallel" and load.n_positions < load.n_cells
    assert lib.n_prefix == load.n_positions and lib.prefix_cells == load.n_cells
    assert lib.answer(QUESTION, max_tokens=4).n_question_tokens > 0
    with pytest.raises(ContextOverflowError, match="trained context"):
        load_set(lib, [A, B], layout="consecutive")


def test_per_document_reads_add_up_to_the_engines_total(lib):
    for docs in ([A], [A, B]):  # both route: the single path, and the set as one index (patch 0010)
        load_set(lib, docs)
        tally = lib.read_tally()
        rows = 0
        for piece in lib.ask(QUESTION, route=ROUTE, max_tokens=6, want_regions=True):
            tally.add(piece.stats)
            rows += piece.stats.rows_read if piece.stats else 0
        assert tally.steps and tally.total == rows
        assert tally.routed_steps == tally.steps and "dense" not in tally.describe()
        assert all(n > 0 for n in tally.documents)
        assert abs(sum(share for _, share in tally.shares()) - 1) < 1e-9
        assert lib.document_at(lib.layout.spans[-1].start).label == docs[-1].source and lib.document_at(0) is None


def test_routed_regions_are_attributed_to_the_documents_they_lie_in():
    spans = (DocumentSpan("a", 64, 192, 100, 64), DocumentSpan("b", 192, 256, 50, 192))
    tally = SetReads(spans, prefix_cells=300)
    regions = np.array([[[0, 1, 3], [2, 2, 4]]], np.int32)  # one routed layer, two KV heads, 3 regions each
    stats = ReadStats(RouteMode.GEOMETRIC, 0, n_layer=2, n_layer_routed=1, n_head_kv=2, n_kv=512, region_size=64,
                      n_sel=3, rows_read=0, rows_dense=0, bytes_kv=0, bytes_meta=0, bytes_dense=0,
                      layers=np.array([1], np.int32), regions=regions)
    tally.add(stats)
    # routed: region 0 head, 1 and 2 (twice) in a, 3 in b, 4 the rest; dense layer 0: 512 cells x 2 heads
    assert tally.head == 64 + 2 * 64
    assert tally.documents == [3 * 64 + 2 * 128, 64 + 2 * 64]
    assert tally.rest == 64 + 2 * (512 - 256)
    assert tally.total == 6 * 64 + 2 * 512


def test_a_model_whose_memory_cannot_be_composed_is_refused_before_anything(cache_dir, tmp_path, tiny_model):
    single = Session(str(tiny_model), threads=2)
    single.load_document(A.text)
    single.close()
    before = [e.path.name for e in kvstate.list_entries()]
    swa = Session(str(write_tiny_olmo2_swa(tmp_path / "swa.gguf")), threads=2)
    try:
        with pytest.raises(ModelError, match="sliding-window"):
            load_set(swa, [A, B])
        load_set(swa, [A])  # one document is the single path: it still works
    finally:
        swa.close()
    assert set(before) <= {e.path.name for e in kvstate.list_entries()}


def test_a_routed_prefill_of_a_set_is_refused(lib):
    from kvlocal.routing import PrefillConfig

    with pytest.raises(UsageError, match="routed prefill"):
        load_set(lib, [A, B], prefill=PrefillConfig(mode="routed"))


# routing over an assembled set (patch 0010): the question's sequence of a unified cache of two routes
# over every document's cells. With every region selected the routed step reads what the dense one
# reads, in another order: tests/test_routing.py's oracle (5e-3) is measured on random tokens at 1.5k
# cells. On these texts the error grows with the cells, whatever the number of sequences: measured
# at about 2.6k cells, 1.23e-2 (consecutive) and 1.30e-2 (parallel) for the set, 1.26e-2 for its
# documents concatenated as one document through the unchanged single-sequence path (7e-3 at 1.1k
# cells there); on logits of magnitude 0.6. So the set is held to the single-sequence path's own
# error at the same length (and 2e-2 at most), and to the same greedy choices.
SET_ORACLE_TOL = 2e-2
STEPS = [17, 42, 99, 7, 130, 64]  # fixed answer tokens: every mode decodes the same steps


def question_tokens(lib: Session) -> list[int]:
    return lib.tokenize_prompt(lib.parts.question_segments(QUESTION), bos=False)


def set_steps(lib: Session, route: Route, steps: list[int] = STEPS) -> list[tuple[np.ndarray, ReadStats]]:
    """The question read in one dense batch under `route` (geometric writes its pins there), then the
    fixed `steps` decoded one by one: logits and read stats of each."""
    lib._rewind()
    lib.context.apply_route(route)
    lib.context.decode(question_tokens(lib))
    out = []
    for tok in steps:
        lib.context.decode([tok])
        out.append((lib.context.last_logits().copy(), lib.context.read_stats()))
    return out


def every_region_error(lib: Session) -> tuple[float, list, list]:
    """The largest |logit| difference between full attention and every region selected, and both runs."""
    full = set_steps(lib, Route(mode="full"))
    every = set_steps(lib, Route(mode="geometric", top_k=1000, region=64))
    return max(float(np.abs(a - b).max()) for (a, _), (b, _) in zip(full, every)), full, every


@pytest.mark.parametrize("layout", ["consecutive", "parallel"])
def test_every_region_selected_over_a_set_reproduces_full_attention(lib, layout):
    load_set(lib, [Document(A.text.strip() + " " + B.text.strip(), "ab.txt", "txt")])
    single, _, _ = every_region_error(lib)  # one sequence, about as many cells
    load = load_set(lib, [A, B], layout=layout)
    assert lib.context.route_centroid_block() > 0  # two unified sequences keep centroids
    diff, full, every = every_region_error(lib)
    one = set_steps(lib, Route(mode="geometric", top_k=1, region=64))
    assert diff <= min(SET_ORACLE_TOL, 1.5 * single), f"max |logit diff| {diff} (one sequence: {single})"
    assert [int(a.argmax()) for a, _ in full] == [int(b.argmax()) for b, _ in every]
    assert all(s.fallback == Fallback.MODE_FULL and s.n_layer_routed == 0 for _, s in full)
    assert all(s.fallback == Fallback.OK and s.n_layer_routed == s.n_layer > 0 for _, s in every)
    first = load.n_cells + len(question_tokens(lib))  # the first step's cell: the set, then the question
    # every region the question's sequence sees, up to the step's own
    assert [s.n_sel for _, s in every] == [(first + i) // 64 + 1 for i in range(len(STEPS))]
    # a tight budget really drops regions
    assert max(float(np.abs(a - b).max()) for (a, _), (b, _) in zip(full, one)) > diff
    # and the greedy answer is the same text: its first 4 tokens (the random model's top two logits come
    # within the error above later on: the parallel set's 6th token flips, as one of the single-sequence
    # path's steps does at this length)
    dense_text = lib.answer(QUESTION, route=Route(mode="full"), max_tokens=4).text
    assert lib.answer(QUESTION, route=Route(mode="geometric", top_k=1000, region=64), max_tokens=4).text == dense_text


def test_geometric_over_a_set_reads_fewer_rows_than_full_with_exact_counts(lib):
    load = load_set(lib, [A, B])
    [(_, full)] = set_steps(lib, Route(mode="full"), STEPS[:1])
    routed = set_steps(lib, ROUTE)
    first = load.n_cells + len(question_tokens(lib))  # the first step's cell
    assert routed[0][1].rows_dense == full.rows_dense == full.rows_read  # full reads every cell of its view
    for i, (_, st) in enumerate(routed):
        assert st.fallback == Fallback.OK and st.n_layer_routed == st.n_layer == full.n_layer
        assert st.rows_dense == st.n_layer * st.n_head_kv * st.n_kv
        assert st.rows_read == st.n_layer_routed * st.n_head_kv * st.n_sel * 64 < st.rows_dense
        assert st.bytes_kv * st.rows_dense == st.bytes_dense * st.rows_read  # the same row size
        assert st.regions.shape == (st.n_layer_routed, st.n_head_kv, st.n_sel)
        last = (first + i) // 64  # the step's own region
        for layer in st.regions:
            for regs in layer:
                regs = set(regs.tolist())
                assert len(regs) == st.n_sel and 0 in regs and last in regs  # the head's sink, the window
                assert regs <= set(range(last + 1))
        # the head's sink, the window (the last 2 regions: 128 tokens) and top_k 2 regions of the documents
        assert st.n_sel == 1 + 2 + 2
    summary = lib.answer(QUESTION, route=ROUTE, max_tokens=6)
    assert summary.fallback == "" and "fell back" not in answer_summary(summary)
    assert summary.bytes_read < summary.bytes_dense


def test_window_and_random_over_a_set_choose_other_regions_than_geometric(lib):
    load_set(lib, [A, B])
    picks = {mode: [st.regions.copy() for _, st in set_steps(lib, Route(mode=mode, top_k=2, region=64))]
             for mode in ("geometric", "window", "random")}
    assert all(a.shape == b.shape for a, b in zip(picks["geometric"], picks["window"]))
    for mode in ("window", "random"):
        assert any(not np.array_equal(np.sort(a, -1), np.sort(b, -1)) for a, b in zip(picks["geometric"], picks[mode])), mode


def test_a_ubatch_of_steps_of_several_sequences_routes_each_over_what_it_sees(lib):
    """One token of the question's sequence and the staging one's first, decoded together, route each
    on its own (patch 0017): the question's over the set, the staging sequence over its one cell.
    Several tokens of one sequence beside another still fall back."""
    load_set(lib, [A, B])
    pos = lib.n_prefix
    lib.context.apply_route(Route(mode="geometric", top_k=2, region=64, keep=0.0), batch_top_k=2)
    lib.context.decode_steps([SequenceStep(0, 5, pos), SequenceStep(1, 6, 0)])
    st = lib.context.read_stats()
    assert st.fallback == Fallback.OK and sorted(st.sequences) == [0, 1]
    step_region = int(st.sequences[1].regions[0, 0, 0])  # where both steps' cells landed
    assert {int(r) for r in st.sequences[1].regions.ravel()} == {step_region}  # all the staging sequence sees
    asked = st.sequences[0]
    assert asked.n_sel == 1 + 2 + 2  # the head's sink, the window, top_k 2 regions of the documents
    assert all(step_region in set(head.tolist()) for layer in asked.regions for head in layer)

    load_set(lib, [A, B])
    lib.context.apply_route(Route(mode="geometric", top_k=2, region=64, keep=0.0), batch_top_k=2)
    steps = [SequenceStep(0, 5, pos), SequenceStep(0, 6, pos + 1), SequenceStep(1, 7, 0)]
    decode_batch(lib.context.raw_context, steps, logits=[True] * len(steps))
    assert lib.context.read_stats().fallback == Fallback.MULTI_SEQ


@pytest.mark.parametrize("unified, expected", [(True, 16), (False, 0)])
def test_several_sequences_keep_centroids_in_one_stream_only(tiny_model, unified, expected):
    m = llama_cpp()
    params = m.llama_model_default_params()
    params.n_gpu_layers = 0
    model = m.llama_model_load_from_file(str(tiny_model).encode(), params)
    try:
        cparams = m.llama_context_default_params()
        cparams.n_ctx, cparams.n_seq_max, cparams.kv_unified = 1024, 2, unified
        cparams.flash_attn_type = m.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cparams.kv_centroid_block = 16
        ctx = m.llama_init_from_model(model, cparams)
        assert ctx
        assert route_api().llama_kv_route_cent_blk(ctx) == expected
        m.llama_free(ctx)
    finally:
        m.llama_model_free(model)


def test_a_set_read_whole_answers_with_its_own_route_unless_the_route_was_tuned(lib):
    """A set of several documents read whole (--focus set) with the route at its defaults (none of top-k, hints, question pass given) takes the library route
    of route_settings; a question whose words hint nowhere takes the defaults instead; one document, a
    tuned route and full attention stay as given. The summary holds the route the answer took. By
    default (--focus hinted) the hinted document is read alone, with one document's route."""
    from kvlocal.route_settings import LIBRARY_HINTS, LIBRARY_QUESTION, LIBRARY_TOP_K

    lines = [f"row {i} holds {i * 5 % 89} coins." for i in range(40)]
    lines[20] = "row 20 holds the zanzibar ledger code 4242."
    Z = Document(" ".join(lines), "z.txt", "txt")
    load_set(lib, [A, Z])
    focused = lib.answer("Which ledger code does Zanzibar hold?", route=RouteConfig(top_k=None, hints=None, question=None),
                         max_tokens=2)
    assert focused.focus == "z.txt" and focused.route.focus == "hinted"
    assert (focused.route.top_k, focused.route.hints, focused.route.question) == (4, 0, "dense")
    defaults = RouteConfig(top_k=None, hints=None, question=None, focus="set")
    hinted = lib.answer("Which ledger code does Zanzibar hold?", route=defaults, max_tokens=2)
    assert hinted.hint_cells and lib.document_at(hinted.hint_cells[0]).label == "z.txt"
    assert (hinted.route.hints, hinted.route.question) == (LIBRARY_HINTS, LIBRARY_QUESTION)
    assert LIBRARY_TOP_K <= hinted.route.top_k <= 2  # raised to the hinted regions where its sentence runs on
    plain = lib.answer("Which value?", route=defaults, max_tokens=2)  # no rare word: the defaults
    assert plain.hint_cells == () and plain.route == replace(Route(), shortlist=Route().shortlist_at(lib.prefix_cells),
                                                             focus="set")
    tuned = RouteConfig(top_k=3)  # a route given on the command line is taken as it is
    assert lib.answer("Which ledger code does Zanzibar hold?", route=tuned, max_tokens=1).route.top_k == 3
    assert lib.answer(QUESTION, route=replace(defaults, mode="full"), max_tokens=1).route.mode == "full"
    load_set(lib, [Z])  # one document: the single-document defaults
    alone = lib.answer("Which ledger code does Zanzibar hold?", route=defaults, max_tokens=1)
    assert (alone.route.top_k, alone.route.hints, alone.route.question) == (4, 0, "dense")


def test_a_set_keeps_the_centroids_its_route_was_measured_with(cache_dir, tiny_model, monkeypatch):
    """A model route's centroid type is one document's: a set of several keeps LIBRARY_CENTROID_TYPE
    (its route was measured with it) unless a type is given, and a document loaded after the set gets
    the model's again, in a context of its own."""
    from kvlocal import route_settings
    from kvlocal.models import resolve_model

    sha = resolve_model(str(tiny_model)).sha256
    monkeypatch.setitem(route_settings.MODEL_ROUTES, sha, route_settings.ModelRoute(centroid_type="q8_0"))
    lib = Session(str(tiny_model), threads=2)
    given = Session(str(tiny_model), threads=2, centroid_type="q8_0")
    try:
        assert lib.centroid_type == "q8_0"
        load_set(lib, [A, B])
        assert lib.centroid_type == route_settings.LIBRARY_CENTROID_TYPE == "f16"
        assert lib.answer(QUESTION, max_tokens=2).steps
        load_set(lib, [A])
        assert lib.centroid_type == "q8_0"
        load_set(given, [A, B])
        assert given.centroid_type == "q8_0"
    finally:
        lib.close()
        given.close()
