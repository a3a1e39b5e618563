"""Routed prefill (issue 14) on a tiny synthetic model: the all-regions oracle, the read statistics
of the prefill's ubatches, and a saved state keyed apart from the dense prefill's."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.engine

from kvlocal.routing import PrefillConfig, Route  # noqa: E402
from kvlocal.session import Session  # noqa: E402

TEXT = " ".join(f"entry {i}: value {i * 7 % 101}." for i in range(75))
N_BATCH = 128
START = 256


def prefill_logits(model, prefill: PrefillConfig, *, use_cache: bool = False):
    """The last document token's logits after a prefill (None for a cache hit), and the load result."""
    session = Session(str(model), threads=2, n_batch=N_BATCH)
    try:
        result = session.load_document(TEXT, prefill=prefill, use_cache=use_cache)
        logits = None
        if not result.cache_hit:  # a restored state has computed no logits
            logits = session.context.last_logits().copy()
    finally:
        session.close()
    return logits, result


def test_a_routed_prefill_of_every_region_reproduces_the_dense_prefill(tiny_model):
    dense, dense_res = prefill_logits(tiny_model, PrefillConfig())
    every, every_res = prefill_logits(tiny_model, PrefillConfig(mode="routed", top_k=10_000, start=START))
    one, one_res = prefill_logits(tiny_model, PrefillConfig(mode="routed", top_k=1, start=START))
    n = dense_res.n_tokens
    assert n > 6 * N_BATCH  # several routed ubatches past the start, each with regions to leave out
    scale = float(np.max(np.abs(dense)))
    diff = float(np.max(np.abs(dense - every)))
    assert diff <= 5e-3 * max(1.0, scale), f"max |logit diff| {diff} (scale {scale})"
    assert float(np.max(np.abs(dense - one))) > diff  # one region per head really leaves rows out

    ubatches = -(-n // N_BATCH)
    routed = len([i for i in range(0, n, N_BATCH) if i >= START])
    d, e, o = dense_res.reads, every_res.reads, one_res.reads
    assert d.ubatches == e.ubatches == o.ubatches == ubatches
    assert d.ubatches_routed == 0 and d.bytes_read == d.bytes_dense  # a dense prefill reads every earlier cell once
    assert e.ubatches_routed == o.ubatches_routed == routed
    assert d.bytes_dense == e.bytes_dense == o.bytes_dense  # the same cache under each ubatch
    assert o.bytes_read < e.bytes_read  # one region per head reads fewer rows than every region
    assert o.reduction > 1.5


def test_a_routed_prefill_is_saved_and_found_apart_from_the_dense_one(tiny_model, cache_dir):
    routed = PrefillConfig(mode="routed", top_k=1, start=START)
    _, first = prefill_logits(tiny_model, routed, use_cache=True)
    assert not first.cache_hit and first.saved and first.prefill == routed
    _, dense = prefill_logits(tiny_model, PrefillConfig(), use_cache=True)
    assert not dense.cache_hit  # a routed prefill's state is not a dense one
    _, again = prefill_logits(tiny_model, routed, use_cache=True)
    assert again.cache_hit and again.prefill == routed and again.reads is None
    _, other = prefill_logits(tiny_model, PrefillConfig(mode="routed", top_k=2, start=START), use_cache=True)
    assert not other.cache_hit  # its budget shapes the K/V bytes too


def test_a_document_no_ubatch_routes_is_keyed_as_the_dense_prefill_it_equals(tiny_model, cache_dir):
    _, dense = prefill_logits(tiny_model, PrefillConfig(), use_cache=True)
    _, late = prefill_logits(tiny_model, PrefillConfig(mode="routed", top_k=1, start=dense.n_tokens), use_cache=True)
    assert late.cache_hit  # every ubatch starts before the routed prefill's start: the dense state is it
    assert late.prefill == PrefillConfig()  # and it is reported as the dense prefill it was


def test_a_prefill_leaves_the_answer_its_own_route(tiny_model):
    session = Session(str(tiny_model), threads=2, n_batch=N_BATCH)
    try:
        session.load_document(TEXT, prefill=PrefillConfig(mode="routed", top_k=1, start=START), use_cache=False)
        full = session.answer("which value?", route=Route(mode="full"), max_tokens=3)
        assert full.rows_read == full.rows_dense and full.reduction == 1.0
        geo = session.answer("which value?", route=Route(mode="geometric", top_k=1), max_tokens=3)
        assert geo.bytes_read < geo.bytes_dense
    finally:
        session.close()
