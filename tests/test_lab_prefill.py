"""The prefill lab: chunk geometry as the engine plans a routed ubatch, rules and replay on hand cases,
and the batch capture on a tiny model (a ubatch's queries are the ones single steps would have)."""

from __future__ import annotations

import numpy as np
import pytest

from kvlocal.lab import prefill as lp
from kvlocal.lab.rules import Geometry

GEO = Geometry(region=4, sinks=4, window=4)


def spike_capture(n_cells: int = 32, spike: int = 9, dim: int = 4, first: int = 24) -> lp.PrefillCapture:
    """One layer, one KV head, two query heads; cells [first, n_cells) are a captured ubatch whose
    queries all point at the key of cell `spike` (40 on channel 0; every other key 0); value i = i."""
    keys = np.zeros((1, n_cells, dim), np.float16)
    keys[0, spike, 0] = 40.0
    values = np.zeros((1, n_cells, dim), np.float16)
    values[0, :, 1] = np.arange(n_cells)
    q = np.zeros((n_cells - first, 1, 2, dim), np.float16)
    q[:, 0, :, 0] = 1.0
    return lp.PrefillCapture("spike", keys, values, np.array([first]), [q], np.array([[first + 1, first + 3]]))


def test_chunk_geometry_matches_the_engine_plan():
    # llama-kv-cache.cpp route_plan: the window reaches `window` cells before the chunk's first token
    fixed, cand = Geometry(region=64, sinks=64, window=128).chunk_fixed_and_candidates(640, 1152)
    assert fixed.tolist() == [0] + list(range(8, 18))  # ceil((128 + 511) / 64) = 10 window regions
    assert cand.tolist() == list(range(1, 8))
    fixed, cand = GEO.chunk_fixed_and_candidates(24, 28)
    assert fixed.tolist() == [0, 5, 6]
    assert cand.tolist() == [1, 2, 3, 4]


def test_fact_ubatches_are_the_routed_ones_that_hold_a_fact_start():
    facts = np.array([[100, 130], [600, 620], [1020, 1030], [1500, 1600]])
    assert lp.fact_ubatches(facts, 1700, 512, 512) == [(512, 1024), (1024, 1536)]
    assert lp.fact_ubatches(facts, 1700, 512, 0) == [(0, 512), (512, 1024), (1024, 1536)]


def test_every_region_read_reproduces_dense_attention():
    cap = spike_capture()
    totals = lp.replay_prefill(cap, ["engine", "oracle-sum"], [8, 2], [100], GEO, block=2,
                               estimates=list(lp.ESTIMATES))
    for t in totals.values():
        assert max(t.err_fact + t.err_rest) < 1e-5
        assert set(t.err_est) == set(lp.ESTIMATES) and max(max(v) for v in t.err_est.values()) < 1e-5
        assert min(t.recall_fact + t.recall_rest) == pytest.approx(1.0, abs=1e-6)
        assert t.rows_read == t.rows_dense


def test_the_spike_region_is_chosen_and_a_wrong_one_loses_it():
    cap = spike_capture()
    good = lp.replay_prefill(cap, ["engine", "oracle-sum"], [8], [1], GEO, block=2)
    for t in good.values():
        assert max(t.err_fact + t.err_rest) < 1e-3  # the spike's region (2) holds ~all the mass
    # a rule that ranks by the last candidate region only reads region 4
    lp.PREFILL_RULES["_last"] = lambda cs, cand, k: np.flatnonzero(cand)[-k:]
    try:
        bad = lp.replay_prefill(cap, ["_last"], [8], [1], GEO, block=2)[("_last", 8, 1)]
    finally:
        del lp.PREFILL_RULES["_last"]
    assert min(bad.err_fact) > 0.5 and max(bad.recall_fact) < 0.01


def test_engine_pooling_by_hand():
    # two rows, three candidate regions; row 0 is sure of region 0, row 1 spreads over 1 and 2
    fine = np.array([[10.0, 0.0, 0.0], [0.0, 1.0, 1.1]])
    cs = lp.ChunkScores(fine=fine, coarse=fine, mass=np.zeros((1, 3)), scale=1.0)
    cand = np.ones(3, bool)
    # max share: region 0 (share ~1 of row 0) first, then region 2 (row 1's larger share)
    assert lp.engine_rule(0)(cs, cand, 2).tolist() == [0, 2]
    # the coarse shortlist of 1 x k keeps only what the coarse scores rank first
    coarse = np.array([[0.0, 0.0, 5.0], [0.0, 0.0, 5.0]])
    cs2 = lp.ChunkScores(fine=fine, coarse=coarse, mass=np.zeros((1, 3)), scale=1.0)
    assert lp.engine_rule(1)(cs2, cand, 1).tolist() == [2]


