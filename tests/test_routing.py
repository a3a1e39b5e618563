"""Routed attention inside the patched engine, on tiny synthetic models.

Oracles: with every region selected, geometric routing must reproduce dense attention; the
read statistics must equal what the selected regions hold; the routed graph may use only ops
that the CUDA and Metal backends implement.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.engine

from engine_probe import GraphRecorder, RawContext, routed_steps  # noqa: E402
from synth_gguf import write_tiny_olmo2_swa, write_tiny_qwen2  # noqa: E402

from kvlocal.engine import apply_route, engine_info, llama_cpp, read_stats, route_api  # noqa: E402
from kvlocal.errors import UsageError  # noqa: E402
from kvlocal.routing import Route  # noqa: E402

# ops that both ggml-cuda and ggml-metal implement for the types the routed graph feeds them
# (checked against their supports_op in tests/test_gpu_ops.py)
GPU_OPS = {
    "NONE", "ADD", "MUL", "SCALE", "CPY", "CONT", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE",
    "GET_ROWS", "SET_ROWS", "MUL_MAT", "TOP_K", "CONCAT", "REPEAT", "ARANGE", "POOL_2D",
    "FLASH_ATTN_EXT", "RMS_NORM", "ROPE", "SWIGLU", "SOFT_MAX", "SUB", "ABS", "CLAMP",
}

N_DOC = 1500


@pytest.fixture(scope="module")
def model64(tmp_path_factory):
    """A tiny qwen2 with head_dim 64 (q8_0 needs rows of whole 32-element blocks)."""
    return write_tiny_qwen2(tmp_path_factory.mktemp("m64") / "tiny64.gguf", n_embd=128, n_head=2, n_head_kv=1, seed=3)


@pytest.fixture(scope="module")
def iswa_model(tmp_path_factory):
    """A tiny olmo2 with sliding-window attention: layers 0 and 2 attend a 128-token window,
    layers 1 and 3 the whole context."""
    return write_tiny_olmo2_swa(tmp_path_factory.mktemp("iswa") / "tiny-olmo2-swa.gguf", seed=5)


def doc_tokens(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 250, size=n)]


def decode_steps(raw: RawContext, n_prefix: int, steps: list[int], route: Route):
    """Rewind to the prefix, set the route, decode `steps` one token at a time: logits and stats per step."""
    m = llama_cpp()
    m.llama_memory_seq_rm(m.llama_get_memory(raw.ctx), 0, n_prefix, -1)
    raw.n_past = n_prefix
    return routed_steps(raw, steps, route)


def test_engine_is_patched_and_current():
    info = engine_info()
    assert info.patched, info.build_id
    assert info.current, (info.patchset, info.repo_patchset)


def oracle_runs(raw: RawContext, steps: list[int], shortlist: int = 0):
    """Prefill N_DOC tokens, then decode `steps` densely, with every region routed, and with one."""
    raw.decode(doc_tokens(N_DOC))
    return [decode_steps(raw, N_DOC, steps, route) for route in (
        Route(mode="full"),
        Route(mode="geometric", top_k=1000, region=64, shortlist=shortlist),
        Route(mode="geometric", top_k=1, region=64, shortlist=shortlist),
    )]


@pytest.mark.parametrize("shortlist", [0, 16])  # one scoring pass; two levels (coarse shortlist, fine choice)
@pytest.mark.parametrize("kv_type, which, centroid_type", [(1, "tiny", 1), (8, "m64", 1), (1, "m64", 8)])
def test_all_regions_reproduce_dense(tiny_model, model64, kv_type, which, centroid_type, shortlist):
    path = tiny_model if which == "tiny" else model64
    raw = RawContext(path, n_ctx=2048, kv_type=kv_type, centroid_type=centroid_type)
    try:
        dense, routed, small = oracle_runs(raw, doc_tokens(12, seed=1), shortlist)
    finally:
        raw.close()
    diff = max(float(np.max(np.abs(a[0] - b[0]))) for a, b in zip(dense, routed))
    scale = max(float(np.max(np.abs(a[0]))) for a in dense)
    # flash attention accumulates in a different order over the gathered rows; measured here:
    # 1.4e-3 (f16, head_dim 16) and 2.1e-3 (q8_0, head_dim 64) on logits of magnitude 0.5-0.8,
    # against 0.07-0.23 when routing drops regions (top-1)
    assert diff <= 5e-3 * max(1.0, scale), f"max |logit diff| {diff} (scale {scale})"
    # same greedy choice at every step
    assert [int(np.argmax(a[0])) for a in dense] == [int(np.argmax(b[0])) for b in routed]
    # the routed run really took the routed path, and a tight budget changes the result
    assert all(s.n_layer_routed == s.n_layer > 0 for _, s in routed)
    assert all(s.n_layer_routed == 0 for _, s in dense)
    assert max(float(np.max(np.abs(a[0] - b[0]))) for a, b in zip(dense, small)) > diff


def test_read_stats_are_exact_for_window_mode(tiny_model):
    raw = RawContext(tiny_model, n_ctx=2048)
    try:
        raw.decode(doc_tokens(N_DOC))
        route = Route(mode="window", top_k=3, region=64, window=128, sinks=64)
        [(_, st)] = decode_steps(raw, N_DOC, [5], route)
    finally:
        raw.close()
    # the decoded token is at position 1500 -> cells 0..1500 are used -> regions 0..23 (23 is partial)
    n_used_regions = N_DOC // 64 + 1
    sinks, window = [0], [n_used_regions - 2, n_used_regions - 1]
    before_window = list(range(n_used_regions - 5, n_used_regions - 2))
    expected = sorted(sinks + before_window + window)
    n_layer, n_head_kv, head_dim = 2, 2, 16
    assert st.n_sel == len(expected) == 6
    assert st.n_layer == st.n_layer_routed == n_layer
    for layer in range(n_layer):
        for head in range(n_head_kv):
            assert sorted(st.regions[layer, head].tolist()) == expected
    row_bytes = 2 * head_dim * 2  # K and V rows, f16
    assert st.rows_read == n_layer * n_head_kv * len(expected) * 64
    assert st.bytes_kv == st.rows_read * row_bytes
    assert st.bytes_meta == 0  # window routing scans no centroids
    assert st.rows_dense == n_layer * n_head_kv * st.n_kv
    assert st.n_kv % 256 == 0 and st.n_kv >= N_DOC + 1


def test_geometric_stats_count_centroid_bytes(tiny_model):
    raw = RawContext(tiny_model, n_ctx=2048)
    try:
        raw.decode(doc_tokens(N_DOC))
        [(_, st)] = decode_steps(raw, N_DOC, [5], Route(mode="geometric", top_k=4, region=64, shortlist=0, keep=0))
        [(_, two)] = decode_steps(raw, N_DOC, [5], Route(mode="geometric", top_k=4, region=64, shortlist=6,
                                                               keep=0))
        [(_, rnd)] = decode_steps(raw, N_DOC, [5], Route(mode="random", top_k=4, region=64, seed=7))
    finally:
        raw.close()
    n_layer, n_head_kv, head_dim, cent_blk = 2, 2, 16, 16
    n_reg = st.n_kv // 64
    row = n_head_kv * head_dim * 2  # one centroid of every KV head, F16
    # one pass: every fine centroid; two levels: one coarse centroid per region, then the
    # shortlist's fine centroids
    assert st.bytes_meta == n_layer * n_reg * (64 // cent_blk) * row
    assert two.bytes_meta == n_layer * (n_reg + 6 * (64 // cent_blk)) * row
    assert two.bytes_kv == st.bytes_kv
    assert st.n_sel == rnd.n_sel == 1 + 2 + 4
    for regions in (st.regions, rnd.regions):
        for layer in range(n_layer):
            for head in range(n_head_kv):
                chosen = regions[layer, head].tolist()
                assert len(set(chosen)) == len(chosen), "a region was gathered twice"
                assert {0, 22, 23} <= set(chosen) and max(chosen) <= 23
    assert rnd.bytes_meta == 0


def test_q8_0_centroids_scan_fewer_bytes_and_choose_alike(tiny_model, model64):
    """kv_centroid_type = Q8_0 keeps the centroids in 34 bytes per 32 values instead of 64: the scan
    counts exactly that, the gathered rows do not change, and the choice is nearly the F16 one. A
    head size that is not whole Q8_0 blocks keeps F16; another type is refused."""
    route = Route(mode="geometric", top_k=2, region=64, shortlist=6, keep=0)
    steps = doc_tokens(6, seed=4)
    runs = {}
    for name, centroid_type in (("f16", 1), ("q8_0", 8)):
        raw = RawContext(model64, n_ctx=2048, centroid_type=centroid_type)
        try:
            raw.decode(doc_tokens(N_DOC))
            runs[name] = decode_steps(raw, N_DOC, steps, route)
        finally:
            raw.close()
    agree = []
    for (_, a), (_, b) in zip(runs["f16"], runs["q8_0"]):
        assert b.bytes_meta * 64 == a.bytes_meta * 34
        assert b.bytes_kv == a.bytes_kv and b.rows_read == a.rows_read
        agree.append(float(np.mean(np.sort(a.regions, axis=-1) == np.sort(b.regions, axis=-1))))
    assert np.mean(agree) >= 0.9, agree
    fallback = {}
    for name, centroid_type in (("f16", 1), ("q8_0", 8)):
        raw = RawContext(tiny_model, n_ctx=2048, centroid_type=centroid_type)  # head_dim 16
        try:
            raw.decode(doc_tokens(N_DOC))
            [(_, fallback[name])] = decode_steps(raw, N_DOC, steps[:1], route)
        finally:
            raw.close()
    assert fallback["q8_0"].bytes_meta == fallback["f16"].bytes_meta
    with pytest.raises(RuntimeError, match="refused"):
        RawContext(model64, n_ctx=2048, centroid_type=2)  # Q4_0


def test_pins_from_a_dense_question_steer_the_answer_until_forgotten(model64):
    """With pins, a question read in one dense batch also sums its attention per region (reading K
    once more, counted); the step after it reads the pinned regions (here its whole budget), which
    changes what it reads, and a removal of cells forgets them: the same step decoded again reads
    what it reads without pins."""
    m = llama_cpp()
    question, step = doc_tokens(9, seed=7), doc_tokens(1, seed=8)
    n_layer, n_head_kv, head_dim = 2, 1, 64
    plain = Route(mode="geometric", top_k=2, region=64, shortlist=0, keep=0.9, pin=0)
    pinned = Route(mode="geometric", top_k=2, region=64, shortlist=0, keep=0.9, pin=2)

    def ask(raw, route):
        m.llama_memory_seq_rm(m.llama_get_memory(raw.ctx), 0, N_DOC, -1)
        raw.n_past = N_DOC
        apply_route(raw.ctx, route)
        raw.decode(question)
        q_stats = read_stats(raw.ctx)
        raw.decode(step)
        return q_stats, read_stats(raw.ctx)

    raw = RawContext(model64, n_ctx=2048)
    try:
        raw.decode(doc_tokens(N_DOC))
        q_plain, st_plain = ask(raw, plain)
        q_pin, st_pin = ask(raw, pinned)
        # the same step again, without a new question: the removal of its cell forgot the pins
        m.llama_memory_seq_rm(m.llama_get_memory(raw.ctx), 0, N_DOC + len(question), -1)
        raw.n_past = N_DOC + len(question)
        raw.decode(step)
        st_forgot = read_stats(raw.ctx)
    finally:
        raw.close()
    n_kv, n_reg = q_pin.n_kv, st_pin.n_kv // 64
    assert q_plain.bytes_meta == 0
    assert q_pin.bytes_meta == n_layer * n_kv * n_head_kv * head_dim * 2  # K (F16) read once more
    assert st_pin.bytes_meta - st_plain.bytes_meta == n_layer * n_reg * n_head_kv * 4  # the pins' mass
    assert st_pin.bytes_kv == st_plain.bytes_kv
    assert not np.array_equal(st_pin.regions, st_plain.regions), "the pins changed nothing"
    np.testing.assert_array_equal(st_forgot.regions, st_plain.regions)


def test_following_reads_the_next_region_of_the_first_choice_and_no_region_twice(model64):
    """With follow 1 a step reads the region after its first choice besides its top-k: one region more
    than without, every region at most once, the followed one among them where routing may choose it.
    With top-k one short of every candidate, the followed region completes them: dense attention exactly
    (a region read twice would weigh its cells twice)."""
    steps = doc_tokens(6, seed=9)
    geo = dict(mode="geometric", region=64, shortlist=0, keep=0.9, pin=0)
    raw = RawContext(model64, n_ctx=2048)
    try:
        raw.decode(doc_tokens(N_DOC))
        dense = decode_steps(raw, N_DOC, steps, Route(mode="full"))
        every = decode_steps(raw, N_DOC, steps, Route(top_k=1000, **geo))
        n_fixed = 3  # the sink region and the window's two
        n_cand = every[0][1].n_sel - n_fixed
        plain = decode_steps(raw, N_DOC, steps, Route(top_k=2, **geo))
        follow = decode_steps(raw, N_DOC, steps, Route(top_k=2, follow=1, **geo))
        rest = decode_steps(raw, N_DOC, steps, Route(top_k=n_cand - 1, follow=1, **geo))
    finally:
        raw.close()
    assert n_cand > 4
    followed = 0
    for (_, st_plain), (_, st_follow) in zip(plain, follow):
        assert st_follow.n_sel == st_plain.n_sel + 1
        for layer in range(st_follow.regions.shape[0]):
            for head in range(st_follow.regions.shape[1]):
                read = [int(r) for r in st_follow.regions[layer, head]]
                assert len(set(read)) == len(read), f"a region read twice: {read}"
                if st_follow is follow[0][1]:
                    # the first step chooses afresh: what it read without follow, and one region more,
                    # the one after its best choice unless routing may not choose that one
                    before = set(int(r) for r in st_plain.regions[layer, head])
                    [extra] = set(read) - before
                    assert before <= set(read)
                    followed += extra - 1 in before
    assert followed, "the first step read no region after one of its choices"
    # top-k one short of every candidate and the followed one: every region, dense attention
    assert all(st.n_sel == n_fixed + n_cand for _, st in rest)
    diff = max(float(np.max(np.abs(a[0] - b[0]))) for a, b in zip(dense, rest))
    scale = max(float(np.max(np.abs(a[0]))) for a in dense)
    assert diff <= 5e-3 * max(1.0, scale), f"max |logit diff| {diff} (scale {scale})"
    assert [int(np.argmax(a[0])) for a in dense] == [int(np.argmax(b[0])) for b in rest]


def test_route_graph_uses_gpu_ops_only(tiny_model):
    rec = GraphRecorder()
    raw = RawContext(tiny_model, n_ctx=2048, recorder=rec)
    try:
        raw.decode(doc_tokens(700))
        apply_route(raw.ctx, Route(mode="geometric", top_k=2, region=64))
        rec.recording = True
        raw.decode([7])
        rec.recording = False
    finally:
        raw.close()
    ops = {op for op, _ in rec.nodes}
    names = {name.rsplit("-", 1)[0] for _, name in rec.nodes}
    assert {"kv_route_scores", "kv_route_sel", "kv_route_fattn", "kv_cent_upd"} <= names
    assert ops <= GPU_OPS, f"ops outside the CUDA/Metal set: {sorted(ops - GPU_OPS)}"


def test_routing_survives_rewind_and_reload(tiny_model, tmp_path, monkeypatch):
    """Centroids are rebuilt after seq_rm and after a state load: the same query picks the same regions."""
    from kvlocal.session import Session

    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(tmp_path))
    text = " ".join(f"entry {i}: value {i * 7 % 101}." for i in range(80))
    route = Route(mode="geometric", top_k=2, region=32)

    def first_regions(session):
        for event in session.ask("which value?", route=route, max_tokens=2, want_regions=True):
            return event.stats.regions.copy()

    s1 = Session(str(tiny_model), threads=2)
    assert not s1.load_document(text).cache_hit
    a = first_regions(s1)
    b = first_regions(s1)  # after the rewind (seq_rm) of the first answer
    s1.close()
    s2 = Session(str(tiny_model), threads=2)
    assert s2.load_document(text).cache_hit
    c = first_regions(s2)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


def test_invalid_route_settings_are_usage_errors(tiny_model):
    with pytest.raises(UsageError):
        Route(mode="sideways")
    with pytest.raises(UsageError):
        Route(region=48)
    raw = RawContext(tiny_model, n_ctx=512)
    try:
        with pytest.raises(UsageError):  # smaller than the centroid block (16)
            apply_route(raw.ctx, Route(region=8))
    finally:
        raw.close()


def test_centroid_block_is_a_context_parameter(tiny_model):
    """llama_context_params.kv_centroid_block sets the cache's block (0, none, by default: the
    summaries cost nothing unless asked for); a value that is not a power of two up to 256 makes
    context creation fail."""
    api = route_api()
    for block, want in ((None, 0), (16, 16), (8, 8), (0, 0)):
        raw = RawContext(tiny_model, n_ctx=2048, centroid_block=block)
        try:
            assert api.llama_kv_route_cent_blk(raw.ctx) == want
        finally:
            raw.close()
    for bad in (48, 512, -4):
        with pytest.raises(RuntimeError, match="refused"):
            RawContext(tiny_model, n_ctx=2048, centroid_block=bad)


def test_centroid_block_is_chosen_per_session(tiny_model, tmp_path, monkeypatch):
    """A coarser centroid block scans fewer centroid bytes; a state saved under another block is
    restored with its centroids rebuilt for the new one (they are not part of the state)."""
    from kvlocal.session import Session

    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(tmp_path))
    text = " ".join(f"entry {i}: value {i * 7 % 101}." for i in range(120))
    route = Route(mode="geometric", top_k=2, region=64, shortlist=0, keep=0)

    def first_step(session):
        for event in session.ask("which value?", route=route, max_tokens=1, want_regions=True):
            return event.stats

    s16 = Session(str(tiny_model), threads=2, centroid_block=16)
    assert not s16.load_document(text).cache_hit  # saves the state
    st16 = first_step(s16)
    s16.close()
    fresh = Session(str(tiny_model), threads=2, centroid_block=64)
    fresh.load_document(text, use_cache=False)
    st_fresh = first_step(fresh)
    fresh.close()
    s64 = Session(str(tiny_model), threads=2, centroid_block=64)
    assert s64.load_document(text).cache_hit
    st64 = first_step(s64)
    with pytest.raises(UsageError, match="multiple of the centroid block"):
        next(s64.ask("which value?", route=Route(region=32, shortlist=0), max_tokens=1))
    s64.close()
    n_layer, n_head_kv, head_dim = 2, 2, 16
    n_reg = st64.n_kv // 64
    assert st16.bytes_meta == n_layer * n_reg * 4 * n_head_kv * head_dim * 2
    assert st64.bytes_meta == n_layer * n_reg * 1 * n_head_kv * head_dim * 2
    np.testing.assert_array_equal(st64.regions, st_fresh.regions)
    with pytest.raises(UsageError):
        Session(str(tiny_model), centroid_block=48)


def test_iswa_routes_the_full_attention_layers(iswa_model):
    """In an iSWA model the non-SWA layers route (every region selected reproduces dense) and the
    SWA layers read their window densely, counted as such."""
    raw = RawContext(iswa_model, n_ctx=2048)
    try:
        dense, routed, small = oracle_runs(raw, doc_tokens(8, seed=2))
        [(_, win)] = decode_steps(raw, N_DOC, [5], Route(mode="window", top_k=3, region=64))
    finally:
        raw.close()
    diff = max(float(np.max(np.abs(a[0] - b[0]))) for a, b in zip(dense, routed))
    # OLMo2's q/k norms make attention sharp, so the CPU flash-attention kernel's F16 accumulation
    # of V shows: measured 1.1e-2 for routed vs 2.2e-3 for dense (which splits its 1.5k rows over
    # the 2 threads; on one thread dense reaches 8e-3 against attention without flash attention).
    # Dropping regions (top-1) moves the logits by 0.25-0.37. tests/fa_precision_probe.py measures it.
    assert diff <= 2e-2, f"max |logit diff| {diff}"
    assert max(float(np.max(np.abs(a[0] - b[0]))) for a, b in zip(dense, small)) > 10 * diff
    for st in [s for _, s in routed + small] + [win]:
        assert st.fallback == 0
        assert st.n_layer == 4 and st.n_layer_routed == 2
        assert st.layers.tolist() == [1, 3]
    # window mode: the routed layers read 6 regions of 64 cells per KV head; each SWA layer reads
    # the cells of its own cache (full-size by llama.cpp's default, swa_full), the same in the
    # routed and the dense count
    n_head_kv, head_dim = 2, 16
    full_layers_dense = 2 * n_head_kv * win.n_kv
    swa_rows = win.rows_dense - full_layers_dense
    assert 0 < swa_rows <= full_layers_dense
    assert win.rows_read == 2 * n_head_kv * 6 * 64 + swa_rows
    assert win.bytes_kv == win.rows_read * 2 * head_dim * 2
    assert win.bytes_meta == 0
    [(_, d)] = dense[:1]
    assert d.rows_read == d.rows_dense and d.n_layer_routed == 0


def test_iswa_dense_baseline_is_one_number_whatever_the_mode_or_history(iswa_model, tmp_path, monkeypatch):
    """The dense count is what a dense step physically reads; a sliding-window layer reads every cell
    its cache view spans. A fresh prefill used to leave that view spanning the whole document (masked
    cells) while a state restored from the cache packs the window at the front: the same document
    then counted 282,624 dense rows fresh and 164,864 restored. Now a fresh prefill is packed as a
    restored one is, so every mode and both histories count (and read) the same."""
    from kvlocal.session import Session

    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(tmp_path))
    text = " ".join(f"the world is hello {i}" for i in range(120))  # 1,500 tokens, past the 128-token window
    counts, answers = set(), set()
    for history in ("fresh", "restored"):
        session = Session(str(iswa_model), threads=2, n_ctx=4096)
        try:
            assert session.load_document(text).cache_hit == (history == "restored")
            for mode in ("full", "geometric", "window"):
                answer = session.answer("hello world?", route=Route(mode=mode, top_k=2, region=64), max_tokens=4)
                counts.add((mode, answer.rows_dense, answer.bytes_dense, answer.rows_read))
                if mode == "full":
                    answers.add(answer.text)
                    assert answer.rows_read == answer.rows_dense
                else:
                    assert answer.rows_read < answer.rows_dense
        finally:
            session.close()
    assert len({(dense, nbytes) for _, dense, nbytes, _ in counts}) == 1, counts
    assert len(counts) == 3, counts  # each mode reads the same fresh and restored
    assert len(answers) == 1


def test_a_full_shortlist_selects_what_one_pass_selects(tiny_model):
    """With every candidate shortlisted, the fine centroids rank all of them: the regions chosen
    in two levels are the one-pass choice (an exact oracle for the gather through the shortlist)."""
    raw = RawContext(tiny_model, n_ctx=2048)
    try:
        raw.decode(doc_tokens(N_DOC))
        steps = doc_tokens(4, seed=2)
        one = decode_steps(raw, N_DOC, steps, Route(mode="geometric", top_k=3, region=64, shortlist=0, keep=0))
        two = decode_steps(raw, N_DOC, steps, Route(mode="geometric", top_k=3, region=64, shortlist=1000, keep=0))
    finally:
        raw.close()
    for (la, a), (lb, b) in zip(one, two):
        assert np.array_equal(np.sort(a.regions, axis=-1), np.sort(b.regions, axis=-1))
        np.testing.assert_allclose(la, lb, rtol=0, atol=1e-5)


def test_a_tight_shortlist_follows_the_coarse_centroids(tiny_model):
    """With a shortlist of k, the coarse centroids alone choose the regions: the same regions as one
    pass over centroids of 64 cells (the coarse centroid is the mean of its fine ones, which is the
    64-cell mean when every cell is filled)."""
    steps = doc_tokens(3, seed=4)
    raw = RawContext(tiny_model, n_ctx=2048)
    try:
        raw.decode(doc_tokens(N_DOC))
        two = decode_steps(raw, N_DOC, steps, Route(mode="geometric", top_k=3, region=64, shortlist=3, keep=0))
    finally:
        raw.close()
    raw = RawContext(tiny_model, n_ctx=2048, centroid_block=64)
    try:
        raw.decode(doc_tokens(N_DOC))
        coarse = decode_steps(raw, N_DOC, steps, Route(mode="geometric", top_k=3, region=64, shortlist=0, keep=0))
    finally:
        raw.close()
    for (_, a), (_, b) in zip(two, coarse):
        assert np.array_equal(np.sort(a.regions, axis=-1), np.sort(b.regions, axis=-1))


def test_selection_memory_is_forgotten_when_the_question_is_rewound(tiny_model):
    """keep > 0 carries each region's share from step to step; removing the answer's cells (a new
    question) forgets it, so the same steps after a rewind choose the same regions again, while
    the memory does change what later steps choose."""
    raw = RawContext(tiny_model, n_ctx=2048)
    try:
        raw.decode(doc_tokens(N_DOC))
        steps = doc_tokens(8, seed=3)
        kept = Route(mode="geometric", top_k=2, region=64, shortlist=8, keep=0.999, pin=0)
        first = decode_steps(raw, N_DOC, steps, kept)
        again = decode_steps(raw, N_DOC, steps, kept)
        fresh = decode_steps(raw, N_DOC, steps, Route(mode="geometric", top_k=2, region=64, shortlist=8, keep=0))
        one_pass = decode_steps(raw, N_DOC, steps, Route(mode="geometric", top_k=2, region=64, shortlist=0,
                                                                 keep=0.95))
    finally:
        raw.close()
    for (la, a), (lb, b) in zip(first, again):
        assert np.array_equal(a.regions, b.regions)
        np.testing.assert_allclose(la, lb, rtol=0, atol=1e-6)
    # the first step has nothing to remember: the same choice as without memory
    assert np.array_equal(np.sort(first[0][1].regions, -1), np.sort(fresh[0][1].regions, -1))
    assert any(not np.array_equal(np.sort(a.regions, -1), np.sort(b.regions, -1))
               for (_, a), (_, b) in zip(first[1:], fresh[1:])), "the memory never changed a choice"
    # the memory is read and written back: 2 x n_reg floats per KV head and layer, beside the centroids
    n_reg = first[0][1].n_kv // 64
    assert first[0][1].bytes_meta == fresh[0][1].bytes_meta + 2 * 2 * n_reg * 2 * 4
    assert all(s.n_layer_routed == s.n_layer for _, s in one_pass)


@pytest.mark.parametrize("shortlist", [0, 16])
def test_all_regions_with_memory_reproduce_dense(tiny_model, shortlist):
    raw = RawContext(tiny_model, n_ctx=2048)
    try:
        raw.decode(doc_tokens(N_DOC))
        steps = doc_tokens(5, seed=1)
        dense = decode_steps(raw, N_DOC, steps, Route(mode="full"))
        routed = decode_steps(raw, N_DOC, steps, Route(mode="geometric", top_k=1000, region=64,
                                                              shortlist=shortlist, keep=0.9))
    finally:
        raw.close()
    diff = max(float(np.max(np.abs(a - b))) for (a, _), (b, _) in zip(dense, routed))
    assert diff <= 5e-3


def test_selection_memory_lasts_through_the_sessions_steps(tiny_model, tmp_path, monkeypatch):
    """Session.ask decodes through llama-cpp-python's eval(), which removes the cells past its token
    count before every batch (a removal that finds nothing): the memory must survive that, change
    what later steps choose, and be forgotten by the next question's rewind (same choices again)."""
    from kvlocal.session import Session

    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(tmp_path))
    text = " ".join(f"entry {i}: value {i * 7 % 101}." for i in range(120))
    session = Session(str(tiny_model), threads=2)
    session.load_document(text, use_cache=False)

    def regions(keep):
        route = Route(mode="geometric", top_k=2, region=64, shortlist=8, keep=keep)
        steps = [e.stats for e in session.ask("which value is it?", route=route, max_tokens=6, want_regions=True)
                 if getattr(e, "stats", None) is not None]
        return [np.sort(s.regions, axis=-1) for s in steps]

    try:
        kept, again, fresh = regions(0.999), regions(0.999), regions(0.0)
    finally:
        session.close()
    assert len(kept) == len(fresh) > 2
    assert all(np.array_equal(a, b) for a, b in zip(kept, again))
    assert any(not np.array_equal(a, b) for a, b in zip(kept, fresh)), "the memory never changed a choice"


