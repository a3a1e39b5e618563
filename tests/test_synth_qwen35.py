"""The synthetic tiny qwen35 GGUF (Qwen3.5's hybrid decoder: Gated DeltaNet layers with a recurrent
state, full attention in every 4th layer) loads and decodes in the pinned llama.cpp (its routing:
tests/test_hybrid_routing.py)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from engine_probe import RawContext
from synth_gguf import tiny_vocab, write_tiny_qwen35

from kvlocal.engine import llama_cpp
from kvlocal.gguf_header import check_text_model, validate_gguf

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


def decode(c: RawContext, tokens: list[int]) -> np.ndarray:
    """Decode `tokens` after what the context holds: the last token's logits."""
    c.decode(tokens)
    return c.logits()


def greedy(c: RawContext, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Prefill `prompt`, then decode `n` greedy tokens one at a time: the tokens and their logits."""
    logits = decode(c, prompt)
    out, steps = [], []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = decode(c, [out[-1]])
        steps.append(logits)
    return out, np.stack(steps)


@pytest.fixture
def open_ctx(qwen35_model: Path):
    opened: list[RawContext] = []

    def open_one() -> RawContext:
        opened.append(RawContext(qwen35_model, n_ctx=1024))
        return opened[-1]

    yield open_one
    for c in opened:
        c.close()


@pytest.mark.engine
def test_loads_as_a_hybrid_model(open_ctx) -> None:
    c = open_ctx()
    m = llama_cpp()
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


@pytest.mark.engine
def test_a_long_prompt_gives_finite_logits(open_ctx) -> None:
    logits = decode(open_ctx(), prompt_tokens())
    assert logits.shape == (N_VOCAB,)
    assert np.isfinite(logits).all()
    assert logits.std() > 0
    assert np.abs(logits).max() < 100  # scaled so that nothing blows up


@pytest.mark.engine
def test_greedy_decode_is_deterministic_across_fresh_contexts(open_ctx) -> None:
    first = greedy(open_ctx(), prompt_tokens(), 12)
    second = greedy(open_ctx(), prompt_tokens(), 12)
    assert first[0] == second[0]
    assert np.array_equal(first[1], second[1])
    assert np.isfinite(first[1]).all()


@pytest.mark.engine
def test_the_recurrent_state_carries_the_prompt(open_ctx) -> None:
    """Token by token (the recurrent update) continues what a batch (the chunked update) left in the
    state: the logits agree; and a prompt that differs only far back changes them."""
    prompt = prompt_tokens()
    whole = decode(open_ctx(), prompt)
    split = open_ctx()
    decode(split, prompt[:150])
    for tok in prompt[150:]:
        stepwise = decode(split, [tok])
    # measured 2.4e-4 on logits of magnitude ~1 (the chunked and the recurrent update sum in other orders)
    diff = float(np.abs(whole - stepwise).max())
    assert diff <= 2e-3 * max(1.0, float(np.abs(whole).max())), diff
    # the first token still moves the last logits by 0.035 (0.6-1.0 for a change among the last 10)
    changed = decode(open_ctx(), [(prompt[0] + 1) % 250] + prompt[1:])
    assert float(np.abs(changed - whole).max()) > 10 * diff
