"""The default thread count: every core the process may run on."""

from __future__ import annotations

import os

import pytest

from kvlocal.session import default_threads


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_default_threads_follows_the_affinity_mask():
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert default_threads() == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert default_threads() == len(allowed)
