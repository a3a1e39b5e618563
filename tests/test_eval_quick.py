"""`kvlocal eval quick` on the real default model: the ordering the claim rests on.

geometric must match full, and the window and random controls at the same budget must fall
below geometric on needles outside the window (the command exits 1 otherwise).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner


from kvlocal.cli import app  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.model]


def test_quick_eval_orders_the_modes(tmp_path):
    result = CliRunner().invoke(app, ["eval", "quick", "--out", str(tmp_path), "--no-plots"])
    assert result.exit_code == 0, result.stderr
    assert "check passed" in result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    modes = {c["mode"] for c in summary["cells"]}
    assert modes == {"full", "geometric", "window", "random"}
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert all(r["fallback"] == "" for r in rows)
    assert "| 2,048 | passkey | geometric |" in result.stdout
