"""Shared pytest fixtures, and the one gate for tests that need the engine.

A test that needs the patched llama-cpp-python engine is marked `engine` (a module sets
`pytestmark`); one that needs the real default model is marked `model` as well. Without llama_cpp
installed the `engine` tests are skipped, so `pytest -m "not engine"` and a plain `pytest` both run
everywhere; with KVLOCAL_REQUIRE_ENGINE=1 (`make test`) a missing engine fails the run instead.
An engine that is installed but stale (built from other patches) is never skipped: its tests fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from synth_gguf import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight qwen2 GGUF (about 0.5 MB), written once per test session."""
    return make_tiny_model(tmp_path_factory.mktemp("models"))


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private kvlocal cache directory (KVLOCAL_CACHE_DIR) for one test."""
    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def _private_state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Model verification records a read-only cache falls back to stay out of the real home."""
    monkeypatch.setenv("KVLOCAL_STATE_DIR", str(tmp_path_factory.mktemp("user-state")))  # one per test


def _engine_installed() -> bool:
    from kvlocal.engine import llama_cpp
    from kvlocal.errors import EngineError

    try:
        llama_cpp()
    except EngineError:
        return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _engine_installed():
        return
    if os.environ.get("KVLOCAL_REQUIRE_ENGINE") == "1":
        raise pytest.UsageError("KVLOCAL_REQUIRE_ENGINE=1 but llama_cpp (the patched engine) is not installed; "
                                "run `make engine`")
    skip = pytest.mark.skip(reason="needs the patched llama-cpp-python engine (llama_cpp is not installed)")
    for item in items:
        if "engine" in item.keywords:
            item.add_marker(skip)
