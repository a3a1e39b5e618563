"""A hostile cache and hostile models (issue 13): a read-only cache, temporaries left by killed
writers, a file where the cache dir should be, encoder-only and odd-head GGUFs."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter, PoolingType
from synth_gguf import write_tiny_qwen2
from typer.testing import CliRunner

from kvlocal import kvstate, models, paths
from kvlocal.cli import app
from kvlocal.errors import KvlocalError, ModelError
from kvlocal.models import ModelSpec, resolve_model

DOC = "\n".join(f"Line {i}: the gauge at post {i} read {i * 13 % 97} units." for i in range(40))


@pytest.fixture(autouse=True)
def isolated_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The per-user fallback for verification records, kept out of the real home."""
    state = tmp_path / "user-state"
    monkeypatch.setenv("KVLOCAL_STATE_DIR", str(state))
    return state


@pytest.fixture
def doc(tmp_path: Path) -> Path:
    path = tmp_path / "report.txt"
    path.write_text(DOC)
    return path


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def ask(doc: Path, model: Path):
    return run("ask", str(doc), "What did post 7 read?", "--model", str(model), "--max-tokens", "4")


@pytest.fixture
def read_only(monkeypatch: pytest.MonkeyPatch):
    """make(folder): chmod the folder 0o555. As root, where the mode does not stop writes, also
    refuse in Python every file creation, rename, removal and mkdir under the folder."""
    folders: list[Path] = []

    def make(folder: Path) -> None:
        folder.chmod(0o555)
        folders.append(folder)
        if os.geteuid() != 0 or len(folders) > 1:
            return
        real = {name: getattr(os, name) for name in ("open", "unlink", "remove", "rmdir", "mkdir", "replace", "rename")}

        def inside(p) -> bool:
            if isinstance(p, int):
                return False
            full = os.path.abspath(os.fsdecode(p))
            return any(full.startswith(str(f.resolve()) + os.sep) for f in folders)

        def denied(p):
            return PermissionError(errno.EACCES, "Permission denied", os.fsdecode(p))

        def fake_open(path, flags, *args, **kwargs):
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and inside(path):
                raise denied(path)
            return real["open"](path, flags, *args, **kwargs)

        def refuse(name):
            def fake(path, *args, **kwargs):
                if inside(path) and not kwargs.get("dir_fd"):
                    raise denied(path)
                return real[name](path, *args, **kwargs)

            return fake

        def fake_mkdir(path, *args, **kwargs):
            if inside(path):
                if os.path.lexists(os.fsdecode(path)):
                    raise FileExistsError(errno.EEXIST, "File exists", os.fsdecode(path))
                raise denied(path)
            return real["mkdir"](path, *args, **kwargs)

        def move(name):
            def fake(src, dst, *args, **kwargs):
                if inside(src) or inside(dst):
                    raise denied(dst)
                return real[name](src, dst, *args, **kwargs)

            return fake

        monkeypatch.setattr(os, "open", fake_open)
        for name in ("unlink", "remove", "rmdir"):
            monkeypatch.setattr(os, name, refuse(name))
        monkeypatch.setattr(os, "mkdir", fake_mkdir)
        for name in ("replace", "rename"):
            monkeypatch.setattr(os, name, move(name))

    yield make
    for folder in folders:
        folder.chmod(0o755)


def count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = models._sha256_file

    def counting(path, progress):
        calls.append(path)
        return real(path, progress)

    monkeypatch.setattr(models, "_sha256_file", counting)
    return calls


# ------------------------------------------------------ item 3: a read-only cache costs no answer


