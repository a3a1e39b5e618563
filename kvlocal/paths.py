"""Where kvlocal keeps models and saved KV states."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


CACHE_DIR_ENV = "KVLOCAL_CACHE_DIR"
STATE_DIR_ENV = "KVLOCAL_STATE_DIR"


def cache_root() -> Path:
    """The user cache directory; KVLOCAL_CACHE_DIR overrides it."""
    override = os.environ.get(CACHE_DIR_ENV)
    root = Path(override) if override else Path(platformdirs.user_cache_dir("kvlocal"))
    return root


def user_state_root() -> Path:
    """A small per-user folder for records kvlocal keeps when the cache dir cannot be written
    (a shared or read-only cache); KVLOCAL_STATE_DIR overrides it."""
    override = os.environ.get(STATE_DIR_ENV)
    return Path(override) if override else Path(platformdirs.user_state_dir("kvlocal"))


def check_cache_dir() -> None:
    """KvlocalError when the cache dir, or its states folder, is a file (or lies inside one): commands that list
    or clear the cache say so instead of reporting an empty cache."""
    from kvlocal.errors import KvlocalError

    root = cache_root()
    source = f" ({CACHE_DIR_ENV})" if os.environ.get(CACHE_DIR_ENV) else ""
    for path in (root, *root.parents):
        if path.exists():
            if path == root and not path.is_dir():
                raise KvlocalError(f"the kvlocal cache dir {root}{source} is a file, not a folder")
            if not path.is_dir():
                raise KvlocalError(f"the kvlocal cache dir {root}{source} is inside {path}, which is a file")
            break
    states = states_dir()
    if states.exists() and not states.is_dir():
        raise KvlocalError(f"the kvlocal states folder {states} is a file, not a folder")


def models_dir() -> Path:
    return cache_root() / "models"


def states_dir() -> Path:
    return cache_root() / "states"
