"""The patch-set id and the KV-state id (kvlocal.patchset), and the state cache key built on them; no engine."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvlocal import patchset
from kvlocal.engine import EngineInfo
from kvlocal.patchset import kv_state_id, keeps_prefill_kv, patch_files, patchset_id
from kvlocal.session import Session

ROOT = Path(__file__).resolve().parent.parent

DIFF = """diff --git a/src/x.cpp b/src/x.cpp
index 1111111..2222222 100644
--- a/src/x.cpp
+++ b/src/x.cpp
@@ -1,1 +1,2 @@
 int x;
+int y;
"""


def header(subject: str, *trailers: str) -> str:
    return f"Subject: {subject}\n\nWhy this patch exists.\n\n" + "".join(f"{t}\n" for t in trailers)


@pytest.fixture
def series(tmp_path) -> tuple[Path, Path]:
    """A patches/ folder with one marked and one unmarked patch, and a pin."""
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "0001-ops.patch").write_text(header("new ops", "Prefill-KV: unchanged") + DIFF)
    (patches / "0002-cache.patch").write_text(header("cache layout") + DIFF)
    pin = tmp_path / "PIN"
    pin.write_text("version = 1\n")
    return patches, pin


def test_only_unmarked_patches_and_the_pin_count(series):
    patches, pin = series
    before, build_before = kv_state_id(patch_files(patches), pin), patchset_id(patch_files(patches))
    marked = patches / "0001-ops.patch"
    marked.write_text(marked.read_text() + "+int z;\n")  # a marked patch changes: same state id, new engine
    assert kv_state_id(patch_files(patches), pin) == before
    assert patchset_id(patch_files(patches)) != build_before
    unmarked = patches / "0002-cache.patch"
    unmarked.write_text(unmarked.read_text() + "+int z;\n")  # an unmarked one changes: a new state id
    changed = kv_state_id(patch_files(patches), pin)
    assert changed != before
    pin.write_text("version = 2\n")
    assert kv_state_id(patch_files(patches), pin) != changed


def test_marking_a_patch_keeps_states_unmarking_it_does_not(series):
    patches, pin = series
    cache = patches / "0002-cache.patch"
    unmarked = kv_state_id(patch_files(patches), pin)
    cache.write_text(header("cache layout", "Prefill-KV: unchanged") + DIFF)
    all_marked = kv_state_id(patch_files(patches), pin)
    assert all_marked != unmarked
    assert all_marked == hashlib.sha256(pin.read_bytes()).hexdigest()[:16]  # just the pin
    cache.write_text(header("cache layout") + DIFF)
    assert kv_state_id(patch_files(patches), pin) == unmarked


@pytest.mark.parametrize("text, marked", [
    (header("ops", "Prefill-KV: unchanged") + DIFF, True),
    (header("ops", "Signed-off-by: A <a@b>", "  Prefill-KV: unchanged  ") + DIFF, True),
    (header("ops") + DIFF + "+// Prefill-KV: unchanged\n", False),  # in the diff body: does not count
    (header("ops") + DIFF.replace(" int x;", "Prefill-KV: unchanged"), False),  # a context line of the diff
    (header("ops", "Prefill-KV: changed") + DIFF, False),
    (header("ops", "Prefill-KV: unchanged, mostly") + DIFF, False),
    ("Prefill-KV: unchanged\n", False),  # no diff: no header
    (DIFF, False),
])
def test_the_trailer_counts_only_as_a_header_line(tmp_path, text, marked):
    patch = tmp_path / "0001-x.patch"
    patch.write_text(text)
    assert keeps_prefill_kv(patch) is marked


def test_every_repository_patch_is_a_format_patch_with_a_subject_and_a_rationale():
    for patch in patch_files():
        lines = patchset.patch_header(patch).splitlines()
        assert lines[0].startswith("From ") and lines[1].startswith("From: "), patch.name
        subject = next(i for i, line in enumerate(lines) if line.startswith("Subject: [PATCH] "))
        body = subject + 1
        while lines[body].startswith(" "):  # a folded subject
            body += 1
        assert lines[body] == "" and lines[body + 1].strip() and ":" not in lines[body + 1].split()[0], patch.name
        assert "---" in lines and lines.index("---") > body + 2, patch.name


def added_and_removed(patch: Path) -> dict[str, tuple[list[str], list[str]]]:
    """Per file the patch touches: the lines it adds and the lines it removes."""
    out: dict[str, tuple[list[str], list[str]]] = {}
    current = None
    for line in patch.read_text().split("\n")[len(patchset.patch_header(patch).split("\n")) - 1:]:
        if line.startswith("diff --git "):
            current = out.setdefault(line.split(" b/", 1)[1], ([], []))
        elif current is None or line.startswith(("--- ", "+++ ")):
            continue
        elif line.startswith("+"):
            current[0].append(line[1:])
        elif line.startswith("-"):
            current[1].append(line[1:])
    return out


def test_no_patch_removes_a_line_that_an_earlier_patch_added():
    """Each patch adds its concern in its final shape: a later one may extend an earlier one's code,
    not rewrite it (lines too plain to tell apart, such as a lone brace, are not compared)."""
    added: dict[str, set[str]] = {}
    for patch in patch_files():
        for path, (plus, minus) in added_and_removed(patch).items():
            rewritten = [line for line in minus if len(line.strip()) > 3 and line in added.get(path, set())]
            assert not rewritten, f"{patch.name} removes lines an earlier patch added to {path}: {rewritten[:3]}"
        for path, (plus, _) in added_and_removed(patch).items():
            added.setdefault(path, set()).update(plus)


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the patch tool")
def test_the_build_applies_and_reverts_a_patch_with_a_header_in_its_root(tmp_path):
    """A patch of llama.cpp applies in the sdist's vendor/llama.cpp, one with the bindings trailer
    in the package root (llama-cpp-python's own Python files)."""
    spec = importlib.util.spec_from_file_location("build_engine", ROOT / "vendor" / "build_engine.py")
    build_engine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_engine)
    tree = tmp_path / "sdist"
    (tree / "vendor" / "llama.cpp" / "src").mkdir(parents=True)
    (tree / "vendor" / "llama.cpp" / "src" / "x.cpp").write_text("int x;\n")
    (tree / "llama_cpp").mkdir()
    (tree / "llama_cpp" / "x.py").write_text("x = 1\n")
    engine_patch = tmp_path / "0001-x.patch"
    engine_patch.write_text(header("adds y", "Prefill-KV: unchanged") + DIFF)
    bindings_patch = tmp_path / "0002-x.patch"
    bindings_patch.write_text(header("adds y to the bindings", "Applies-To: llama-cpp-python")
                              + DIFF.replace("src/x.cpp", "llama_cpp/x.py").replace("int x;", "x = 1").replace("int y;", "y = 2"))
    assert (patchset.patch_root(engine_patch), patchset.patch_root(bindings_patch)) == ("vendor/llama.cpp", ".")
    for patch, path, before, after in [
        (engine_patch, tree / "vendor" / "llama.cpp" / "src" / "x.cpp", "int x;\n", "int x;\nint y;\n"),
        (bindings_patch, tree / "llama_cpp" / "x.py", "x = 1\n", "x = 1\ny = 2\n"),
    ]:
        for extra, want in [(["--dry-run"], before), ([], after), (["--reverse"], before)]:
            done = build_engine.run_patch(tree, patch, *extra)
            assert done.returncode == 0, done.stdout + done.stderr
            assert path.read_text() == want
    assert build_engine.patched_paths([engine_patch, bindings_patch]) == {"vendor/llama.cpp/src/x.cpp", "llama_cpp/x.py"}


