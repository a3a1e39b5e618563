"""The synthetic tiny qwen35 GGUF (Qwen3.5's hybrid decoder: Gated DeltaNet layers with a recurrent
state, full attention in every 4th layer) loads and decodes in the pinned llama.cpp (its routing:
tests/test_hybrid_routing.py)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader
from synth_gguf import tiny_vocab, write_tiny_qwen35

from kvlocal.gguf_header import check_text_model, validate_gguf

try:
    import llama_cpp
except Exception as err:  # noqa: BLE001 - any import failure means "no engine here"
    llama_cpp = None
    _IMPORT_ERROR = f"llama_cpp is not importable ({type(err).__name__}: {err})"
else:
    _IMPORT_ERROR = ""


def needs_engine(test):
    """Marked `engine` (deselected by -m "not engine"), and skipped where the engine cannot be imported."""
    return pytest.mark.engine(pytest.mark.skipif(llama_cpp is None, reason=_IMPORT_ERROR)(test))


N_VOCAB = len(tiny_vocab()[0])
N_LAYER, FULL_ATTENTION = 8, (3, 7)  # the writer's defaults: every 4th layer attends fully
N_PROMPT = 200


@pytest.fixture(scope="module")
def qwen35_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen35(tmp_path_factory.mktemp("qwen35") / "tiny-qwen35.gguf", seed=7)


def prompt_tokens(n: int = N_PROMPT, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 250, size=n)]


# -- the file ----------------------------------------------------------------------------------------


def test_deterministic(tmp_path: Path) -> None:
    a = write_tiny_qwen35(tmp_path / "a.gguf", seed=1).read_bytes()
    b = write_tiny_qwen35(tmp_path / "b.gguf", seed=1).read_bytes()
    c = write_tiny_qwen35(tmp_path / "c.gguf", seed=2).read_bytes()
    assert a == b and a != c


def test_header_and_tensor_shapes(qwen35_model: Path) -> None:
    info = check_text_model(validate_gguf(qwen35_model))
    assert info.architecture == "qwen35" and info.context_length == 4096
    assert (info.n_layer, info.n_embd, info.n_head, info.n_head_kv) == (N_LAYER, 128, 4, 2)
    assert info.head_dim == info.key_length == info.value_length == 64  # not n_embd / n_head, as in Qwen3.5
    assert info.rope_dims == 16  # partial RoPE
    reader = GGUFReader(qwen35_model)
    fields = {name: field.contents() for name, field in reader.fields.items() if name.startswith("qwen35.")}
    assert fields["qwen35.full_attention_interval"] == 4
    assert fields["qwen35.rope.dimension_sections"] == [3, 3, 2, 0]
    assert (fields["qwen35.ssm.conv_kernel"], fields["qwen35.ssm.state_size"], fields["qwen35.ssm.group_count"],
            fields["qwen35.ssm.time_step_rank"], fields["qwen35.ssm.inner_size"]) == (4, 32, 2, 4, 128)
    # llama.cpp's ne order (gguf-py reverses numpy's)
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    for il in range(N_LAYER):
        if il in FULL_ATTENTION:
            assert shapes[f"blk.{il}.attn_q.weight"] == (128, 2 * 4 * 64)  # query and output gate
            assert shapes[f"blk.{il}.attn_k.weight"] == shapes[f"blk.{il}.attn_v.weight"] == (128, 2 * 64)
            assert shapes[f"blk.{il}.attn_output.weight"] == (4 * 64, 128)
            assert f"blk.{il}.ssm_a" not in shapes
        else:
            assert shapes[f"blk.{il}.attn_qkv.weight"] == (128, 2 * 2 * 32 + 4 * 32)
            assert shapes[f"blk.{il}.ssm_conv1d.weight"] == (4, 2 * 2 * 32 + 4 * 32)
            assert shapes[f"blk.{il}.ssm_a"] == shapes[f"blk.{il}.ssm_dt.bias"] == (4,)
            assert f"blk.{il}.attn_q.weight" not in shapes


def test_bad_shapes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rope_sections"):
        write_tiny_qwen35(tmp_path / "x.gguf", n_rot=32)  # the default sections cover 16 dimensions
    with pytest.raises(ValueError, match="ssm_dt_rank"):
        write_tiny_qwen35(tmp_path / "x.gguf", ssm_n_group=3)


# -- the engine ----------------------------------------------------------------------------------------


class Qwen35Context:
    """The model and a fresh context made with the C API (flash attention on, as kvlocal runs)."""

    def __init__(self, path: Path, n_ctx: int = 1024, n_batch: int = 512) -> None:
        from kvlocal.engine import llama_cpp as module

        m = self.m = module()
        self.model = m.llama_model_load_from_file(str(path).encode(), m.llama_model_default_params())
        assert self.model, "llama.cpp did not load the qwen35 model"
        cparams = m.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_threads = cparams.n_threads_batch = 2
        cparams.flash_attn_type = m.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cparams.kv_centroid_block = 16
        self.ctx = m.llama_init_from_model(self.model, cparams)
        assert self.ctx
        self.n_past = 0
        self.n_vocab = m.llama_vocab_n_tokens(m.llama_model_get_vocab(self.model))

    def decode(self, tokens: list[int], all_logits: bool = False) -> np.ndarray:
        """Decode `tokens` in one batch: the logits of every token (all_logits) or of the last."""
        m = self.m
        batch = m.llama_batch_init(len(tokens), 0, 1)
        try:
            batch.n_tokens = len(tokens)
            for j, tok in enumerate(tokens):
                batch.token[j] = tok
                batch.pos[j] = self.n_past + j
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = all_logits or j == len(tokens) - 1
            assert m.llama_decode(self.ctx, batch) == 0
        finally:
            m.llama_batch_free(batch)
        self.n_past += len(tokens)
        rows = len(tokens) if all_logits else 1
        logits = np.ctypeslib.as_array(m.llama_get_logits(self.ctx), shape=(rows, self.n_vocab)).copy()
        return logits if all_logits else logits[0]

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
        """Prefill `prompt`, then decode `n` greedy tokens one at a time: the tokens and their logits."""
        logits = self.decode(prompt)
        out, steps = [], []
        for _ in range(n):
            token = int(np.argmax(logits))
            out.append(token)
            logits = self.decode([token])
            steps.append(logits)
        return out, np.stack(steps)

    def close(self) -> None:
        self.m.llama_free(self.ctx)
        self.m.llama_model_free(self.model)


@pytest.fixture
def open_ctx(qwen35_model: Path):
    opened: list[Qwen35Context] = []

    def open_one(**kwargs: Any) -> Qwen35Context:
        opened.append(Qwen35Context(qwen35_model, **kwargs))
        return opened[-1]

    yield open_one
    for c in opened:
        c.close()


@needs_engine
def test_loads_as_a_hybrid_model(open_ctx) -> None:
    c = open_ctx()
    m = c.m
    assert m.llama_model_is_hybrid(c.model) and not m.llama_model_is_recurrent(c.model)
    assert m.llama_model_n_layer(c.model) == N_LAYER
    assert (m.llama_model_n_head(c.model), m.llama_model_n_head_kv(c.model)) == (4, 2)
    assert m.llama_model_n_embd(c.model) == 128
    assert m.llama_model_rope_type(c.model) == m.LLAMA_ROPE_TYPE_IMROPE
    assert m.llama_model_n_swa(c.model) == 0
    assert c.n_vocab == N_VOCAB
    buf = ctypes.create_string_buffer(64)
    assert m.llama_model_meta_val_str(c.model, b"general.architecture", buf, 64) > 0
    assert buf.value == b"qwen35"


@needs_engine
def test_a_long_prompt_gives_finite_logits(open_ctx) -> None:
    c = open_ctx()
    logits = c.decode(prompt_tokens(), all_logits=True)
    assert logits.shape == (N_PROMPT, N_VOCAB)
    assert np.isfinite(logits).all()
    assert logits.std() > 0
    assert np.abs(logits).max() < 100  # scaled so that nothing blows up


@needs_engine
def test_greedy_decode_is_deterministic_across_fresh_contexts(open_ctx) -> None:
    first = open_ctx().greedy(prompt_tokens(), 12)
    second = open_ctx().greedy(prompt_tokens(), 12)
    assert first[0] == second[0]
    assert np.array_equal(first[1], second[1])
    assert np.isfinite(first[1]).all()


@needs_engine
def test_the_recurrent_state_carries_the_prompt(open_ctx) -> None:
    """Token by token (the recurrent update) continues what a batch (the chunked update) left in the
    state: the logits agree; and a prompt that differs only far back changes them."""
    prompt = prompt_tokens()
    whole = open_ctx().decode(prompt)
    split = open_ctx()
    split.decode(prompt[:150])
    for tok in prompt[150:]:
        stepwise = split.decode([tok])
    # measured 2.4e-4 on logits of magnitude ~1 (the chunked and the recurrent update sum in other orders)
    diff = float(np.abs(whole - stepwise).max())
    assert diff <= 2e-3 * max(1.0, float(np.abs(whole).max())), diff
    # the first token still moves the last logits by 0.035 (0.6-1.0 for a change among the last 10)
    changed = open_ctx().decode([(prompt[0] + 1) % 250] + prompt[1:])
    assert float(np.abs(changed - whole).max()) > 10 * diff
