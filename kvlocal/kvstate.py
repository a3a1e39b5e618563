"""Saved KV states of prefilled documents: keyed, checksummed, written atomically.

File layout (one file per entry, `<key>.kvstate` under the states directory):
    MAGIC | u32 header length | header JSON | int32 tokens | engine state bytes
The header holds every input that shapes the state (the key fields), the token count and the
sha256 of tokens + state. A mismatched key or a damaged body is detected before anything is
handed to the engine, reported, and the entry is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvlocal import paths
from kvlocal.errors import KvlocalError

MAGIC = b"KVLOCAL-STATE-1\n"
SUFFIX = ".kvstate"
# save_state writes `.tmp-<pid>-XXXXXXXX.kvstate` and renames it into place; a writer killed in between
# leaves it behind. It is removed once its writer is gone, or once it is older than a writer could be.
TMP_PREFIX = ".tmp-"
STALE_TMP_SECONDS = 86400.0  # a temporary this old is left over whatever its pid says (pids are reused)
ORPHAN_TMP_SECONDS = 3600.0  # for one without a pid in its name (written by an older kvlocal)
_TMP_PID = re.compile(r"\.tmp-(\d+)-")


@dataclass(frozen=True)
class StateKey:
    """Everything that decides the bytes of a prefilled document state.

    Region centroids are not part of the state: the engine recomputes them after a load."""

    text_sha256: str
    model_sha256: str
    engine_build: str
    n_ctx: int
    type_k: str
    type_v: str
    template_hash: str
    prefill: str = "dense"  # how the document was prefilled (routing.PrefillConfig.state_tag)

    def fields(self) -> dict:
        """The key as stored: a dense prefill's key has no prefill field, as every key had before
        routed prefill existed, so the states saved then keep their names and still load."""
        fields = asdict(self)
        if fields["prefill"] == "dense":
            del fields["prefill"]
        return fields

    def digest(self) -> str:
        blob = json.dumps(self.fields(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]


@dataclass(frozen=True)
class StateEntry:
    path: Path
    key: dict
    n_tokens: int
    size: int
    created: float
    label: str


class StateCacheError(Exception):
    """An entry exists but cannot be used; the message says why (it is then rebuilt)."""


def state_path(key: StateKey, root: Path | None = None) -> Path:
    return (root or paths.states_dir()) / f"{key.digest()}{SUFFIX}"


def _body_digest(tokens: np.ndarray, state: bytes) -> str:
    digest = hashlib.sha256()
    digest.update(tokens.astype("<i4").tobytes())
    digest.update(state)
    return digest.hexdigest()


def save_state(key: StateKey, tokens: np.ndarray, state: bytes, label: str, root: Path | None = None) -> Path:
    """Write the entry atomically: a temporary file in the same directory, fsync, rename."""
    target = state_path(key, root)
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_temporaries(target.parent)
    tokens = np.asarray(tokens, dtype="<i4")
    header = json.dumps(
        {
            "key": key.fields(),
            "n_tokens": int(tokens.size),
            "state_len": len(state),
            "sha256": _body_digest(tokens, state),
            "created": time.time(),
            "label": label,
        }
    ).encode()
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f"{TMP_PREFIX}{os.getpid()}-", suffix=SUFFIX)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(MAGIC)
            fh.write(struct.pack("<I", len(header)))
            fh.write(header)
            fh.write(tokens.tobytes())
            fh.write(state)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target


def _read_header(fh) -> dict:
    if fh.read(len(MAGIC)) != MAGIC:
        raise StateCacheError("not a kvlocal state file")
    raw_len = fh.read(4)
    if len(raw_len) != 4:
        raise StateCacheError("truncated header")
    (header_len,) = struct.unpack("<I", raw_len)
    if header_len > 1 << 20:
        raise StateCacheError("damaged header")
    try:
        return json.loads(fh.read(header_len))
    except (ValueError, UnicodeDecodeError):
        raise StateCacheError("damaged header") from None


def load_state(key: StateKey, root: Path | None = None) -> tuple[np.ndarray, bytes] | None:
    """(tokens, state) for key; None when there is no entry; StateCacheError when it is unusable."""
    path = state_path(key, root)
    if not path.exists():
        return None
    with open(path, "rb") as fh:
        header = _read_header(fh)
        if header.get("key") != key.fields():
            raise StateCacheError("its key does not match this document, model and engine")
        try:
            n_tokens, state_len = int(header["n_tokens"]), int(header["state_len"])
        except (KeyError, TypeError, ValueError):
            raise StateCacheError("damaged header") from None
        raw_tokens = fh.read(4 * n_tokens)
        state = fh.read(state_len)
        extra = fh.read(1)
    if len(raw_tokens) != 4 * n_tokens or len(state) != state_len or extra:
        raise StateCacheError("the file is truncated or has trailing bytes")
    tokens = np.frombuffer(raw_tokens, dtype="<i4")
    if _body_digest(tokens, state) != header["sha256"]:
        raise StateCacheError("its checksum does not match (the file is damaged)")
    return tokens.astype(np.int32), state


def discard(key: StateKey, root: Path | None = None) -> None:
    _remove(state_path(key, root))


def discard_noting(key: StateKey, reason: str) -> str:
    """Discard the entry under `key`; `reason`, with why the entry stays where it cannot be removed (a
    cache that cannot be written, read-only, must not cost the answer: the state is rebuilt in memory)."""
    try:
        discard(key)
    except OSError as err:
        return f"{reason} (the stale entry could not be removed: {err.strerror or err})"
    return reason


def save_noting(key: StateKey, tokens: np.ndarray, state: bytes, label: str) -> tuple[Path | None, str | None]:
    """save_state: where it was saved, or None and a note of why it could not be (a full disk or an
    unusable cache dir: the prefilled context still works)."""
    try:
        return save_state(key, tokens, state, label=label), None
    except OSError as err:
        return None, f"could not save the KV state ({err.strerror or err}: {err.filename or ''}); continuing without it"


def joined(*notes: str | None) -> str | None:
    """The notes given, joined with '; ' (None without any)."""
    return "; ".join(note for note in notes if note) or None


def _remove(path: Path) -> None:
    """Remove an entry, whatever sits at its name (a stray folder too)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _is_temporary(path: Path) -> bool:
    return path.name.startswith(TMP_PREFIX)


