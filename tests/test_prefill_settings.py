"""How a routed prefill cuts a document into ubatches and keys its state (engine-free)."""

from __future__ import annotations

import pytest

from kvlocal.errors import UsageError
from kvlocal.routing import PrefillConfig


def test_a_dense_prefill_is_ubatches_of_the_contexts_size():
    assert PrefillConfig().ubatches(1100, 512) == [(0, 512, False), (512, 1024, False), (1024, 1100, False)]
    assert not PrefillConfig().routes_any(100_000, 512)


def test_a_routed_prefill_routes_from_the_first_ubatch_at_or_past_its_start():
    cfg = PrefillConfig(mode="routed", start=1000, ubatch=512)
    assert cfg.ubatches(2000, 512) == [(0, 512, False), (512, 1024, False), (1024, 1536, True), (1536, 2000, True)]
    assert cfg.routes_any(1025, 512) and not cfg.routes_any(1024, 512)  # the ubatch at 1024 must hold a token


def test_routed_ubatches_can_be_smaller_than_the_contexts_but_not_larger():
    small = PrefillConfig(mode="routed", start=512, ubatch=128)
    assert small.ubatches(1000, 512) == [(0, 512, False), (512, 640, True), (640, 768, True), (768, 896, True),
                                         (896, 1000, True)]
    assert PrefillConfig(mode="routed", start=0, ubatch=4096).ubatches(600, 512) == [(0, 512, True), (512, 600, True)]


def test_the_state_tag_names_everything_that_shapes_a_routed_prefills_kv():
    assert PrefillConfig().state_tag(8, 512) == "dense"
    tags = {PrefillConfig(mode="routed", **kw).state_tag(blk, 512)
            for kw, blk in [({}, 8), ({}, 4), ({"top_k": 8}, 8), ({"start": 0}, 8), ({"ubatch": 128}, 8)]}
    assert len(tags) == 5
    assert PrefillConfig(mode="routed").state_tag(8, 512) != PrefillConfig(mode="routed").state_tag(8, 256)
    # the centroids' type changes which regions are chosen; F16's tag stays what it was
    routed = PrefillConfig(mode="routed")
    assert routed.state_tag(8, 512, "q8_0") != routed.state_tag(8, 512) == routed.state_tag(8, 512, "f16")
    assert "centroids" not in routed.state_tag(8, 512)


@pytest.mark.parametrize("bad", [{"mode": "sparse"}, {"top_k": 0}, {"start": -1}, {"ubatch": 0}])
def test_bad_prefill_settings_are_usage_errors(bad):
    with pytest.raises(UsageError) as info:
        PrefillConfig(**bad)
    assert info.value.setting in ("prefill", "prefill_top_k", "prefill_from", "prefill_ubatch")