def test_a_read_only_models_dir_verifies_the_model_once(tiny_model, cache_dir, read_only, monkeypatch):
    data = tiny_model.read_bytes()
    spec = ModelSpec("tiny", "test model", ("fakepkg-part1",), "0.1.0", len(data), hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(models.ALIASES, "tiny", spec)
    folder = paths.models_dir()
    folder.mkdir(parents=True)
    (folder / "tiny.gguf").write_bytes(data)  # installed by someone else, without a marker
    read_only(folder)
    hashes = count_hashes(monkeypatch)

    assert resolve_model("tiny").sha256 == spec.sha256
    assert len(hashes) == 1
    assert not (folder / "tiny.gguf.sha256").exists()
    assert resolve_model("tiny").sha256 == spec.sha256
    assert models.model_status("tiny") == "installed (verified)"
    assert len(hashes) == 1, "rehashed although the file did not change"

    # the record is keyed by the file's identity: a changed file is hashed again
    st = (folder / "tiny.gguf").stat()
    os.utime(folder / "tiny.gguf", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert resolve_model("tiny").sha256 == spec.sha256
    assert len(hashes) == 2


def test_a_read_only_cache_root_hashes_a_local_model_once(tiny_model, cache_dir, read_only, monkeypatch):
    cache_dir.mkdir()
    read_only(cache_dir)
    hashes = count_hashes(monkeypatch)
    first = resolve_model(str(tiny_model)).sha256
    assert first == hashlib.sha256(tiny_model.read_bytes()).hexdigest()
    assert not (cache_dir / "hashes.json").exists()
    assert resolve_model(str(tiny_model)).sha256 == first
    assert len(hashes) == 1


@pytest.mark.engine
def test_a_read_only_cache_with_a_stale_entry_still_answers(cache_dir, doc, tiny_model, read_only):
    assert ask(doc, tiny_model).exit_code == 0
    [entry] = kvstate.list_entries()
    data = bytearray(entry.path.read_bytes())
    data[-100] ^= 0xFF
    entry.path.write_bytes(bytes(data))
    read_only(entry.path.parent)

    result = ask(doc, tiny_model)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip()  # the answer came
    assert "saved state discarded: its checksum does not match" in result.stderr
    assert "could not be removed" in result.stderr
    assert "could not save the KV state" in result.stderr
    assert "Traceback" not in result.stderr
    assert entry.path.exists()  # the cache was not touched


# ------------------------------------------------------------- item 4: leftover temporary files


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def temporary(folder: Path, pid: int | None, age: float = 0.0, tag: str = "x1y2") -> Path:
    """A temporary as save_state names it (`.tmp-<pid>-XXXX`; without a pid, as older kvlocals did)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (f".tmp-{pid}-{tag}{kvstate.SUFFIX}" if pid is not None else f".tmp-{tag}{kvstate.SUFFIX}")
    path.write_bytes(kvstate.MAGIC + b"half a state")
    if age:
        then = time.time() - age
        os.utime(path, (then, then))
    return path


def test_a_dead_writers_temporary_is_not_listed_and_is_removed(cache_dir):
    tmp = temporary(paths.states_dir(), dead_pid())
    assert kvstate.list_entries() == []
    assert not tmp.exists()


def test_a_live_writers_temporary_is_neither_listed_nor_removed(cache_dir):
    tmp = temporary(paths.states_dir(), os.getpid())
    assert kvstate.list_entries() == []
    assert kvstate.clear_entries() == 0
    assert tmp.exists()


def test_old_temporaries_are_removed(cache_dir):
    two_days = 2 * 86400
    live_but_old = temporary(paths.states_dir(), os.getpid(), age=two_days)
    assert kvstate.list_entries() == [] and not live_but_old.exists()
    old_no_pid = temporary(paths.states_dir(), None, age=two_days, tag="old")  # an older kvlocal's name
    fresh_no_pid = temporary(paths.states_dir(), None, tag="new")  # its writer may still be running
    assert kvstate.list_entries() == []
    assert kvstate.clear_entries() == 0
    assert not old_no_pid.exists() and fresh_no_pid.exists()


def test_saving_a_state_sweeps_dead_temporaries(cache_dir):
    tmp = temporary(paths.states_dir(), dead_pid())
    key = kvstate.StateKey("t", "m", "e", 512, "f16", "f16", "h")
    kvstate.save_state(key, np.arange(4, dtype=np.int32), b"state", label="doc")
    assert not tmp.exists()
    assert [e.label for e in kvstate.list_entries()] == ["doc"]


def test_a_writer_killed_while_saving_leaves_nothing_listed(cache_dir):
    code = textwrap.dedent(
        """
        import os, signal
        import numpy as np
        from kvlocal import kvstate
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # die with the temporary written
        key = kvstate.StateKey("t", "m", "e", 512, "f16", "f16", "h")
        kvstate.save_state(key, np.arange(1000, dtype=np.int32), b"x" * 100000, label="doc")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [p.name for p in paths.states_dir().iterdir()][0].startswith(".tmp-")

    assert kvstate.list_entries() == []
    assert list(paths.states_dir().iterdir()) == []
    listing = run("cache", "list")
    assert listing.exit_code == 0 and "no saved KV states" in listing.stdout


def test_cache_list_does_not_show_a_live_temporary(cache_dir):
    temporary(paths.states_dir(), os.getpid())
    listing = run("cache", "list")
    assert listing.exit_code == 0 and "no saved KV states" in listing.stdout
    cleared = run("cache", "clear")
    assert cleared.exit_code == 0 and "removed 0 saved KV states" in cleared.stderr


# ------------------------------------------------------------- item 10: a file for a cache dir


@pytest.fixture
def file_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(blocker))
    return blocker


@pytest.mark.parametrize("command", ["list", "clear"])
def test_cache_commands_say_the_cache_dir_is_a_file(file_cache, command):
    result = run("cache", command)
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f"kvlocal: error: the kvlocal cache dir {file_cache} (KVLOCAL_CACHE_DIR) is a file, not a folder"
    )
    assert result.stdout == ""
    assert file_cache.read_text() == "x"


def test_a_file_above_the_cache_dir_is_named(file_cache, monkeypatch):
    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(file_cache / "cache"))
    with pytest.raises(KvlocalError, match=f"is inside {file_cache}, which is a file"):
        kvstate.list_entries()


