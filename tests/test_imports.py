"""The package's import graph, read from the source with `ast`: no module imports itself back
through others (imports inside functions and under TYPE_CHECKING count too), and the CLI's
module-level imports never reach textual (the TUI loads it only when `kvlocal tui` runs)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package name -> its folder (kvlocal.tui lives in tui/, see pyproject's package-dir)
PACKAGES = {"kvlocal": ROOT / "kvlocal", "kvlocal.tui": ROOT / "tui"}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path], module_level_only: bool = False) -> set[str]:
    """Names `name` imports (the known module each resolves to, or the top-level name of an outside
    one). With `module_level_only`, the imports run when the module loads: not those in functions."""
    tree = ast.parse(path.read_text(), str(path))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    nodes, todo = [], [tree]
    while todo:  # with module_level_only, what runs on import: not the bodies of functions
        node = todo.pop()
        nodes.append(node)
        if not (module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
            todo += ast.iter_child_nodes(node)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}  # `from pkg import module`
    out = set()
    for target in names:
        while target and target not in known and "." in target:
            target = target.rpartition(".")[0]
        if target != name:
            out.add(target)
    return out


def graph(module_level_only: bool = False) -> dict[str, set[str]]:
    known = modules()
    return {name: {t for t in imported(name, path, known, module_level_only) if t in known}
            for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_package():
    edges = graph()
    assert {"kvlocal.cli", "kvlocal.session", "kvlocal.lab.rules", "kvlocal.tui.app"} <= set(edges)
    assert "kvlocal.evals.runner" in edges["kvlocal.evals.report"]
    assert "kvlocal.lab.capture" in edges["kvlocal.lab.decode"]  # an import inside a function


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    found = cycles(graph())
    assert not found, "modules that import each other (move the shared piece to the module that owns it): " + \
        "; ".join(" <-> ".join(c) for c in found)


def test_the_cli_does_not_load_textual_at_import():
    known = modules()
    seen, todo, outside = set(), ["kvlocal.cli"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for target in imported(name, known[name], known, module_level_only=True):
            if target in known:
                todo.append(target)
            else:
                outside.add(target.split(".")[0])
    assert "kvlocal.tui" not in seen and not any(name.startswith("kvlocal.tui.") for name in seen)
    assert "textual" not in outside


def test_the_document_set_reaches_neither_the_session_nor_the_engine():
    """kvlocal.docset sizes a set before any engine work (the sizes it shares with the session live in
    route_settings): nothing it imports, even inside a function, reaches the session or the engine."""
    edges = graph()
    seen, todo = set(), ["kvlocal.docset"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += edges[name]
    assert "kvlocal.ingest" in seen and not {"kvlocal.session", "kvlocal.engine", "kvlocal.library"} & seen
