"""The engine boundary, read from the source with `ast`: kvlocal.engine is the only module of the
package (kvlocal/ and tui/) that imports llama_cpp or calls the engine's C API (a llama_* or ggml_*
function, by attribute, by name or by getattr), and the only one that takes the handles to it
(llama_cpp(), route_api(), ggml_lib()). Everything else calls EngineContext's methods."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "kvlocal" / "engine.py"
C_PREFIXES = ("llama_", "ggml_")
HANDLES = {"llama_cpp", "route_api", "ggml_lib"}  # what kvlocal.engine hands the C API out through


def sources() -> list[Path]:
    return sorted([*(ROOT / "kvlocal").rglob("*.py"), *(ROOT / "tui").rglob("*.py")])


def engine_reaches(source: str) -> list[str]:
    """Where `source` imports llama_cpp, takes a handle from kvlocal.engine, or names a C function:
    "line: what" each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if a.name.split(".")[0] == "llama_cpp"]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] == "llama_cpp":
                found.append(f"{line}: from {module} import")
            elif module.rpartition(".")[2] == "engine":
                found += [f"{line}: from {module} import {a.name}" for a in node.names
                          if a.name in HANDLES or a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith(C_PREFIXES):
            found.append(f"{line}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id.startswith(C_PREFIXES):
            found.append(f"{line}: {node.id}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and str(node.args[1].value).startswith(C_PREFIXES)):
            found.append(f"{line}: {node.func.id}(..., {node.args[1].value!r})")
    return sorted(found, key=lambda f: int(f.partition(":")[0]))


def test_the_scan_finds_every_way_in():
    planted = """
import llama_cpp
import llama_cpp.llama_cpp as bindings
from llama_cpp import llama_decode
from kvlocal.engine import llama_cpp as handle, route_api, EngineContext
from .engine import ggml_lib
module.llama_memory_seq_rm(mem, 0, 1, -1)
lib.ggml_get_name(t)
fn = getattr(lib, "llama_kv_route_set")
"""
    found = engine_reaches(planted)
    for what in ("import llama_cpp", "import llama_cpp.llama_cpp", "from llama_cpp import",
                 "from kvlocal.engine import llama_cpp", "from kvlocal.engine import route_api", "from engine import ggml_lib",
                 ".llama_memory_seq_rm", ".ggml_get_name", "getattr(..., 'llama_kv_route_set')"):
        assert any(f.endswith(what) for f in found), (what, found)
    assert not any("EngineContext" in f for f in found)
    assert engine_reaches("context.decode(tokens)\nstats = context.read_stats()\n") == []


def test_the_engine_module_is_where_the_calls_are():
    assert len(engine_reaches(ENGINE.read_text())) > 20  # the scan sees the engine's own calls


def test_only_the_engine_module_calls_the_c_api():
    files = sources()
    assert {"session.py", "library.py", "routing.py", "prefill.py", "capture.py", "app.py"} <= {p.name for p in files}
    outside = {str(p.relative_to(ROOT)): found for p in files if p != ENGINE
               if (found := engine_reaches(p.read_text()))}
    assert not outside, "the C API reached outside kvlocal/engine.py (give EngineContext a method): " + "; ".join(
        f"{path} line {', line '.join(found)}" for path, found in outside.items())


def test_the_route_settings_are_plain_config():
    """A Route is applied by the engine: routing.py imports neither the engine nor ctypes."""
    tree = ast.parse((ROOT / "kvlocal" / "routing.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {"ctypes", "kvlocal.engine"} & names
