"""A routed decode step that attends to its regions in place (llama_kv_route_params.attn, patches 0005 and 0007).

In place, flash attention runs over the cache itself under a mask that is finite only in the
selected regions' cells, with the number of finite cells as its sparse hint; the gather copies
those cells' rows out first. Both must attend to the same cells: the every-region oracle holds in
place, in place and gathered give the same logits for the same selection, the read counts agree
(the mask is counted as metadata), and the graph is the one asked for. On a CPU build `auto`
gathers; CUDA's choice is checked by the GPU check (tests/test_gpu_ops.py, .ci/gpu-check).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

pytestmark = pytest.mark.engine

from engine_probe import GraphRecorder, RawContext, routed_steps  # noqa: E402
from synth_gguf import write_tiny_qwen2  # noqa: E402

from kvlocal.engine import llama_cpp  # noqa: E402
from kvlocal.errors import UsageError  # noqa: E402
from kvlocal.routing import Route  # noqa: E402

N_DOC = 1500
STEPS = [17, 93, 5, 211, 42]


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    """A tiny qwen2 with 3 query heads per KV head (the KV heads take their own mask slices)."""
    return write_tiny_qwen2(tmp_path_factory.mktemp("gqa") / "tiny-gqa.gguf", n_embd=96, n_head=6, n_head_kv=2, seed=7)


def doc_tokens(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 250, size=n)]


def runs(model, routes: list[Route], recorder: GraphRecorder | None = None):
    """Prefill N_DOC tokens once, then decode STEPS with each route from the same prefix."""
    raw = RawContext(model, n_ctx=2048, recorder=recorder)
    m = llama_cpp()
    out = []
    try:
        raw.decode(doc_tokens(N_DOC))
        for route in routes:
            m.llama_memory_seq_rm(m.llama_get_memory(raw.ctx), 0, N_DOC, -1)
            raw.n_past = N_DOC
            if recorder is not None:
                recorder.nodes.clear()
                recorder.recording = True
            out.append((routed_steps(raw, STEPS, route), list(recorder.nodes) if recorder else []))
            if recorder is not None:
                recorder.recording = False
    finally:
        raw.close()
    return out


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x[0] - y[0]))) for x, y in zip(a, b))


@pytest.mark.parametrize("which", ["tiny", "gqa"])
def test_every_region_in_place_reproduces_dense(tiny_model, gqa_model, which):
    model = tiny_model if which == "tiny" else gqa_model
    (dense, _), (every, _), (one, _) = runs(model, [
        Route(mode="full"),
        Route(mode="geometric", top_k=1000, region=64, attention="in-place"),
        Route(mode="geometric", top_k=1, region=64, attention="in-place"),
    ])
    scale = max(float(np.max(np.abs(a[0]))) for a in dense)
    diff = max_diff(dense, every)
    assert diff <= 5e-3 * max(1.0, scale), f"max |logit diff| {diff} (scale {scale})"
    assert [int(np.argmax(a[0])) for a in dense] == [int(np.argmax(b[0])) for b in every]
    assert all(s.n_layer_routed == s.n_layer > 0 for _, s in every)
    assert max_diff(dense, one) > diff  # a tight budget in place changes the result


@pytest.mark.parametrize("mode", ["geometric", "window", "random"])
def test_in_place_attends_to_the_cells_the_gather_reads(gqa_model, mode):
    route = Route(mode=mode, top_k=2, region=64, seed=3)
    (gathered, _), (in_place, _) = runs(gqa_model, [replace(route, attention="gather"),
                                                    replace(route, attention="in-place")])
    for (lg, sg), (li, si) in zip(gathered, in_place):
        # the same regions, the same cells read; the mask over every cell is counted as metadata
        assert np.array_equal(np.sort(sg.regions, axis=-1), np.sort(si.regions, axis=-1))
        assert si.rows_read == sg.rows_read and si.bytes_kv == sg.bytes_kv
        n_layer, n_head_kv = sg.regions.shape[:2]
        assert si.bytes_meta - sg.bytes_meta == n_layer * n_head_kv * si.n_kv * 2
        # flash attention sums the same cells in another order
        assert float(np.max(np.abs(lg - li))) <= 5e-3 * max(1.0, float(np.max(np.abs(lg))))


def test_the_graph_is_the_path_asked_for(gqa_model):
    recorder = GraphRecorder()
    (_, gather_nodes), (_, place_nodes), (_, auto_nodes) = runs(gqa_model, [
        Route(mode="geometric", top_k=2, region=64, attention="gather"),
        Route(mode="geometric", top_k=2, region=64, attention="in-place"),
        Route(mode="geometric", top_k=2, region=64),
    ], recorder)
    names = lambda nodes: {name.split("-")[0] for _, name in nodes}  # noqa: E731
    ops = lambda nodes: [op for op, _ in nodes]  # noqa: E731
    assert "kv_route_mask" in names(place_nodes) and "kv_route_mask" not in names(gather_nodes)
    # in place: no K/V rows copied out, one flash attention per layer over the whole cache
    assert ops(place_nodes).count("GET_ROWS") < ops(gather_nodes).count("GET_ROWS")
    assert ops(place_nodes).count("FILL") == ops(place_nodes).count("FLASH_ATTN_EXT") > 0
    # a CPU build's default gathers (its flash attention has no sparse kernel)
    assert "kv_route_mask" not in names(auto_nodes)


def test_an_unknown_attention_path_is_a_usage_error():
    with pytest.raises(UsageError, match="attention path"):
        Route(attention="sideways")
