"""Saved KV states without the engine: round trip, every kind of damage, atomic writes, listing."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import replace

import numpy as np
import pytest

from kvlocal import kvstate
from kvlocal.kvstate import StateCacheError, StateKey

KEY = StateKey("text", "model", "engine", 4096, "f16", "f16", "template")
TOKENS = np.arange(300, dtype=np.int32)
STATE = bytes(range(256)) * 40


@pytest.fixture
def root(tmp_path):
    return tmp_path / "states"


def test_a_saved_state_loads_back_byte_for_byte(root):
    path = kvstate.save_state(KEY, TOKENS, STATE, label="report.pdf", root=root)
    assert path == kvstate.state_path(KEY, root) and path.suffix == kvstate.SUFFIX
    tokens, state = kvstate.load_state(KEY, root)
    np.testing.assert_array_equal(tokens, TOKENS)
    assert tokens.dtype == np.int32 and state == STATE
    assert [p.name for p in root.iterdir()] == [path.name]  # no temporary left behind


def test_no_entry_is_none_and_every_key_field_names_another_entry(root):
    assert kvstate.load_state(KEY, root) is None
    kvstate.save_state(KEY, TOKENS, STATE, label="doc", root=root)
    for field in ("text_sha256", "model_sha256", "engine_build", "type_k", "template_hash"):
        assert kvstate.load_state(replace(KEY, **{field: "other"}), root) is None
    assert kvstate.load_state(replace(KEY, n_ctx=8192), root) is None
    assert kvstate.load_state(replace(KEY, prefill="routed:top16"), root) is None


def test_a_dense_prefills_key_is_the_key_states_were_saved_under_before_routed_prefill(root):
    # the seven fields alone, as every key was written before the prefill field: saved states keep loading
    before = {"text_sha256": "text", "model_sha256": "model", "engine_build": "engine", "n_ctx": 4096,
              "type_k": "f16", "type_v": "f16", "template_hash": "template"}
    assert KEY.digest() == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:32]
    path = kvstate.save_state(KEY, TOKENS, STATE, label="doc", root=root)
    with open(path, "rb") as fh:
        header = kvstate._read_header(fh)
    assert header["key"] == before
    routed = replace(KEY, prefill="routed:top16")
    assert routed.digest() != KEY.digest()
    kvstate.save_state(routed, TOKENS, STATE[:100], label="doc", root=root)
    assert kvstate.load_state(routed, root)[1] == STATE[:100] and kvstate.load_state(KEY, root)[1] == STATE


def _damage(path, how):
    raw = bytearray(path.read_bytes())
    (header_len,) = struct.unpack_from("<I", raw, len(kvstate.MAGIC))
    body = len(kvstate.MAGIC) + 4 + header_len
    if how == "magic":
        raw[0] ^= 0xFF
    elif how == "truncated":
        raw = raw[:-7]
    elif how == "trailing":
        raw += b"x"
    elif how == "body":
        raw[body + 5] ^= 0x01  # a token
    elif how == "state":
        raw[-1] ^= 0x01
    elif how == "header":
        raw[len(kvstate.MAGIC) + 4] = ord("x")  # the JSON no longer parses
    elif how == "header length":
        struct.pack_into("<I", raw, len(kvstate.MAGIC), 1 << 30)
    elif how == "empty":
        raw = b""
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how, reason", [
    ("magic", "not a kvlocal state file"),
    ("empty", "not a kvlocal state file"),
    ("truncated", "truncated"),
    ("trailing", "trailing bytes"),
    ("body", "checksum"),
    ("state", "checksum"),
    ("header", "damaged header"),
    ("header length", "damaged header"),
])
def test_a_damaged_entry_is_refused_with_its_reason(root, how, reason):
    path = kvstate.save_state(KEY, TOKENS, STATE, label="doc", root=root)
    _damage(path, how)
    with pytest.raises(StateCacheError, match=reason):
        kvstate.load_state(KEY, root)
    kvstate.discard(KEY, root)
    assert kvstate.load_state(KEY, root) is None


def test_an_entry_whose_header_names_another_key_is_refused(root):
    """A file renamed (or copied) onto another key's name: the header's key decides."""
    other = replace(KEY, text_sha256="another document")
    kvstate.save_state(other, TOKENS, STATE, label="doc", root=root)
    kvstate.state_path(other, root).rename(kvstate.state_path(KEY, root))
    with pytest.raises(StateCacheError, match="key does not match"):
        kvstate.load_state(KEY, root)


def test_a_header_with_a_wrong_count_is_damage_not_a_crash(root):
    path = kvstate.save_state(KEY, TOKENS, STATE, label="doc", root=root)
    raw = path.read_bytes()
    (header_len,) = struct.unpack_from("<I", raw, len(kvstate.MAGIC))
    start = len(kvstate.MAGIC) + 4
    header = json.loads(raw[start:start + header_len])
    header["n_tokens"] = "many"
    new = json.dumps(header).encode()
    path.write_bytes(kvstate.MAGIC + struct.pack("<I", len(new)) + new + raw[start + header_len:])
    with pytest.raises(StateCacheError, match="damaged header"):
        kvstate.load_state(KEY, root)


def test_a_failed_write_leaves_the_old_entry_and_no_temporary(root, monkeypatch):
    kvstate.save_state(KEY, TOKENS, STATE, label="old", root=root)

    def fail(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kvstate.os, "fsync", fail)
    with pytest.raises(OSError):
        kvstate.save_state(KEY, TOKENS[:10], b"new", label="new", root=root)
    monkeypatch.undo()
    tokens, state = kvstate.load_state(KEY, root)
    assert state == STATE and tokens.size == TOKENS.size
    assert [p.name for p in root.iterdir()] == [kvstate.state_path(KEY, root).name]


def test_entries_are_listed_with_their_labels_and_cleared(root):
    kvstate.save_state(KEY, TOKENS, STATE, label="a.pdf", root=root)
    kvstate.save_state(replace(KEY, text_sha256="b"), TOKENS[:5], b"s", label="b.txt", root=root)
    entries = sorted(kvstate.list_entries(root), key=lambda e: e.label)
    assert [(e.label, e.n_tokens) for e in entries] == [("a.pdf", 300), ("b.txt", 5)]
    assert all(e.size == e.path.stat().st_size for e in entries)
    assert kvstate.clear_entries(root) == 2
    assert kvstate.list_entries(root) == []
