"""The ggml type ids kvlocal hands the engine are ggml's own (gguf mirrors `enum ggml_type`), and the
session, the lab and the CLI take them and the thread and context bounds from one place each."""

from __future__ import annotations

import ast
from pathlib import Path

import gguf

from kvlocal import ggml_types, route_settings


def test_type_ids_match_ggml():
    q = gguf.GGMLQuantizationType
    assert (ggml_types.GGML_TYPE_F32, ggml_types.GGML_TYPE_F16, ggml_types.GGML_TYPE_Q8_0) == (q.F32, q.F16, q.Q8_0)
    for name, type_id in ggml_types.TYPE_IDS.items():
        assert q[name.upper()] == type_id, name


def test_the_centroid_types_are_types_the_engine_is_handed():
    assert set(route_settings.CENTROID_TYPES) <= set(ggml_types.TYPE_IDS)


def test_each_constant_is_defined_in_one_module():
    """Everyone else imports these (a second definition could drift; ints compare equal either way)."""
    homes = {"GGML_TYPE_F32": "kvlocal/ggml_types.py", "GGML_TYPE_F16": "kvlocal/ggml_types.py",
             "GGML_TYPE_Q8_0": "kvlocal/ggml_types.py", "MAX_THREADS": "kvlocal/route_settings.py",
             "MIN_CTX": "kvlocal/route_settings.py"}
    root = Path(__file__).resolve().parent.parent
    defined = {}
    for path in [*(root / "kvlocal").rglob("*.py"), *(root / "tui").rglob("*.py")]:
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Name) and t.id in homes:
                    defined.setdefault(t.id, []).append(path.relative_to(root).as_posix())
    assert defined == {name: [home] for name, home in homes.items()}


def test_the_session_takes_the_type_ids_from_ggml_types():
    from kvlocal import session

    assert session.KV_TYPES is ggml_types.TYPE_IDS
