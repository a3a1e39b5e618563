"""kvlocal's Python mirrors of the engine's C API against the patched include/llama.h: the enums
(RouteMode, Fallback), the ctypes structs (RouteParamsC, RouteStatsC), and the route defaults of
llama_kv_route_default_params() against route_settings.

The header is read twice where it can be: from the lines the repository's patches add to
include/llama.h (always there, no build needed), and from the patched tree that vendor/build_engine.py
unpacked under vendor/src when it carries this checkout's patches (what the installed engine was built
from)."""

from __future__ import annotations

import ctypes
import importlib.util
import re
from pathlib import Path

import pytest

from kvlocal.patchset import patch_files, patch_root

ROOT = Path(__file__).resolve().parent.parent
HEADER = "include/llama.h"

spec = importlib.util.spec_from_file_location("build_engine", ROOT / "vendor" / "build_engine.py")
build_engine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build_engine)


def header_from_patches() -> str:
    """The kvlocal part of include/llama.h as the patch series writes it, in order: a hunk whose
    context is kvlocal's own text (a field added to a struct an earlier patch added) is applied
    in place; a hunk into llama.cpp's own text adds its lines at the end, so every enum and struct
    reads as it does in the patched header."""
    out: list[str] = []
    for patch in patch_files():
        if patch_root(patch) != "vendor/llama.cpp":
            continue
        current, hunk = None, []
        for line in [*patch.read_text().splitlines(), "@@"]:
            if line.startswith(("diff --git ", "@@")):
                if current == HEADER and hunk:
                    _apply_hunk(out, hunk)
                hunk = []
                if line.startswith("diff --git "):
                    current = line.split(" b/", 1)[1]
            elif current == HEADER and line[:1] in (" ", "+", "-") and not line.startswith(("+++", "---")):
                hunk.append(line)
    return "\n".join(out)


def _apply_hunk(out: list[str], hunk: list[str]) -> None:
    """Apply one hunk to `out` where its old lines are found there, else append its added lines."""
    old = [line[1:] for line in hunk if line[0] in " -"]
    new = [line[1:] for line in hunk if line[0] in " +"]
    for start in range(len(out) - len(old) + 1):
        if old and out[start:start + len(old)] == old:
            out[start:start + len(old)] = new
            return
    out.extend(line[1:] for line in hunk if line[0] == "+")


def vendored_header() -> str | None:
    """include/llama.h of the patched tree under vendor/src, if it carries exactly patches/."""
    tree = build_engine.SRC / f"llama_cpp_python-{build_engine.read_pin()['version']}"
    applied = tree / ".kvlocal-applied"
    if not applied.is_dir():
        return None
    have = [(p.name, p.read_bytes()) for p in sorted(applied.glob("*.patch"))]
    if have != [(p.name, p.read_bytes()) for p in patch_files()]:
        return None
    return (tree / "vendor" / "llama.cpp" / HEADER).read_text()


@pytest.fixture(params=["patches", "vendored"])
def header(request) -> str:
    if request.param == "patches":
        return header_from_patches()
    text = vendored_header()
    if text is None:
        pytest.skip("no patched tree of this checkout's patches under vendor/src (make engine)")
    return text


def c_enum(text: str, name: str) -> dict[str, int]:
    body = re.search(r"enum %s \{(.*?)\};" % name, text, re.S)
    assert body, f"enum {name} not in llama.h"
    values = dict(re.findall(r"^\s*LLAMA_KV_ROUTE_(\w+)\s*=\s*(-?\d+)\s*,", body.group(1), re.M))
    # every enumerator has an explicit value, so that the numbering cannot shift
    assert len(values) == len(re.findall(r"^\s*LLAMA_KV_ROUTE_\w+", body.group(1), re.M)), name
    return {key: int(value) for key, value in values.items()}


CTYPES = {"int32_t": ctypes.c_int32, "uint32_t": ctypes.c_uint32, "int64_t": ctypes.c_int64,
          "float": ctypes.c_float}


def c_struct(text: str, name: str) -> list[tuple[str, type]]:
    body = re.search(r"struct %s \{(.*?)\};" % name, text, re.S)
    assert body, f"struct {name} not in llama.h"
    fields = []
    for line in body.group(1).splitlines():
        code = line.split("//", 1)[0].strip()
        if not code:
            continue
        m = re.fullmatch(r"(enum \w+|\w+)\s+(\w+);", code)
        assert m, f"unexpected line in struct {name}: {line!r}"
        ctype, field = m.groups()
        fields.append((field, ctypes.c_int if ctype.startswith("enum ") else CTYPES[ctype]))
    return fields


def test_route_mode_mirrors_the_header(header):
    from kvlocal.routing import RouteMode

    assert c_enum(header, "llama_kv_route_mode") == {mode.name: mode.value for mode in RouteMode}


def test_attention_paths_mirror_the_header(header):
    from kvlocal.route_settings import ATTENTION_PATHS
    from kvlocal.routing import ATTENTION_CODES, RouteAttention

    assert c_enum(header, "llama_kv_route_attn") == {path.name: path.value for path in RouteAttention}
    assert list(ATTENTION_CODES) == list(ATTENTION_PATHS)


def test_fallback_reasons_mirror_the_header(header):
    from kvlocal.routing import FALLBACK_REASONS, Fallback

    assert c_enum(header, "llama_kv_route_fallback") == {reason.name: reason.value for reason in Fallback}
    assert set(FALLBACK_REASONS) == set(Fallback)


@pytest.mark.parametrize("c_name, py_name", [("llama_kv_route_params", "RouteParamsC"),
                                             ("llama_kv_route_stats", "RouteStatsC"),
                                             ("llama_kv_route_seq_stats", "RouteSeqStatsC")])
def test_ctypes_structs_mirror_the_header(header, c_name, py_name):
    import kvlocal.engine

    assert c_struct(header, c_name) == list(getattr(kvlocal.engine, py_name)._fields_)


def test_the_route_api_is_one_setter_of_a_params_struct(header):
    assert re.search(r"LLAMA_API struct llama_kv_route_params llama_kv_route_default_params\(void\);", header)
    assert re.search(r"LLAMA_API int32_t llama_kv_route_set\(struct llama_context \* ctx, struct llama_kv_route_params params\);",
                     header)
    assert "llama_kv_route_set_pins" not in header


@pytest.mark.engine
def test_the_engine_defaults_are_the_tools():
    """llama_kv_route_default_params() is kvlocal's default route (the automatic shortlist is a
    Python rule: the C default scores in one level), and the block summaries are off unless asked."""
    from kvlocal import route_settings as rs
    from kvlocal.engine import llama_cpp, route_api
    from kvlocal.routing import Route, RouteMode

    p = route_api().llama_kv_route_default_params()
    route = Route()
    assert RouteMode(p.mode) == route.route_mode == RouteMode[rs.DEFAULT_MODE.upper()]
    assert (p.region_size, p.top_k, p.n_window, p.n_sink, p.seed) == (
        rs.DEFAULT_REGION, rs.DEFAULT_TOP_K, rs.DEFAULT_WINDOW, rs.DEFAULT_SINKS, 0)
    assert p.keep == pytest.approx(rs.DEFAULT_KEEP) and p.n_pin == rs.DEFAULT_PIN == route.pins
    assert p.n_shortlist == 0 and rs.DEFAULT_SHORTLIST == rs.SHORTLIST_AUTO
    assert p.top_k_batch == route.question_batch_top_k == 0
    assert llama_cpp().llama_context_default_params().kv_centroid_block == 0
