"""The engine's backend libraries export ggml's API only (patch 0014), and a model loads whatever
Python imported first.

A backend library that exported its C++ template instantiations let the dynamic linker bind
libllama's calls into it: on a CUDA machine every model load crashed in std::codecvt once numpy had
been imported before the engine. The first test reads what the built libraries export (no GPU
needed); the second loads a model after numpy in a fresh interpreter, on whatever device the engine
offloads to (the GPU check runs it on CUDA).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

API_PREFIXES = ("ggml_", "gguf_")


def _lib_dir() -> Path:
    from kvlocal.engine import llama_cpp

    return Path(llama_cpp().llama_cpp._lib._name).parent


def _backend_libraries() -> list[Path]:
    """libggml-<backend>.so of the installed engine (not libggml-base or the libggml registry)."""
    return sorted(p for p in _lib_dir().glob("libggml-*.so") if p.name != "libggml-base.so")


def exported_symbols(library: Path) -> list[str]:
    """The names a shared library defines in its dynamic symbol table."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    return [line.split()[-1] for line in out.stdout.splitlines() if len(line.split()) >= 3]


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("nm") is None,
                    reason="reads ELF dynamic symbols with nm (Linux, binutils)")
def test_backend_libraries_export_only_ggml_api():
    libraries = _backend_libraries()
    assert any(p.name == "libggml-cpu.so" for p in libraries), f"no CPU backend library in {_lib_dir()}"
    for library in libraries:
        symbols = exported_symbols(library)
        assert symbols, f"{library.name} exports nothing"
        foreign = [s for s in symbols if not s.startswith(API_PREFIXES)]
        assert not foreign, f"{library.name} exports {len(foreign)} symbols besides ggml's API, e.g. {foreign[:5]}"


LOAD_AFTER_NUMPY = """
import numpy  # first, as kvlocal's session does: the import order that crashed CUDA builds
import sys
from kvlocal.session import Session
session = Session(sys.argv[1], n_ctx=4096)
loaded = session.load_document("The access code is 1234. " * 20, label="order")
summary = session.answer("What is the access code?", max_tokens=2)
print("loaded", loaded.n_tokens, "answered", summary.n_answer_tokens)
"""


def test_model_loads_after_numpy(tiny_model: Path, cache_dir: Path):
    del cache_dir  # a private cache (the fixture sets KVLOCAL_CACHE_DIR)
    proc = subprocess.run([sys.executable, "-c", LOAD_AFTER_NUMPY, str(tiny_model)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.startswith("loaded "), proc.stdout