def test_a_file_for_the_states_folder_is_named(cache_dir):
    cache_dir.mkdir()
    (cache_dir / "states").write_text("x")
    result = run("cache", "list")
    assert result.exit_code == 1
    assert f"{cache_dir / 'states'}" in result.stderr and "is a file, not a folder" in result.stderr


@pytest.mark.engine
def test_doctor_reports_a_file_for_a_cache_dir(file_cache):
    result = run("doctor")
    assert result.exit_code == 0, result.stderr
    assert f"the kvlocal cache dir {file_cache} (KVLOCAL_CACHE_DIR) is a file, not a folder" in result.stdout
    assert "saved KV states" not in result.stdout


# -------------------------------------------------------- item 6: models that cannot generate text


def write_header_model(path: Path, arch: str, *, n_embd: int = 64, n_head: int = 4, **extra) -> Path:
    """A small GGUF whose header says what the test needs (one tensor: enough to validate)."""
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"kvlocal test {arch}")
    writer.add_context_length(512)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(1)
    writer.add_head_count(n_head)
    if "causal" in extra:
        writer.add_causal_attention(extra.pop("causal"))
    if "pooling" in extra:
        writer.add_pooling_type(PoolingType(extra.pop("pooling")))
    if "key_length" in extra:
        writer.add_key_length(extra.pop("key_length"))
    if "value_length" in extra:
        writer.add_value_length(extra.pop("value_length"))
    assert not extra, extra
    writer.add_tensor("token_embd.weight", np.zeros((8, n_embd), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "arch, extra, what",
    [
        ("bert", {"causal": False, "pooling": 2}, "architecture bert: an embedding/encoder model"),
        ("nomic-bert", {"pooling": 1}, "architecture nomic-bert: an embedding/encoder model"),
        ("t5encoder", {}, "architecture t5encoder: an embedding/encoder model"),
        ("llada", {}, "architecture llada: a diffusion model"),
        ("qwen2", {"causal": False, "pooling": 1}, "architecture qwen2 without causal attention: an embedding/encoder model"),
    ],
)
def test_models_that_do_not_generate_text_are_refused(tmp_path, cache_dir, arch, extra, what):
    path = write_header_model(tmp_path / f"{arch}.gguf", arch, **extra)
    with pytest.raises(ModelError) as caught:
        resolve_model(str(path))
    assert str(caught.value) == f"{path} is not a text-generation model ({what})"


def test_a_causal_embedding_model_is_accepted(tmp_path, cache_dir):
    # Qwen3-Embedding style: pooling on, attention causal (llama.cpp gives it a KV cache)
    path = write_header_model(tmp_path / "emb.gguf", "qwen3", causal=True, pooling=3)
    assert resolve_model(str(path)).info.architecture == "qwen3"


def test_an_odd_head_size_is_refused_before_loading(tmp_path, cache_dir):
    path = write_tiny_qwen2(tmp_path / "odd.gguf", n_embd=60)  # 4 heads of 15
    with pytest.raises(ModelError, match=r"odd attention head size \(15\b"):
        resolve_model(str(path))


@pytest.mark.parametrize("extra, size", [({"key_length": 15}, 15), ({"value_length": 33}, 33)])
def test_an_odd_explicit_head_size_is_refused(tmp_path, cache_dir, extra, size):
    path = write_header_model(tmp_path / "odd-kv.gguf", "llama", **extra)
    with pytest.raises(ModelError, match=rf"odd attention head size \({size}\b"):
        resolve_model(str(path))


@pytest.mark.engine
def test_ask_with_an_embedding_model_is_a_one_line_error(tmp_path, cache_dir, doc):
    path = write_header_model(tmp_path / "bert.gguf", "bert", causal=False, pooling=2)
    result = ask(doc, path)
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f"kvlocal: error: {path} is not a text-generation model (architecture bert: an embedding/encoder model)"
    )
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.engine
def test_ask_with_an_odd_head_size_is_a_one_line_error(tmp_path, cache_dir, doc):
    path = write_tiny_qwen2(tmp_path / "odd.gguf", n_embd=60)
    result = ask(doc, path)
    assert result.exit_code == 1
    assert "odd attention head size" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.engine
def test_a_ggml_abort_does_not_start_a_debugger(tmp_path):
    """Past kvlocal's checks (here: the engine called directly), a ggml assertion still aborts,
    but without forking gdb for a backtrace."""
    path = write_tiny_qwen2(tmp_path / "odd.gguf", n_embd=60)
    code = textwrap.dedent(
        f"""
        from kvlocal.engine import llama_cpp
        llm = llama_cpp().Llama(model_path={str(path)!r}, n_ctx=256, verbose=False)
        llm.eval([1, 2, 3])
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "GGML_NO_BACKTRACE"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == -signal.SIGABRT
    out = proc.stdout + proc.stderr
    assert "GGML_ASSERT(n_dims % 2 == 0)" in out
    assert "ggml_print_backtrace" not in out and "[Inferior" not in out and "gdb" not in out.lower()
