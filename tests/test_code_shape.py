"""The code's shape, as the charter sets it: no function in kvlocal/ or tui/ over MAX_FUNCTION lines, and
the command line's entry module a thin layer of at most MAX_CLI lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION = 80  # lines of a function or method, decorators left out, its docstring counted
MAX_CLI = 700


def sources() -> list[Path]:
    """Every Python file of kvlocal/ and tui/, once (kvlocal/tui may be a link to tui/)."""
    found = {p.resolve() for folder in ("kvlocal", "tui") for p in (ROOT / folder).rglob("*.py")}
    return sorted(found)


def long_functions(path: Path, limit: int) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_no_function_is_longer_than_the_limit():
    files = sources()
    assert len(files) > 40 and any(p.parent.name == "tui" for p in files)  # both trees were found
    assert [f for p in files for f in long_functions(p, MAX_FUNCTION)] == []


def test_the_scan_finds_a_long_function(tmp_path):
    """The check can fail: a function one line over the limit is named."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    path = tmp_path / "probe.py"
    path.write_text(f"def too_long():\n{body}\n\n\ndef fits():\n    return 1\n")
    assert long_functions(path, MAX_FUNCTION) == [f"probe.py:1 too_long ({MAX_FUNCTION + 1} lines)"]


def test_the_cli_entry_module_is_thin():
    assert len((ROOT / "kvlocal" / "cli.py").read_text().splitlines()) <= MAX_CLI