def test_capture_round_trip(tmp_path):
    cap = spike_capture()
    cap.save(tmp_path / "c.npz")
    back = lp.PrefillCapture.load(tmp_path / "c.npz")
    assert np.array_equal(back.doc_keys, cap.doc_keys) and np.array_equal(back.queries[0], cap.queries[0])
    assert back.starts.tolist() == [24] and back.facts.tolist() == [[25, 27]]


@pytest.mark.engine
def test_batch_capture_matches_single_steps(tmp_path):
    """The queries of a 24-token ubatch are, row for row, the ones 24 single decode steps record."""
    from synth_gguf import write_tiny_qwen2

    from kvlocal.engine import llama_cpp
    from kvlocal.lab.capture import BatchQCapture, QKCapture

    path = write_tiny_qwen2(tmp_path / "tiny.gguf", n_embd=128, n_head=2, n_head_kv=1, seed=3)
    module = llama_cpp()
    tokens = list(range(3, 27))
    batch = BatchQCapture(n_layer=2, n_head=2, head_dim=64)
    with batch.installed():
        llm = module.Llama(model_path=str(path), n_ctx=256, n_batch=64, n_ubatch=64, flash_attn=True, verbose=False)
    llm.eval(list(range(30, 46)))
    batch.active = True
    llm.eval(tokens)
    batch.active = False
    q_batch = batch.take(len(tokens))
    assert q_batch.shape == (24, 2, 2, 64)

    steps = QKCapture(n_layer=2, n_head=2, n_head_kv=1, head_dim=64)
    with steps.installed():
        llm2 = module.Llama(model_path=str(path), n_ctx=256, n_batch=64, n_ubatch=64, flash_attn=True, verbose=False)
    llm2.eval(list(range(30, 46)))
    steps.active = True
    for t in tokens:
        llm2.eval([t])
    steps.active = False
    q_steps, _ = steps.steps.arrays()
    np.testing.assert_allclose(q_batch, q_steps, rtol=1e-3, atol=1e-3)
    with pytest.raises(Exception, match="layers"):
        batch.take(len(tokens))  # taken once: nothing is left


def test_estimate_of_uniform_regions_is_exact():
    """Regions whose cells share one key and one value are their means: with every unread region
    estimated, the output is the dense one; without, it is not."""
    rng = np.random.default_rng(1)
    n_cells, dim, first = 32, 4, 24
    base_k, base_v = rng.normal(size=(8, dim)), rng.normal(size=(8, dim))
    keys = np.repeat(base_k, 4, axis=0)[None].astype(np.float16)  # 8 regions of 4 identical cells
    values = np.repeat(base_v, 4, axis=0)[None].astype(np.float16)
    q = rng.normal(size=(n_cells - first, 1, 2, dim)).astype(np.float16)
    cap = lp.PrefillCapture("flat", keys, values, np.array([first]), [q], np.array([[first, n_cells]]))
    t = lp.replay_prefill(cap, ["engine"], [8], [1], GEO, block=2, estimates=["region", "block"])[("engine", 8, 1)]
    assert min(t.err_fact) > 1e-3  # one of four candidate regions read: not dense
    for name in ("region", "block"):
        assert max(t.err_est[name]) < 2e-3, name


def test_cli_replays_a_saved_capture_without_the_engine(tmp_path, monkeypatch):
    """`kvlocal lab prefill` finds the capture it would have made under its name and only replays it;
    the table goes to stdout and lab-prefill.json (one row per rule, chunk and budget)."""
    import json

    from typer.testing import CliRunner

    from kvlocal import cli, cli_common

    def refuse(*args, **kwargs):
        raise AssertionError("the engine was opened although the capture was saved")

    monkeypatch.setattr(cli_common, "open_session", refuse)
    rng = np.random.default_rng(2)
    n_cells, dim, first = 1024, 128, 512  # 16 regions of 64; the ubatch [512, 1024) holds a fact
    keys = rng.normal(size=(1, n_cells, 2 * dim)).astype(np.float16)
    values = rng.normal(size=(1, n_cells, 2 * dim)).astype(np.float16)
    q = rng.normal(size=(n_cells - first, 1, 4, dim)).astype(np.float16)
    lp.PrefillCapture("x", keys, values, np.array([first]), [q], np.array([[600, 620]])).save(
        tmp_path / "prefill-lookalike-8192-s0-d10-from512.npz")
    result = CliRunner().invoke(cli.app, ["lab", "prefill", "--lengths", "8k", "--seeds", "0", "--prefill-from", "512",
                                          "--rules", "engine,oracle-sum", "--budgets", "2,100", "--chunks", "512,128",
                                          "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "| engine | 128 | 2 |" in result.stdout and "| oracle-sum | 512 | 100 |" in result.stdout
    rows = json.loads((tmp_path / "lab-prefill.json").read_text())
    assert len(rows) == 8
    every = [r for r in rows if r["top_k"] == 100]
    assert all(r["err_fact"] < 1e-5 and r["read_share"] == pytest.approx(1.0) for r in every)
    assert all(r["err_fact"] > 1e-3 for r in rows if r["top_k"] == 2)
