"""Size and duration formatting (engine-free), and the layering rule that keeps it a leaf."""

from __future__ import annotations

import ast
from pathlib import Path

from kvlocal.units import human_bytes, human_seconds

ROOT = Path(__file__).resolve().parents[1]


def test_human_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1,023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 1024**3) == "3.0 GiB"
    assert human_bytes(5000 * 1024**3) == "5,000.0 GiB"


def test_human_seconds():
    assert human_seconds(0) == "0:00"
    assert human_seconds(61.4) == "1:01"
    assert human_seconds(3725) == "1:02:05"
    assert human_seconds(float("inf")) == "--:--"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_tui_imports_nothing_from_the_cli_layer():
    for path in sorted((ROOT / "tui").glob("*.py")):
        bad = {m for m in _imports(path) if m in ("kvlocal.cli", "kvlocal.progress") or m.startswith("typer")}
        assert not bad, f"{path.name} imports {bad}"


def test_units_is_a_leaf():
    assert not {m for m in _imports(ROOT / "kvlocal" / "units.py") if m.startswith("kvlocal")}