def _pid_alive(pid: int) -> bool:
    """False only when no process `pid` exists; True when that cannot be told."""
    if pid <= 0 or os.name == "nt":  # on Windows signal 0 is CTRL_C_EVENT: never send it
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: a live process of another user
        return True
    return True


def _stale_temporary(path: Path, now: float) -> bool:
    try:
        age = now - path.stat().st_mtime
    except OSError:
        return False
    match = _TMP_PID.match(path.name)
    if match is None:
        return age > ORPHAN_TMP_SECONDS
    return age > STALE_TMP_SECONDS or not _pid_alive(int(match.group(1)))


def _sweep_temporaries(folder: Path) -> None:
    """Remove the temporaries of writers that died mid-write; a live writer's temporary stays.
    Best effort: a cache that cannot be written keeps them (they are never listed)."""
    now = time.time()
    try:
        candidates = list(folder.glob(f"{TMP_PREFIX}*{SUFFIX}"))
    except OSError:
        return
    for path in candidates:
        if _stale_temporary(path, now):
            try:
                _remove(path)
            except OSError:
                pass


def _states_folder(root: Path | None) -> Path:
    """The states folder; KvlocalError when it (or the cache dir) is a file, so that the cache commands
    say what is wrong instead of reporting an empty cache."""
    if root is None:
        paths.check_cache_dir()
        return paths.states_dir()
    if root.exists() and not root.is_dir():
        raise KvlocalError(f"the kvlocal states folder {root} is a file, not a folder")
    return root


def list_entries(root: Path | None = None) -> list[StateEntry]:
    """The saved states (temporaries of writers still at work are not entries; those of dead ones are removed)."""
    folder = _states_folder(root)
    if not folder.exists():
        return []
    _sweep_temporaries(folder)
    entries = []
    for path in sorted(folder.glob(f"*{SUFFIX}")):
        if _is_temporary(path):
            continue
        try:
            try:
                with open(path, "rb") as fh:
                    header = _read_header(fh)
            except (OSError, StateCacheError):
                header = {"key": {}, "n_tokens": 0, "created": path.stat().st_mtime, "label": "(damaged)"}
            size = path.stat().st_size
        except FileNotFoundError:  # removed meanwhile (another process cleared the cache)
            continue
        entries.append(
            StateEntry(
                path=path,
                key=header.get("key", {}),
                n_tokens=int(header.get("n_tokens", 0)),
                size=size,
                created=float(header.get("created", 0.0)),
                label=str(header.get("label", "")),
            )
        )
    return entries


def clear_entries(root: Path | None = None) -> int:
    """Delete every entry and the temporaries of dead writers (a live writer's temporary stays);
    returns the number of entries removed."""
    folder = _states_folder(root)
    if not folder.exists():
        return 0
    _sweep_temporaries(folder)
    removed = 0
    for path in folder.glob(f"*{SUFFIX}"):
        if _is_temporary(path):
            continue
        _remove(path)
        removed += 1
    return removed