def _session(engine: EngineInfo) -> SimpleNamespace:
    return SimpleNamespace(engine=engine, model=SimpleNamespace(sha256="m" * 64), kv_type="f16",
                           parts=SimpleNamespace(template_hash="t"), centroid_block=8)


def _engine(build_id: str | None, repo_patchset: str | None) -> EngineInfo:
    return EngineInfo(version="0.3", build_id=build_id, repo_patchset=repo_patchset, gpu_offload=False,
                      system_info="")


def test_state_key_of_a_current_engine_is_its_kv_state_id():
    repo = patchset.repo_patchset_id()
    key = Session.state_key(_session(_engine(f"kvlocal:{repo}", repo)), "doc", 4096)
    assert key.engine_build == f"kvstate:{kv_state_id(patch_files())}"


def test_state_key_of_a_routed_prefill_is_the_whole_build_id():
    repo = patchset.repo_patchset_id()
    key = Session.state_key(_session(_engine(f"kvlocal:{repo}", repo)), "doc", 4096, "routed:top16")
    assert key.engine_build == f"kvlocal:{repo}" and key.prefill == "routed:top16"


@pytest.mark.parametrize("build_id, repo_patchset", [
    ("kvlocal:0123456789abcdef", "fedcba9876543210"),  # built from other patches: out of date
    ("kvlocal:0123456789abcdef", None),  # an install without the repository
])
def test_state_key_of_any_other_engine_is_its_build_id(build_id, repo_patchset):
    key = Session.state_key(_session(_engine(build_id, repo_patchset)), "doc", 4096)
    assert key.engine_build == build_id
