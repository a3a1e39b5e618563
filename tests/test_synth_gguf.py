"""The synthetic tiny qwen2 GGUF loads, tokenizes and decodes in llama.cpp."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from synth_gguf import QWEN25_CHAT_TEMPLATE, tiny_vocab, write_tiny_qwen2

from kvlocal.gguf_header import validate_gguf

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

TOKENS = tiny_vocab()[0]
N_VOCAB = len(TOKENS)
IM_START, IM_END = TOKENS.index("<|im_start|>"), TOKENS.index("<|im_end|>")


def test_deterministic(tmp_path: Path) -> None:
    a = write_tiny_qwen2(tmp_path / "a.gguf", seed=1).read_bytes()
    b = write_tiny_qwen2(tmp_path / "b.gguf", seed=1).read_bytes()
    c = write_tiny_qwen2(tmp_path / "c.gguf", seed=2).read_bytes()
    assert a == b and a != c


def test_hparams_are_written(tmp_path: Path) -> None:
    path = write_tiny_qwen2(tmp_path / "m.gguf", n_layer=3, n_embd=96, n_head=6, n_head_kv=3, n_ctx=2048)
    info = validate_gguf(path)
    assert (info.n_layer, info.n_embd, info.n_head, info.n_head_kv, info.head_dim) == (3, 96, 6, 3, 16)
    assert info.context_length == 2048
    assert info.file_size < 4 << 20


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> Any:
    if llama_cpp is None:
        pytest.skip(_IMPORT_ERROR)
    model = llama_cpp.Llama(model_path=str(tiny_model), n_ctx=512, logits_all=True, verbose=False)
    yield model
    model.close()


@needs_engine
def test_loads_with_metadata(llm: Any) -> None:
    assert llm.metadata["general.architecture"] == "qwen2"
    assert llm.metadata["tokenizer.chat_template"] == QWEN25_CHAT_TEMPLATE
    assert llm.n_vocab() == N_VOCAB
    assert llm.n_ctx() == 512


@needs_engine
def test_tokenize_round_trip(llm: Any) -> None:
    text = b"Hello world, the quick brown fox!\n\tcode: x = [1, 2] # ok"
    tokens = llm.tokenize(text, add_bos=False)
    assert llm.detokenize(tokens) == text
    assert len(tokens) < len(text)  # some merges applied


@needs_engine
def test_special_tokens(llm: Any) -> None:
    tokens = llm.tokenize(b"<|im_start|>user\nhi<|im_end|>", add_bos=False, special=True)
    assert tokens[0] == IM_START and tokens[-1] == IM_END
    assert llm.token_eos() == IM_END
    assert IM_START not in llm.tokenize(b"<|im_start|>", add_bos=False, special=False)


@needs_engine
def test_eval_gives_finite_logits(llm: Any) -> None:
    llm.reset()
    tokens = llm.tokenize(b"<|im_start|>user\nthe hello world<|im_end|>\n", add_bos=False, special=True)
    llm.eval(tokens)
    assert llm.n_tokens == len(tokens)
    logits = np.asarray(llm.scores[: llm.n_tokens])
    assert logits.shape == (len(tokens), N_VOCAB)
    assert np.isfinite(logits).all()
    assert logits.std() > 0
