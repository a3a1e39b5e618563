"""llama.cpp's test-backend-ops cases for kvlocal's ggml helpers (patch 0002), run on the CPU.

On a machine with a GPU backend the same binary compares that backend with the CPU
(`test-backend-ops -o KV_REGION_CENTROIDS,KV_SPARSE_GATHER`); here the CPU runs every case.
`make backend-ops` builds the binary; `make test` sets KVLOCAL_BACKEND_OPS to it.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

DEFAULT = Path(__file__).resolve().parent.parent / "vendor" / "build" / "tests-cpu" / "test-backend-ops"


def test_kv_region_ops_pass_test_backend_ops():
    binary = Path(os.environ.get("KVLOCAL_BACKEND_OPS", DEFAULT))
    if not binary.exists():
        if "KVLOCAL_BACKEND_OPS" in os.environ:
            pytest.fail(f"{binary} was not built")
        pytest.skip("test-backend-ops is not built (make backend-ops)")
    out = subprocess.run(
        [str(binary), "-b", "CPU", "-o", "KV_REGION_CENTROIDS,KV_SPARSE_GATHER"],
        capture_output=True, text=True, timeout=600,
    )
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr)
    assert out.returncode == 0, text
    match = re.search(r"(\d+)/(\d+) tests passed", text)
    assert match and match.group(1) == match.group(2) and int(match.group(2)) >= 12, text
