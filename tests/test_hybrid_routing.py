"""Routed attention in a hybrid model (Qwen3.5's layout: Gated DeltaNet layers with a recurrent state,
a full-attention layer every fourth), on a tiny synthetic qwen35 (tests/synth_gguf.py).

The attention layers keep block summaries and route as a standard cache does (patch 0011); the
recurrent layers run as they are. A hybrid model's recurrent state cannot be cut back by removing
cells, so every run here starts from the document's state restored, as the session's rewind does.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytestmark = pytest.mark.engine

from engine_probe import GraphRecorder, RawContext, routed_steps  # noqa: E402
from synth_gguf import write_tiny_qwen35  # noqa: E402

from kvlocal.engine import apply_route, llama_cpp  # noqa: E402
from kvlocal.routing import Route  # noqa: E402

N_DOC = 1500
ATTN_LAYERS = [3, 7]  # of 8: every fourth layer attends fully
N_HEAD_KV, HEAD_DIM = 2, 64
# ops that both ggml-cuda and ggml-metal implement (tests/test_gpu_ops.py checks them against supports_op)
GPU_OPS = {
    "NONE", "ADD", "MUL", "SCALE", "CPY", "CONT", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE",
    "GET_ROWS", "SET_ROWS", "MUL_MAT", "TOP_K", "CONCAT", "REPEAT", "ARANGE", "POOL_2D",
    "FLASH_ATTN_EXT", "RMS_NORM", "ROPE", "SWIGLU", "SOFT_MAX", "SUB", "ABS",
}


@pytest.fixture(scope="module")
def qwen35_model(tmp_path_factory):
    return write_tiny_qwen35(tmp_path_factory.mktemp("qwen35") / "tiny-qwen35.gguf", seed=7)


def doc_tokens(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 250, size=n)]


def get_state(raw: RawContext) -> bytes:
    m = llama_cpp()
    size = m.llama_state_seq_get_size(raw.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    assert m.llama_state_seq_get_data(raw.ctx, buf, size, 0) == size
    return bytes(buf)


def set_state(raw: RawContext, state: bytes, n_past: int) -> None:
    m = llama_cpp()
    m.llama_memory_clear(m.llama_get_memory(raw.ctx), True)
    buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    assert m.llama_state_seq_set_data(raw.ctx, buf, len(state), 0) == len(state)
    raw.n_past = n_past


def decode_from(raw: RawContext, state: bytes, steps: list[int], route: Route):
    """Restore the document's state, set the route, decode `steps` one at a time: logits and stats."""
    set_state(raw, state, N_DOC)
    return routed_steps(raw, steps, route)


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x[0] - y[0]))) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs(qwen35_model):
    """The document prefilled once; then dense, every region, one region, window and random steps."""
    raw = RawContext(qwen35_model, n_ctx=2048)
    try:
        assert llama_cpp().llama_model_is_hybrid(raw.model)
        raw.decode(doc_tokens(N_DOC))
        state = get_state(raw)
        steps = doc_tokens(8, seed=3)
        routes = {
            "full": Route(mode="full"),
            "all": Route(mode="geometric", top_k=1000, region=64),
            "one": Route(mode="geometric", top_k=1, region=64),
            "window": Route(mode="window", top_k=3, region=64),
            "random": Route(mode="random", top_k=3, region=64),
            "full again": Route(mode="full"),
        }
        yield {name: decode_from(raw, state, steps, route) for name, route in routes.items()}
    finally:
        raw.close()


def test_every_region_selected_reproduces_dense(runs):
    dense, routed = runs["full"], runs["all"]
    diff = max_diff(dense, routed)
    scale = max(float(np.max(np.abs(a[0]))) for a in dense)
    # flash attention accumulates the gathered rows in another order (as in tests/test_routing.py)
    assert diff <= 5e-3 * max(1.0, scale), f"max |logit diff| {diff} (scale {scale})"
    assert [int(np.argmax(a[0])) for a in dense] == [int(np.argmax(b[0])) for b in routed]
    # restoring the state reproduces a run exactly: the recurrent state came back with it
    assert max_diff(dense, runs["full again"]) == 0.0


def test_only_the_attention_layers_route(runs):
    for name in ("all", "one", "window", "random"):
        for _, st in runs[name]:
            assert st.fallback == 0, (name, st.fallback)
            assert st.n_layer == len(ATTN_LAYERS) and st.n_layer_routed == len(ATTN_LAYERS), name
            assert st.layers.tolist() == ATTN_LAYERS, name
    for _, st in runs["full"]:
        assert st.n_layer == len(ATTN_LAYERS) and st.n_layer_routed == 0
        assert st.rows_read == st.rows_dense


