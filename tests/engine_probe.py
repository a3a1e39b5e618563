"""Low-level engine access for tests: a context with an eval callback that lists graph nodes."""

from __future__ import annotations

import ctypes
from pathlib import Path

from kvlocal.engine import ggml_lib, llama_cpp


def ggml_base() -> ctypes.CDLL:
    return ggml_lib()


class GraphRecorder:
    """Collects (op, name) of every node the scheduler evaluates while `recording` is true."""

    def __init__(self) -> None:
        self.lib = ggml_base()
        self.nodes: list[tuple[str, str]] = []
        self.recording = False
        module = llama_cpp()

        @module.ggml_backend_sched_eval_callback
        def _callback(tensor, ask, user_data):  # noqa: ARG001
            if ask and self.recording:
                self.nodes.append((self.lib.ggml_op_desc(tensor).decode(), self.lib.ggml_get_name(tensor).decode()))
            return False  # never ask for the data

        self.callback = _callback


class RawContext:
    """A model + context made with the C API directly, so that cb_eval can be set. The cache keeps
    centroids of 16-cell blocks unless centroid_block says otherwise (None: the library default, none)."""

    def __init__(self, model_path: Path, n_ctx: int = 2048, kv_type: int = 1, recorder: GraphRecorder | None = None,
                 centroid_block: int | None = 16, centroid_type: int | None = None):
        m = llama_cpp()
        mparams = m.llama_model_default_params()
        self.model = m.llama_model_load_from_file(str(model_path).encode(), mparams)
        assert self.model
        cparams = m.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = 512
        cparams.n_ubatch = 512
        cparams.n_threads = 2
        cparams.n_threads_batch = 2
        cparams.flash_attn_type = m.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cparams.type_k = kv_type
        cparams.type_v = kv_type
        if centroid_block is not None:
            cparams.kv_centroid_block = centroid_block
        if centroid_type is not None:
            cparams.kv_centroid_type = centroid_type
        if recorder is not None:
            cparams.cb_eval = recorder.callback
            cparams.cb_eval_user_data = None
        self.ctx = m.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            m.llama_model_free(self.model)
            raise RuntimeError("llama_init_from_model refused the context parameters")
        self.n_past = 0
        self.vocab = m.llama_model_get_vocab(self.model)
        self.n_vocab = m.llama_vocab_n_tokens(self.vocab)

    def decode(self, tokens: list[int]) -> None:
        m = llama_cpp()
        for i in range(0, len(tokens), 512):
            chunk = tokens[i : i + 512]
            batch = m.llama_batch_init(len(chunk), 0, 1)
            try:
                batch.n_tokens = len(chunk)
                for j, tok in enumerate(chunk):
                    batch.token[j] = tok
                    batch.pos[j] = self.n_past + j
                    batch.n_seq_id[j] = 1
                    batch.seq_id[j][0] = 0
                    batch.logits[j] = j == len(chunk) - 1
                assert m.llama_decode(self.ctx, batch) == 0
            finally:
                m.llama_batch_free(batch)
            self.n_past += len(chunk)

    def logits(self):
        import numpy as np

        m = llama_cpp()
        return np.ctypeslib.as_array(m.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)).copy()

    def close(self) -> None:
        m = llama_cpp()
        m.llama_free(self.ctx)
        m.llama_model_free(self.model)


def context_with_document(model_path: Path, n_doc: int, seed: int = 0) -> RawContext:
    """A RawContext (2,048 cells) that has prefilled `n_doc` random tokens."""
    import numpy as np

    ctx = RawContext(model_path, n_ctx=2048)
    ctx.decode([int(t) for t in np.random.default_rng(seed).integers(0, 250, size=n_doc)])
    return ctx


def routed_steps(raw: RawContext, steps: list[int], route) -> list:
    """Set `route` (a Route) and decode `steps` one token at a time: (logits, read stats) per step."""
    from kvlocal.engine import apply_route, read_stats

    apply_route(raw.ctx, route)
    out = []
    for tok in steps:
        raw.decode([tok])
        out.append((raw.logits(), read_stats(raw.ctx)))
    return out
