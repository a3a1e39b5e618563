"""Shared pytest fixtures."""

from __future__ import annotations

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