def test_read_counts_are_exact(runs):
    """Window mode reads the sinks, the window and top_k regions of 64 cells per KV head in each
    attention layer; the recurrent layers read no KV and are not counted."""
    for _, st in runs["window"]:
        assert st.rows_dense == len(ATTN_LAYERS) * N_HEAD_KV * st.n_kv
        assert st.rows_read == len(ATTN_LAYERS) * N_HEAD_KV * 6 * 64
        assert st.bytes_kv == st.rows_read * 2 * HEAD_DIM * 2  # K and V rows, F16
        assert st.bytes_meta == 0
    for _, st in runs["one"]:
        assert st.rows_read < st.rows_dense and st.bytes_meta > 0
    # the dense baseline is one number whatever the mode
    for i in range(len(runs["full"])):
        assert len({(runs[name][i][1].rows_dense, runs[name][i][1].bytes_dense) for name in runs}) == 1


def test_the_controls_and_a_tight_budget_differ_from_dense(runs):
    dense, exact = runs["full"], max_diff(runs["full"], runs["all"])
    for name in ("one", "window", "random"):
        assert max_diff(dense, runs[name]) > 10 * max(exact, 1e-4), name


def test_routed_step_adds_only_gpu_ops(qwen35_model):
    """The ops a routed decode step adds to the hybrid model's dense step are ones CUDA and Metal run
    (the recurrent layers' own ops are the model's, the same in both)."""
    recorded = {}
    for mode in ("full", "geometric"):
        rec = GraphRecorder()
        raw = RawContext(qwen35_model, n_ctx=2048, recorder=rec)
        try:
            raw.decode(doc_tokens(700))
            apply_route(raw.ctx, Route(mode=mode, top_k=2, region=64))
            rec.recording = True
            raw.decode([7])
            rec.recording = False
        finally:
            raw.close()
        recorded[mode] = rec.nodes
    names = {name.rsplit("-", 1)[0] for _, name in recorded["geometric"]}
    assert {"kv_route_scores", "kv_route_sel", "kv_route_fattn", "kv_cent_upd"} <= names
    routed_ops = {op for op, name in recorded["geometric"] if name.startswith(("kv_route", "kv_cent"))}
    added = {op for op, _ in recorded["geometric"]} - {op for op, _ in recorded["full"]}
    assert routed_ops | added <= GPU_OPS, f"ops outside the CUDA/Metal set: {sorted((routed_ops | added) - GPU_OPS)}"


def session_answers(model, text: str, questions: list[str], cache_dir, monkeypatch, route: Route):
    from kvlocal.session import Session

    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(cache_dir))
    session = Session(str(model), threads=2, n_ctx=4096)
    try:
        loaded = session.load_document(text)
        answers = [session.answer(q, route=route, max_tokens=6) for q in questions]
    finally:
        session.close()
    return loaded, answers


@pytest.mark.parametrize("mode", ["full", "geometric"])
def test_questions_in_a_row_answer_as_fresh_sessions_and_the_state_round_trips(qwen35_model, tmp_path, monkeypatch, mode):
    text = " ".join(f"entry {i}: the value is {i * 7 % 101}." for i in range(90))
    questions = ["which value?", "hello world?", "which value?"]
    route = Route(mode=mode, top_k=2, region=64)
    cache = tmp_path / "cache"
    loaded, in_a_row = session_answers(qwen35_model, text, questions, cache, monkeypatch, route)
    assert not loaded.cache_hit and loaded.saved
    # one prefill: each fresh session opens the state saved before any question (on a slow device, such as
    # lavapipe in .ci/vulkan-check, the prefill is what costs)
    fresh = [session_answers(qwen35_model, text, [q], cache, monkeypatch, route) for q in questions]
    assert all(reopened.cache_hit for reopened, _ in fresh)
    assert [a.text for a in in_a_row] == [answers[0].text for _, answers in fresh]
    assert [a.rows_read for a in in_a_row] == [answers[0].rows_read for _, answers in fresh]
    assert in_a_row[0].text == in_a_row[2].text and in_a_row[0].rows_read == in_a_row[2].rows_read
    # the saved state (attention cells and recurrent state) answers in a row as the prefilled one did
    reloaded, again = session_answers(qwen35_model, text, questions, cache, monkeypatch, route)
    assert reloaded.cache_hit
    assert [a.text for a in again] == [a.text for a in in_a_row]
    assert [a.rows_read for a in again] == [a.rows_read for a in in_a_row]
    if mode == "geometric":
        assert all(a.rows_read < a.rows_dense for a in in_a_row)
