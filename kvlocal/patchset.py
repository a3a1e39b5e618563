"""The id of the patch series in patches/, as compiled into the engine by vendor/build_engine.py,
and the narrower id of what decides the bytes prefill writes into the KV cache."""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCHES_DIR = ROOT / "patches"
PIN_FILE = ROOT / "vendor" / "PIN"
# the header trailer of a patch that changes no byte prefill writes into the K/V cache
PREFILL_KV_UNCHANGED = "Prefill-KV: unchanged"
# the header trailer of a patch to llama-cpp-python's Python files rather than to llama.cpp
APPLIES_TO_BINDINGS = "Applies-To: llama-cpp-python"
LLAMA_CPP_DIR = "vendor/llama.cpp"  # where llama.cpp sits in the llama-cpp-python sdist
_FIRST_DIFF = re.compile(r"^diff --git ", re.M)


def patch_files(patches_dir: Path = PATCHES_DIR) -> list[Path]:
    return sorted(patches_dir.glob("*.patch"))


def _add_patches(digest, patches: list[Path]) -> None:
    for path in patches:
        digest.update(path.name.encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())


def patchset_id(patches: list[Path]) -> str:
    """sha256 over the names and contents of the patch files, in order (16 hex digits)."""
    digest = hashlib.sha256()
    _add_patches(digest, patches)
    return digest.hexdigest()[:16]


def patch_header(patch: Path) -> str:
    """The text above the patch's first `diff --git` line (its format-patch style header); empty
    when it has no such line."""
    text = patch.read_text()
    first_diff = _FIRST_DIFF.search(text)
    return text[: first_diff.start()] if first_diff else ""


def _header_lines(patch: Path) -> list[str]:
    return [line.strip() for line in patch_header(patch).splitlines()]


def patch_root(patch: Path) -> str:
    """The folder of the unpacked sdist that the patch's paths are relative to: the llama.cpp tree
    (vendor/llama.cpp), or the package root for a patch of llama-cpp-python's own Python bindings
    (its header carries the `Applies-To: llama-cpp-python` trailer line)."""
    return "." if APPLIES_TO_BINDINGS in _header_lines(patch) else LLAMA_CPP_DIR


def keeps_prefill_kv(patch: Path) -> bool:
    """The patch's header carries the `Prefill-KV: unchanged` trailer line."""
    return PREFILL_KV_UNCHANGED in _header_lines(patch)


def kv_state_id(patches: list[Path], pin: Path = PIN_FILE) -> str:
    """sha256 (16 hex digits) over the engine pin and the names and contents of the patches that may
    change what prefill writes into the K/V cache (those without the trailer): a saved KV state stays
    valid across engine rebuilds that change only the others."""
    digest = hashlib.sha256(pin.read_bytes())
    _add_patches(digest, [p for p in patches if not keeps_prefill_kv(p)])
    return digest.hexdigest()[:16]


def repo_patchset_id() -> str | None:
    """The id of this checkout's patches/, or None for an install without the repository."""
    patches = patch_files()
    return patchset_id(patches) if patches else None


@functools.cache
def repo_kv_state_id() -> str | None:
    """kv_state_id of this checkout's patches/ and pin, or None for an install without them."""
    patches = patch_files()
    return kv_state_id(patches) if patches and PIN_FILE.is_file() else None
