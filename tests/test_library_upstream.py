"""Upstream llama.cpp behaviours the library design (docs/library.md) relies on, on the tiny model.

These check the pinned engine, not kvlocal code: how saved per-document states become one cache.
A change of the pin that breaks one of them breaks the library's assembly plan. They use no routing
(dense attention), so the engine patches for the library can land without touching this file.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytestmark = pytest.mark.engine

from kvlocal.engine import llama_cpp  # noqa: E402

N_A, N_B, N_Q = 150, 200, 12
# the deferred K-shift re-rotates the stored keys; it is not bit-exact against a fresh RoPE
# (measured 3e-5 on logits of magnitude ~0.5 here)
SHIFT_TOL = 2e-4


class _Ctx:
    """A context of the C API with `n_seq_max` sequences in one unified KV cache, dense attention."""

    def __init__(self, model, n_seq_max: int, n_ctx: int = 1024) -> None:
        m = llama_cpp()
        cparams = m.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = 512
        cparams.n_threads = cparams.n_threads_batch = 1
        cparams.n_seq_max = n_seq_max
        cparams.kv_unified = True  # one stream: seq_cp shares cells, n_ctx is every sequence's context
        cparams.flash_attn_type = m.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = m.llama_init_from_model(model.model, cparams)
        assert self.ctx
        self.mem = m.llama_get_memory(self.ctx)
        self.n_vocab = model.n_vocab

    def decode(self, tokens: list[int], pos0: int, seq: int = 0) -> np.ndarray:
        m = llama_cpp()
        batch = m.llama_batch_init(len(tokens), 0, 1)
        try:
            batch.n_tokens = len(tokens)
            for i, tok in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos0 + i, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = i == len(tokens) - 1
            assert m.llama_decode(self.ctx, batch) == 0
        finally:
            m.llama_batch_free(batch)
        return np.ctypeslib.as_array(m.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)).copy()

    def get_state(self, seq: int) -> bytes:
        m = llama_cpp()
        size = m.llama_state_seq_get_size(self.ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        assert m.llama_state_seq_get_data(self.ctx, buf, size, seq) == size
        return bytes(buf)

    def set_state(self, state: bytes, seq: int) -> None:
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        assert llama_cpp().llama_state_seq_set_data(self.ctx, buf, len(state), seq) == len(state)

    def pos_range(self, seq: int) -> tuple[int, int]:
        m = llama_cpp()
        return m.llama_memory_seq_pos_min(self.mem, seq), m.llama_memory_seq_pos_max(self.mem, seq)

    def close(self) -> None:
        llama_cpp().llama_free(self.ctx)


class _Model:
    def __init__(self, path) -> None:
        m = llama_cpp()
        params = m.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = m.llama_model_load_from_file(str(path).encode(), params)
        assert self.model
        self.n_vocab = m.llama_vocab_n_tokens(m.llama_model_get_vocab(self.model))


@pytest.fixture(scope="module")
def setup(tiny_model):
    model = _Model(tiny_model)
    rng = np.random.default_rng(1)
    a, b, q = (rng.integers(5, model.n_vocab - 4, n).tolist() for n in (N_A, N_B, N_Q))
    single = _Ctx(model, 1)  # each document prefilled alone, as a single-document state is saved today
    single.decode(a, 0)
    state_a = single.get_state(0)
    llama_cpp().llama_memory_clear(single.mem, True)
    single.decode(b, 0)
    state_b = single.get_state(0)
    single.close()
    yield model, a, b, q, state_a, state_b
    llama_cpp().llama_model_free(model.model)


def _stage(ctx: _Ctx, state: bytes, shift: int) -> None:
    """The library's staging step: load into seq 1, shift, share with seq 0, drop seq 1."""
    m = llama_cpp()
    ctx.set_state(state, 1)
    if shift:
        m.llama_memory_seq_add(ctx.mem, 1, 0, -1, shift)
    m.llama_memory_seq_cp(ctx.mem, 1, 0, -1, -1)
    m.llama_memory_seq_rm(ctx.mem, 1, -1, -1)


def test_loading_a_sequence_replaces_only_that_sequence(setup):
    model, _, _, _, state_a, state_b = setup
    ctx = _Ctx(model, 3)
    try:
        ctx.set_state(state_a, 1)
        ctx.set_state(state_b, 2)
        assert ctx.pos_range(1) == (0, N_A - 1) and ctx.pos_range(2) == (0, N_B - 1)
        ctx.set_state(state_a, 1)  # state_read_meta removes the destination sequence first
        assert ctx.pos_range(1) == (0, N_A - 1) and ctx.pos_range(2) == (0, N_B - 1)
    finally:
        ctx.close()


def test_consecutive_assembly_matches_each_document_prefilled_at_its_shifted_positions(setup):
    model, a, b, q, state_a, state_b = setup
    m = llama_cpp()
    ctx = _Ctx(model, 2)  # seq 0: the question's, seq 1: staging, reused for every document
    ref = _Ctx(model, 3)
    try:
        _stage(ctx, state_a, 0)
        _stage(ctx, state_b, N_A)
        # a cell whose other sequence is removed stays, held by seq 0 alone
        assert ctx.pos_range(0) == (0, N_A + N_B - 1) and ctx.pos_range(1) == (-1, -1)
        assembled = ctx.decode(q, N_A + N_B)

        ref.decode(a, 0, seq=1)
        ref.decode(b, N_A, seq=2)  # B encoded fresh at the shifted positions, not attending to A
        m.llama_memory_seq_cp(ref.mem, 1, 0, -1, -1)
        m.llama_memory_seq_cp(ref.mem, 2, 0, -1, -1)
        expected = ref.decode(q, N_A + N_B)
        assert np.abs(assembled - expected).max() < SHIFT_TOL
        assert assembled.argmax() == expected.argmax()
    finally:
        ctx.close()
        ref.close()


def test_parallel_positions_duplicate_in_one_sequence_decode(setup):
    model, a, b, q, state_a, state_b = setup
    m = llama_cpp()
    ctx = _Ctx(model, 2)
    ref = _Ctx(model, 3)
    try:
        _stage(ctx, state_a, 0)
        _stage(ctx, state_b, 0)  # both documents at positions from 0: duplicates in seq 0
        assert ctx.pos_range(0) == (0, max(N_A, N_B) - 1)
        assembled = ctx.decode(q, max(N_A, N_B))  # the question follows the longest document
        ref.decode(a, 0, seq=1)
        ref.decode(b, 0, seq=2)
        m.llama_memory_seq_cp(ref.mem, 1, 0, -1, -1)
        m.llama_memory_seq_cp(ref.mem, 2, 0, -1, -1)
        expected = ref.decode(q, max(N_A, N_B))
        assert np.abs(assembled - expected).max() < SHIFT_TOL
    finally:
        ctx.close()
        ref.close()