# -- a ubatch of several tokens (the question read at once, patch 0007) --------------------------------


def decode_batch(raw: RawContext, n_prefix: int, tokens: list[int], route: Route, batch_top_k: int):
    """Rewind to the prefix, set the route, decode `tokens` as one ubatch: the last logits and the stats."""
    m = llama_cpp()
    m.llama_memory_seq_rm(m.llama_get_memory(raw.ctx), 0, n_prefix, -1)
    raw.n_past = n_prefix
    apply_route(raw.ctx, route, batch_top_k=batch_top_k)
    raw.decode(tokens)
    return raw.logits(), read_stats(raw.ctx)


@pytest.mark.parametrize("shortlist", [0, 16])
def test_a_routed_batch_of_every_region_reproduces_the_dense_batch(tiny_model, shortlist):
    raw = RawContext(tiny_model, n_ctx=2048)
    batch = doc_tokens(20, seed=2)
    route = Route(mode="geometric", top_k=1, region=64, shortlist=shortlist, pin=0)
    try:
        raw.decode(doc_tokens(N_DOC))
        dense, dense_st = decode_batch(raw, N_DOC, batch, Route(mode="full"), 0)
        kept, kept_st = decode_batch(raw, N_DOC, batch, route, 0)  # top_k_batch 0: the batch reads densely
        every, every_st = decode_batch(raw, N_DOC, batch, route, 1000)
        one, one_st = decode_batch(raw, N_DOC, batch, route, 1)
    finally:
        raw.close()
    scale = float(np.max(np.abs(dense)))
    diff = float(np.max(np.abs(dense - every)))
    assert diff <= 5e-3 * max(1.0, scale), f"max |logit diff| {diff} (scale {scale})"
    assert float(np.max(np.abs(dense - kept))) <= 1e-6 * max(1.0, scale)
    assert float(np.max(np.abs(dense - one))) > diff  # one region per head really leaves rows out
    # a dense batch counts one read of the cache, whatever the mode
    for st, fallback in ((dense_st, 1), (kept_st, 6)):
        assert st.n_layer_routed == 0 and st.fallback == fallback
        assert st.rows_read == st.rows_dense and st.bytes_kv == st.bytes_dense and st.bytes_meta == 0
    for st in (every_st, one_st):
        assert st.n_layer_routed == st.n_layer == 2 and st.fallback == 0
        assert st.rows_dense == dense_st.rows_dense  # the same cache, read once for the batch
    assert one_st.rows_read < every_st.rows_read < every_st.rows_dense + 1


