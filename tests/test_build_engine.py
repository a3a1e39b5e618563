"""vendor/build_engine.py's engine pack: the patched source for a GPU machine without a registry.

A fake source tree stands in for the sdist: the pack keeps what a build reads, drops the rest,
records the patch set, and building from a pack refuses one made from other patches.
"""

from __future__ import annotations

import importlib.util
import json
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def build_engine():
    spec = importlib.util.spec_from_file_location("build_engine", ROOT / "vendor" / "build_engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_tree(root: Path) -> Path:
    tree = root / "llama_cpp_python-0.3.36"
    files = [
        "CMakeLists.txt", "PKG-INFO", "llama_cpp/__init__.py", "llama_cpp/lib/libllama.so",
        "docs/index.md", "vendor/llama.cpp/CMakeLists.txt", "vendor/llama.cpp/src/llama-graph.cpp",
        "vendor/llama.cpp/ggml/src/ggml.c", "vendor/llama.cpp/models/ggml-vocab-qwen2.gguf",
        "vendor/llama.cpp/tools/mtmd/mtmd.cpp", "vendor/llama.cpp/tests/test-backend-ops.cpp",
        "vendor/llama.cpp/tests/test-tokenizer-0.cpp", "vendor/llama.cpp/.github/workflows/build.yml",
        "vendor/llama.cpp/.git/HEAD",
    ]
    for rel in files:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(rel)
    return tree


def test_pack_keeps_what_a_build_reads(build_engine, tmp_path):
    tree = make_tree(tmp_path / "src")
    pin = build_engine.read_pin()
    set_id = build_engine.patchset_id(build_engine.patch_files())
    pack = tmp_path / "out" / "engine-src.tar.gz"
    build_engine.pack_make(tree, pin, set_id, pack)

    with tarfile.open(pack) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        manifest = json.load(tar.extractfile(f"kvlocal-engine-{set_id}/{build_engine.PACK_MANIFEST}"))
    assert {"CMakeLists.txt", "PKG-INFO", "llama_cpp/__init__.py", "vendor/llama.cpp/CMakeLists.txt",
            "vendor/llama.cpp/src/llama-graph.cpp", "vendor/llama.cpp/ggml/src/ggml.c",
            "vendor/llama.cpp/tests/test-backend-ops.cpp"} <= names
    for dropped in ("llama_cpp/lib/libllama.so", "docs/index.md", "vendor/llama.cpp/models/ggml-vocab-qwen2.gguf",
                    "vendor/llama.cpp/tools/mtmd/mtmd.cpp", "vendor/llama.cpp/tests/test-tokenizer-0.cpp",
                    "vendor/llama.cpp/.github/workflows/build.yml", "vendor/llama.cpp/.git/HEAD"):
        assert dropped not in names
    assert manifest["patchset"] == set_id
    assert manifest["sdist_sha256"] == pin["sha256"]
    assert manifest["patches"] == [p.name for p in build_engine.patch_files()]
    assert not list(pack.parent.glob("*.part"))  # written atomically


def test_from_pack_checks_the_patch_set(build_engine, tmp_path, monkeypatch):
    monkeypatch.setattr(build_engine, "SRC", tmp_path / "vendor-src")
    tree = make_tree(tmp_path / "src")
    pin = build_engine.read_pin()
    set_id = build_engine.patchset_id(build_engine.patch_files())

    good = tmp_path / "good.tar.gz"
    build_engine.pack_make(tree, pin, set_id, good)
    unpacked, got = build_engine.pack_unpack(good)
    assert got == set_id
    assert (unpacked / "vendor/llama.cpp/src/llama-graph.cpp").read_text() == "vendor/llama.cpp/src/llama-graph.cpp"

    stale = tmp_path / "stale.tar.gz"
    build_engine.pack_make(tree, pin, "0123456789abcdef", stale)
    with pytest.raises(SystemExit):
        build_engine.pack_unpack(stale)

    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not a tarball")
    with pytest.raises(SystemExit):
        build_engine.pack_unpack(junk)


def vulkan_sdk(tmp_path: Path, patch: int, minor: int = 3) -> Path:
    inc = tmp_path / f"sdk-{minor}-{patch}" / "include" / "vulkan"
    inc.mkdir(parents=True)
    (inc / "vulkan_core.h").write_text(f"#define VK_HEADER_VERSION {patch}\n"
                                       f"#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, {minor}, VK_HEADER_VERSION)\n")
    return inc.parent.parent


def test_the_vulkan_build_stops_early_on_headers_older_than_ggml_vulkan_needs(build_engine, tmp_path, monkeypatch, capsys):
    """Debian 12's Vulkan-Headers 1.3.239 lack VK_EXT_layer_settings, which ggml-vulkan.cpp uses: the
    build says so before compiling every shader; 1.3.272 and 1.4.x pass."""
    monkeypatch.setenv("VULKAN_SDK", str(vulkan_sdk(tmp_path, 239)))
    with pytest.raises(SystemExit):
        build_engine.check_vulkan_headers()
    assert "1.3.239" in capsys.readouterr().err
    for minor, patch in ((3, 272), (4, 309)):
        monkeypatch.setenv("VULKAN_SDK", str(vulkan_sdk(tmp_path, patch, minor)))
        build_engine.check_vulkan_headers()


def test_the_cpu_engine_has_the_rpc_backend_and_its_server(build_engine):
    """GGML_RPC=ON and ggml-rpc-server in the same CMake configuration (vendor/rpc_server.cmake), CPU only."""
    cpu = build_engine.cmake_args("cpu", None, "abc")
    assert "-DGGML_RPC=ON" in cpu
    [hook] = [a for a in cpu if a.startswith("-DCMAKE_PROJECT_llama_cpp_INCLUDE=")]
    hook_file = Path(hook.split("=", 1)[1])
    assert hook_file.is_file() and "ggml-rpc-server" in hook_file.read_text()
    assert not any("RPC" in a or "INCLUDE" in a for a in build_engine.cmake_args("cuda", "90", "abc"))
