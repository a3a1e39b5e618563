"""The id of the patch series in patches/, as compiled into the engine by vendor/build_engine.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

PATCHES_DIR = Path(__file__).resolve().parent.parent / "patches"


def patch_files(patches_dir: Path = PATCHES_DIR) -> list[Path]:
    return sorted(patches_dir.glob("*.patch"))


def patchset_id(patches: list[Path]) -> str:
    """sha256 over the names and contents of the patch files, in order (16 hex digits)."""
    digest = hashlib.sha256()
    for path in patches:
        digest.update(path.name.encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def repo_patchset_id() -> str | None:
    """The id of this checkout's patches/, or None for an install without the repository."""
    patches = patch_files()
    return patchset_id(patches) if patches else None