def test_a_window_batch_reads_the_window_before_its_first_token(tiny_model):
    raw = RawContext(tiny_model, n_ctx=2048)
    batch = doc_tokens(100, seed=4)
    try:
        raw.decode(doc_tokens(N_DOC))
        route = Route(mode="window", top_k=1, region=64, window=64, sinks=64)
        _, st = decode_batch(raw, N_DOC, batch, route, 2)
    finally:
        raw.close()
    # the batch holds positions 1500..1599 -> regions 0..24 are used; the window reaches 64 cells
    # before position 1500: ceil((64 + 99)/64) = 3 regions (22..24), the window mode's 2 before them
    n_used_regions = (N_DOC + len(batch) - 1) // 64 + 1
    expected = [0] + list(range(n_used_regions - 5, n_used_regions))
    assert st.n_sel == len(expected)
    for layer in range(2):
        for head in range(2):
            assert sorted(st.regions[layer, head].tolist()) == expected
    assert st.rows_read == 2 * 2 * len(expected) * 64


def test_a_routed_batch_uses_gpu_ops_only(tiny_model):
    rec = GraphRecorder()
    raw = RawContext(tiny_model, n_ctx=2048, recorder=rec)
    try:
        raw.decode(doc_tokens(700))
        apply_route(raw.ctx, Route(mode="geometric", top_k=2, region=64), batch_top_k=3)
        rec.recording = True
        raw.decode(doc_tokens(9, seed=5))
        rec.recording = False
    finally:
        raw.close()
    ops = {op for op, _ in rec.nodes}
    names = {name.rsplit("-", 1)[0] for _, name in rec.nodes}
    assert {"kv_route_scores", "kv_route_sel", "kv_route_fattn"} <= names
    assert ops <= GPU_OPS, f"ops outside the CUDA/Metal set: {sorted(ops - GPU_OPS)}"
