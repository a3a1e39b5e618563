"""Where kvlocal keeps models and saved KV states."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_root() -> Path:
    """The user cache directory; KVLOCAL_CACHE_DIR overrides it."""
    override = os.environ.get("KVLOCAL_CACHE_DIR")
    root = Path(override) if override else Path(platformdirs.user_cache_dir("kvlocal"))
    return root


def models_dir() -> Path:
    return cache_root() / "models"


def states_dir() -> Path:
    return cache_root() / "states"
