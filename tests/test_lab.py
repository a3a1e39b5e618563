"""The routing lab's replay (engine-free, hand-computable cases) and its capture on a tiny model."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest

from kvlocal.lab import rules as lab_rules
from kvlocal.lab.rules import Geometry, Head, bound_rule, mean_rule, oracle_rule, replay, token_max_rule, two_level_rule

GEO = Geometry(region=4, sinks=4, window=4)


def one_spike_head(dim: int = 2) -> Head:
    """24 cells (6 regions of 4): all keys 0 except cell 9 = [10, 0, ...]; one step at position 23,
    q = [1, 0, ...]."""
    keys = np.zeros((24, dim), np.float32)
    keys[9, 0] = 10.0
    q = np.zeros((1, 1, dim), np.float32)
    q[0, 0, 0] = 1.0
    return Head(q=q, keys=keys, pos=np.array([23]), scale=1.0)


def test_geometry_matches_the_engine_plan():
    fixed, cand = GEO.fixed_and_candidates(23)
    assert fixed.tolist() == [0, 5]
    assert cand.tolist() == [1, 2, 3, 4]
    fixed, cand = Geometry(region=64, sinks=64, window=128).fixed_and_candidates(64 * 10 + 3)
    assert fixed.tolist() == [0, 9, 10]  # the window is the last two used regions, the partial one included


def test_one_spike_by_hand():
    head = one_spike_head()
    r = replay(head, GEO, mean_rule(4), [1], (9, 10))[1]
    e = math.exp(10)
    total = e + 23
    assert r.tail[0, 0] == pytest.approx((e + 15) / total, rel=1e-6)
    assert r.got[0, 0] == pytest.approx((e + 3) / total, rel=1e-6)
    assert r.fact_mass[0, 0] == pytest.approx(e / total, rel=1e-6)
    assert bool(r.fact_hit[0, 0])
    assert r.fact_rank.tolist() == [1]
    assert r.rows_read.tolist() == [12]  # sink region + window region + the selected one, 4 cells each
    assert r.rows_dense.tolist() == [24]
    assert r.rows_scan.tolist() == [6]  # one mean per region


def test_every_region_selected_recalls_everything():
    rng = np.random.default_rng(0)
    head = Head(q=rng.normal(size=(3, 2, 8)).astype(np.float32), keys=rng.normal(size=(40, 8)).astype(np.float32),
                pos=np.array([37, 38, 39]), scale=0.5)
    r = replay(head, GEO, oracle_rule, [100], (10, 12))[100]  # k past the candidates: every region
    np.testing.assert_allclose(r.got, r.tail, rtol=1e-6)
    assert r.fact_hit.all()
    assert r.rows_read.tolist() == [38, 39, 40]  # every visible cell


def test_wrong_region_misses_the_fact():
    head = one_spike_head()
    head.q = -head.q  # now the spike is the least attended cell and the least scored region
    r = replay(head, GEO, mean_rule(4), [1], (9, 10))[1]
    assert not bool(r.fact_hit[0, 0])
    assert r.fact_rank.tolist() == [4]


def test_two_level_scans_coarse_then_the_shortlist():
    head = one_spike_head()
    rule = two_level_rule(4, 2, shortlist=2)  # coarse: one mean per region; fine: two per region
    r = replay(head, GEO, rule, [1], (9, 10))[1]
    assert bool(r.fact_hit[0, 0])
    assert r.rows_scan.tolist() == [6 + 2 * 2]


def test_q8_0_centroids_keep_the_ranking_and_count_their_bytes():
    head = one_spike_head(dim=32)  # Q8_0 blocks hold 32 values
    r = replay(head, GEO, two_level_rule(4, 2, shortlist=2, kind="q8_0"), [1], (9, 10))[1]
    assert bool(r.fact_hit[0, 0])
    assert r.rows_scan.tolist() == [(6 + 2 * 2) * 34 / 64]  # 34 bytes per 32 values, not 64


def test_q8_0_round_trip_by_hand():
    x = np.zeros(32, np.float32)
    x[0], x[1], x[2] = 127.0, -63.4, 0.3  # scale 1: values round to integers
    assert lab_rules.quantize_q8_0(x)[:3].tolist() == [127.0, -63.0, 0.0]
    assert lab_rules.quantize_q8_0(np.zeros(32, np.float32)).tolist() == [0.0] * 32


def test_bound_is_at_least_every_key_score_and_exact_for_one_key_regions():
    rng = np.random.default_rng(1)
    head = Head(q=rng.normal(size=(2, 3, 8)).astype(np.float32), keys=rng.normal(size=(38, 8)).astype(np.float32),
                pos=np.array([36, 37]), scale=1.0)
    cand = np.ones((2, 10), bool)
    bound, scan = bound_rule(4)(head, GEO, cand)
    exact, _ = token_max_rule(head, GEO, cand)  # the best key of each region, the group's best head
    assert (bound >= exact - 1e-2).all()  # F16 bounds: within rounding of an upper bound
    assert scan.tolist() == [2 * 10, 2 * 10]  # a max and a min row per region
    one, _ = bound_rule(1)(head, GEO, cand)  # one cell a block: the bound is the key itself
    np.testing.assert_allclose(one[:, :9], exact[:, :9], atol=2e-2)


def test_channel_scores_on_every_channel_are_the_exact_best_key():
    rng = np.random.default_rng(2)
    head = Head(q=rng.normal(size=(2, 3, 8)).astype(np.float32), keys=rng.normal(size=(40, 8)).astype(np.float32),
                pos=np.array([38, 39]), scale=0.5)
    cand = np.ones((2, 10), bool)
    every, scan = lab_rules.channel_rule(8)(head, GEO, cand)
    exact, _ = token_max_rule(head, GEO, cand)
    np.testing.assert_allclose(every, exact / head.scale, atol=2e-2)  # F16 keys
    assert scan.tolist() == [40, 40]  # all 8 channels of 40 cells: one K row per cell
    few, scan = lab_rules.channel_rule(2)(head, GEO, cand)
    assert scan.tolist() == [10, 10] and not np.allclose(few, every)


def test_bound_finds_a_one_channel_spike_that_the_mean_washes_out():
    """A region whose keys cancel on average but hold one key aligned with the query: the mean scores it
    0 (as every other region), the bound scores it by that key."""
    keys = np.zeros((24, 2), np.float32)
    keys[8:12, 1] = [5.0, -5.0, 5.0, -5.0]  # region 2: mean 0 on both channels
    keys[8, 0], keys[9, 0] = 6.0, -6.0
    keys[16:20, 0] = 0.5  # region 4: a mild, even preference
    q = np.array([[[1.0, 0.0]]], np.float32)
    head = Head(q=q, keys=keys, pos=np.array([23]), scale=1.0)
    assert not bool(replay(head, GEO, mean_rule(4), [1], (8, 9))[1].fact_hit[0, 0])
    r = replay(head, GEO, bound_rule(4), [1], (8, 9))[1]
    assert bool(r.fact_hit[0, 0]) and r.fact_rank.tolist() == [1]


def test_share_budget_reads_one_region_where_one_holds_the_share_and_more_where_scores_are_flat():
    spike = one_spike_head()  # region 2 holds the spike; the other candidates score 0
    rule = lab_rules.share_budget_rule(lab_rules.persistent_rule(mean_rule(4), 0.9), 0.5)
    r = replay(spike, GEO, rule, [3], (9, 10))[3]
    assert bool(r.fact_hit[0, 0]) and r.rows_read.tolist() == [12]  # sinks, window and the spike's region only
    flat = one_spike_head()
    flat.keys[9, 0] = 0.0  # every candidate scores the same: the share needs half of the four, k caps at 3
    assert replay(flat, GEO, rule, [3], (9, 10))[3].rows_read.tolist() == [8 + 2 * 4]
    assert replay(flat, GEO, lab_rules.share_budget_rule(lab_rules.persistent_rule(mean_rule(4), 0.9), 0.9),
                  [3], (9, 10))[3].rows_read.tolist() == [8 + 3 * 4]


def test_question_pins_keep_what_the_question_found():
    """Step 0 (the question) attends to region 2; step 1 (the answer) scores region 3 best. With one
    pin (by the question's attention mass) and k = 1 the answer step reads region 2, which the
    question found; without, region 3."""
    keys = np.zeros((24, 2), np.float32)
    keys[9] = [10.0, 0.0]  # region 2
    keys[13] = [0.0, 10.0]  # region 3
    q = np.array([[[1.0, 0.0]], [[0.0, 1.0]]], np.float32)
    head = Head(q=q, keys=keys, pos=np.array([22, 23]), scale=1.0, n_question=1)
    plain = replay(head, GEO, mean_rule(4), [1], (9, 10))[1]
    pinned = replay(head, GEO, lab_rules.question_pin_rule(mean_rule(4), 1), [1], (9, 10))[1]
    assert plain.fact_hit[:, 0].tolist() == [True, False]
    assert pinned.fact_hit[:, 0].tolist() == [True, True]
    assert pinned.rows_read.tolist() == plain.rows_read.tolist()  # a pin spends the budget, it does not add to it


def test_question_memory_starts_the_answer_where_the_question_attended():
    """Region 2 holds the key the question attends to beside its opposite (its mean scores 0, so
    routing the question finds nothing); the answer step scores region 3 a little better than the
    rest. Seeded with the question's exact attention mass (all on region 2), the memory keeps
    region 2 for the answer; the plain memory does not."""
    keys = np.zeros((24, 2), np.float32)
    keys[9], keys[10] = [10.0, 0.0], [-10.0, 0.0]  # region 2
    keys[13] = [0.0, 1.0]  # region 3, a weak match for the answer step
    q = np.array([[[1.0, 0.0]], [[0.0, 1.0]]], np.float32)
    head = Head(q=q, keys=keys, pos=np.array([22, 23]), scale=1.0, n_question=1)
    plain = replay(head, GEO, lab_rules.persistent_rule(mean_rule(4), 0.9), [1], (9, 10))[1]
    seeded = replay(head, GEO, lab_rules.question_memory_rule(mean_rule(4), 0.9), [1], (9, 10))[1]
    assert plain.fact_hit[:, 0].tolist() == [False, False]
    assert seeded.fact_hit[:, 0].tolist() == [False, True]


def test_output_error_is_zero_when_everything_is_read_and_the_estimate_exact_for_flat_regions():
    rng = np.random.default_rng(1)
    n_doc, dim = 20, 4
    # every region's 4 cells hold one key, so its mean key scores each cell exactly
    keys = np.repeat(rng.normal(size=(5, dim)), 4, axis=0).astype(np.float32)
    values = rng.normal(size=(n_doc, dim)).astype(np.float32)
    head = Head(q=rng.normal(size=(2, 3, dim)).astype(np.float32), keys=keys, pos=np.array([19, 19]), scale=0.5)
    cand = np.zeros((2, 5), bool)
    cand[:, 1:4] = True
    steps = np.arange(2)
    everything = np.ones((2, 5), bool)
    err, err_est, err_var = lab_rules.output_error(head, values, everything, cand, steps, GEO)
    np.testing.assert_allclose(err, 0, atol=1e-6)
    np.testing.assert_allclose(err_est, 0, atol=1e-6)
    np.testing.assert_allclose(err_var, 0, atol=1e-6)
    fixed_only = ~cand
    err, err_est, err_var = lab_rules.output_error(head, values, fixed_only, cand, steps, GEO)
    assert (err > 1e-3).all()  # three regions dropped
    # cells of one key share one weight, so a region's mean key and mean value (times its count) give
    # exactly its share of the output: only the F16 rounding of the means is left
    assert (err_est < 1e-3).all() and (err_var < 1e-3).all()  # no spread: no correction


def test_rules_registry_names_callables():
    assert {"mean16", "mean4", "token", "oracle"} <= set(lab_rules.RULES)
    assert all(callable(rule) for rule in lab_rules.RULES.values())


def test_every_rule_replays_and_the_oracle_bounds_the_recall():
    """Each registered rule runs on a head with a question and an answer step; none reads more of
    the tail's mass than the regions that hold the most of it."""
    rng = np.random.default_rng(5)
    dim = 32  # Q8_0 blocks hold 32 values
    head = Head(q=rng.normal(size=(3, 2, dim)).astype(np.float32), keys=rng.normal(size=(600, dim)).astype(np.float32),
                pos=np.array([597, 598, 599]), scale=dim ** -0.5, n_question=2)
    geo = Geometry(region=64, sinks=64, window=128)
    best = replay(head, geo, lab_rules.RULES["oracle"], [2], (300, 310))[2].got.sum(axis=1)
    for name, rule in lab_rules.RULES.items():
        got = replay(head, geo, rule, [2], (300, 310))[2].got
        assert (got.sum(axis=1) <= best + 1e-6).all(), name


@pytest.mark.engine
def test_capture_on_a_tiny_model(tmp_path):
    """The eval callback records one Q and K per layer and step; the state parser reads the keys back."""
    from synth_gguf import write_tiny_qwen2

    from kvlocal.engine import llama_cpp
    from kvlocal.lab.capture import QKCapture, state_keys, state_kv

    path = write_tiny_qwen2(tmp_path / "tiny.gguf", n_embd=128, n_head=2, n_head_kv=1, seed=3)
    module = llama_cpp()
    capture = QKCapture(n_layer=2, n_head=2, n_head_kv=1, head_dim=64)
    with capture.installed():
        llm = module.Llama(model_path=str(path), n_ctx=256, n_batch=64, n_ubatch=64, flash_attn=True, verbose=False)
    llm.eval(list(range(1, 41)))  # a prefill of 40 tokens: not recorded
    capture.active = True
    for token in (5, 6, 7):
        llm.eval([token])
    capture.active = False
    q, k = capture.steps.arrays()
    assert q.shape == (3, 2, 2, 64) and k.shape == (3, 2, 1, 64)
    assert np.isfinite(q).all() and np.abs(q).sum() > 0

    size = module.llama_state_seq_get_size(llm.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    assert module.llama_state_seq_get_data(llm.ctx, buf, size, 0) == size
    pos, keys = state_keys(bytes(buf), n_layer=2, n_embd_k_gqa=64)
    assert pos.tolist() == list(range(43))
    # the keys the decode steps wrote are the ones the callback saw (F16 in the cache)
    np.testing.assert_allclose(keys[:, 40:].astype(np.float32), k[:, :, 0].transpose(1, 0, 2), rtol=2e-3, atol=2e-3)
    pos2, keys2, values = state_kv(bytes(buf), n_layer=2, n_embd_gqa=64)
    assert np.array_equal(pos2, pos) and np.array_equal(keys2, keys)
    assert values.shape == keys.shape and np.isfinite(values).all() and not np.array_equal(values, keys)


def test_layer_budget_scale_parses_and_refuses():
    from kvlocal.lab.decode import layer_scale

    assert layer_scale("1-2:2,3:0.5", 5).tolist() == [1.0, 2.0, 2.0, 0.5, 1.0]
    for bad in ("2-11", "3-1:2", "0-9:2", "1:0", "a:b"):
        with pytest.raises(ValueError):
            layer_scale(bad, 5)


def _save_capture(path, n_steps: int, n_question: int, seed: int) -> None:
    """A random capture of one layer, one KV head and one probe, as `kvlocal lab` saves them."""
    from kvlocal.lab.decode import CaseCapture

    rng = np.random.default_rng(seed)
    n_doc, dim = 1024, 128
    keys = rng.normal(size=(1, n_doc, dim)).astype(np.float16)
    q = rng.normal(size=(n_steps, 1, 2, dim)).astype(np.float32)
    k = rng.normal(size=(n_steps, 1, 1, dim)).astype(np.float32)
    CaseCapture("x", keys, [q], [k], np.array([[300, 320]]), np.array([True]), np.array([0.3]),
                np.array([n_question]), keys.copy()).save(path)


def _refuse_the_engine(monkeypatch) -> None:
    from kvlocal import cli_common

    def refuse(*args, **kwargs):
        raise AssertionError("the engine was opened although the capture was saved")

    monkeypatch.setattr(cli_common, "open_session", refuse)


def test_cli_replays_a_saved_capture_without_the_engine(tmp_path, monkeypatch):
    """`kvlocal lab` finds a saved capture under its haystack's name and only replays it."""
    import json

    from typer.testing import CliRunner

    from kvlocal import cli

    _refuse_the_engine(monkeypatch)
    _save_capture(tmp_path / "lookalike-8192-s0-d10.npz", n_steps=3, n_question=1, seed=4)
    result = CliRunner().invoke(cli.app, ["lab", "--lengths", "8k", "--seeds", "0", "--rules", "mean8,oracle",
                                          "--budgets", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "lab.json").read_text())
    assert {r["rule"] for r in rows} == {"mean8", "oracle"}


def test_cli_plants_in_the_haystack_and_names_the_capture_after_it(tmp_path, monkeypatch):
    """With --haystack the lab looks for (and would capture) the haystack's own case, named after the
    file; the generated-prose capture beside it is not taken for it. probes.jsonl gets one row per
    probe, rule and budget."""
    import json

    from typer.testing import CliRunner

    from kvlocal import cli

    _refuse_the_engine(monkeypatch)
    _save_capture(tmp_path / "onekey-8192-s0-d10-my-notes.npz", n_steps=4, n_question=2, seed=6)
    _save_capture(tmp_path / "onekey-8192-s0-d10.npz", n_steps=9, n_question=2, seed=7)  # generated prose
    haystack = tmp_path / "My Notes.txt"
    haystack.write_text("Plain prose about nothing in particular. " * 50)
    result = CliRunner().invoke(cli.app, ["lab", "--lengths", "8k", "--tasks", "onekey", "--seeds", "0",
                                          "--rules", "oracle,two64/8x16+qm2", "--budgets", "2",
                                          "--haystack", str(haystack), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    probes = [json.loads(line) for line in (tmp_path / "probes.jsonl").read_text().splitlines()]
    assert sorted((p["rule"], p["top_k"], p["case"]) for p in probes) == [
        ("oracle", 2, "onekey-8192-s0-d10-my-notes"), ("two64/8x16+qm2", 2, "onekey-8192-s0-d10-my-notes")]
    steps = {p["rule"]: len(p["answer_hits"]) for p in probes}
    # 4 steps, 2 of them the question's: the last question step and the next predict answer tokens (the
    # last step predicts the end); a dense question pass computes the first of them
    assert steps == {"oracle": 2, "two64/8x16+qm2": 1}
    assert "| case | depth | dense |" in result.output


def _result(fact_mass: np.ndarray, fact_hit: np.ndarray) -> lab_rules.HeadResult:
    steps, group = fact_mass.shape
    zeros = np.zeros((steps, group))
    return lab_rules.HeadResult(tail=zeros, got=zeros, fact_mass=fact_mass, fact_hit=fact_hit,
                                fact_rank=np.ones(steps, int), rows_read=np.zeros(steps), rows_scan=np.zeros(steps),
                                rows_dense=np.ones(steps))


def test_probe_row_names_the_first_step_and_the_heads_that_lost_the_fact():
    """Two layers of one KV head with two query heads each, three answer steps: layer 1's second
    query head attends to the fact at every step but its region is not read at steps 1 and 2."""
    from kvlocal.lab.decode import probe_markdown, probe_row

    mass = np.array([[0.5, 0.0], [0.5, 0.0], [0.5, 0.0]])
    layer0 = _result(mass, np.ones((3, 2), bool))
    layer1 = _result(np.array([[0.0, 0.9], [0.0, 0.9], [0.0, 0.9]]),
                     np.array([[True, True], [True, False], [True, False]]))
    row = probe_row([(0, 0, layer0), (1, 0, layer1)], group=2, answer_steps=np.arange(3))
    assert row["answer_hits"] == [1.0, 0.5, 0.5]
    assert row["first_drop"] == 1
    assert row["missed_pairs"] == {"1.1": 2}
    # a route with a dense question pass routes from the second answer token on: the same lost step
    # is then the answer's token 1 still, counted from the steps it routes
    later = probe_row([(0, 0, layer0), (1, 0, layer1)], group=2, answer_steps=np.arange(1, 3), first=1)
    assert later["answer_hits"] == [0.5, 0.5] and later["first_drop"] == 1
    table = probe_markdown([dict(row, case="c", probe=0, depth=0.5, dense_right=True, rule="r", top_k=4)],
                           {("c", 0): "a / b"})
    assert "| c | 0.50 | right | 0.67 (min 0.5), token 1: 1.1x2 | a / b |" in table


def test_the_rules_with_a_dense_question_pass_are_the_pinned_and_seeded_ones():
    """The question's pins (+qm…) and a memory the question pass seeds or leaves empty (+qmem…, +amem…)
    stand for a route that reads the question densely; the plain rules route every step."""
    dense = {name for name, rule in lab_rules.RULES.items() if lab_rules.reads_question_densely(rule)}
    assert dense == {name for name in lab_rules.RULES if "+qm" in name or "+amem" in name}
    assert "two64/8x16+qm2" in dense and "two64/8x16+keep.9" not in dense and "oracle" not in dense
