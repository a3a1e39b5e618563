"""The routing lab's capture: the dense model's real post-RoPE queries and keys, from llama.cpp's graph.

Queries (and the keys of the question and answer tokens) are read with llama.cpp's eval callback
(`cb_eval` of the context parameters) from the graph nodes the model names `Qcur-<layer>` and
`Kcur-<layer>` after RoPE; the document's keys come from the saved KV state, byte for byte what
the cache holds. Nothing here routes: the capture runs dense decoding, the reference.
"""

from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass, field

import numpy as np

from kvlocal.engine import eval_callback, eval_callback_installed, tensor_floats, tensor_name, tensor_op, tensor_size
from kvlocal.errors import EngineError
from kvlocal.ggml_types import GGML_TYPE_F16

STATE_MAGIC = 0xAF143CD8  # llama-context.cpp io_magic, first word of a sequence state


@dataclass
class CapturedSteps:
    """Per decode step: the query of every layer and the key it wrote. [step, layer, head, dim] F32."""

    q: list[np.ndarray] = field(default_factory=list)
    k: list[np.ndarray] = field(default_factory=list)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.stack(self.q), np.stack(self.k)


class QKCapture:
    """An eval callback that records the roped Q and K of every layer of single-token graphs.

    Use `installed()` around the creation of the llama context (the callback is a context
    parameter), then set `active` while the steps to record are decoded."""

    def __init__(self, n_layer: int, n_head: int, n_head_kv: int, head_dim: int) -> None:
        self.n_layer, self.n_head, self.n_head_kv, self.head_dim = n_layer, n_head, n_head_kv, head_dim
        self.active = False
        self.steps = CapturedSteps()
        self._q = np.zeros((n_layer, n_head, head_dim), np.float32)
        self._k = np.zeros((n_layer, n_head_kv, head_dim), np.float32)
        self._seen = 0
        self._callback = eval_callback(self._on_tensor)  # alive as long as the capture: a context calls it

    def reset(self) -> None:
        self.steps = CapturedSteps()

    def _wanted(self, t: int) -> tuple[str, int] | None:
        kind, _, layer = tensor_name(t).partition("-")
        if kind not in ("Qcur", "Kcur") or not layer.isdigit():
            return None
        if tensor_op(t) != "ROPE":
            return None
        return kind, int(layer)

    def _on_tensor(self, t: int, ask: bool, _user: int) -> bool:
        if not self.active:
            return False if ask else True
        wanted = self._wanted(t)
        if ask:
            return wanted is not None
        if wanted is None:
            return True
        kind, layer = wanted
        dest = self._q[layer] if kind == "Qcur" else self._k[layer]
        if tensor_size(t) != dest.size:
            return True  # a batch of several tokens (prefill): not a decode step
        dest[...] = tensor_floats(t, dest.size).reshape(dest.shape)
        self._seen += 1
        if self._seen == 2 * self.n_layer:  # every layer's Q and K: one step done
            self.steps.q.append(self._q.copy())
            self.steps.k.append(self._k.copy())
            self._seen = 0
        return True

    def installed(self) -> contextlib.AbstractContextManager[None]:
        """Contexts created inside this block call the capture for every graph node."""
        return eval_callback_installed(self._callback)


def state_keys(state: bytes, n_layer: int, n_embd_k_gqa: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions [n_cells], keys [n_layer, n_cells, n_embd_k_gqa] F16) of one sequence's saved state
    (llama_state_seq_get_data of a standard KV cache: one stream, cells in position order)."""
    pos, keys, _ = state_kv(state, n_layer, n_embd_k_gqa, with_values=False)
    return pos, keys


def state_kv(state: bytes, n_layer: int, n_embd_gqa: int, with_values: bool = True
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(positions, keys, values or None) of one sequence's saved state; values need an untransposed
    V cache (flash attention on), [n_layer, n_cells, n_embd_gqa] F16 like the keys."""
    off = 0

    def take(fmt: str):
        nonlocal off
        values = struct.unpack_from("<" + fmt, state, off)
        off += struct.calcsize("<" + fmt)
        return values

    magic, _seq_id, n_stream = take("IiI")
    if magic != STATE_MAGIC:
        raise EngineError("not a llama.cpp sequence state (magic number)")
    if n_stream != 1:
        raise EngineError(f"the lab reads single-stream states (this one has {n_stream} streams)")
    (n_cells,) = take("I")
    pos = np.zeros(n_cells, np.int32)
    for i in range(n_cells):
        pos[i], n_seq = take("iI")
        off += 4 * n_seq
    v_trans, n_layer_state = take("II")
    if n_layer_state != n_layer:
        raise EngineError(f"the state holds {n_layer_state} layers, the model {n_layer}")
    if np.any(np.diff(pos) != 1):
        raise EngineError("the state's cells are not one run of consecutive positions")

    def rows(what: str) -> np.ndarray:
        nonlocal off
        out = np.zeros((n_layer, n_cells, n_embd_gqa), np.float16)
        for il in range(n_layer):
            kind, row = take("iQ")
            if kind != GGML_TYPE_F16 or row != 2 * n_embd_gqa:
                raise EngineError(f"the lab reads F16 {what} caches only")
            out[il] = np.frombuffer(state, np.float16, n_cells * n_embd_gqa, off).reshape(n_cells, n_embd_gqa)
            off += n_cells * row
        return out

    keys = rows("key")
    if not with_values:
        return pos, keys, None
    if v_trans:
        raise EngineError("the lab reads untransposed V caches only (flash attention on)")
    return pos, keys, rows("value")


class BatchQCapture(QKCapture):
    """The roped queries of every layer of one multi-token ubatch: [tokens, layer, n_head, dim] F32.

    Set `active` while the ubatch is decoded, then `take(n_tokens)`."""

    def __init__(self, n_layer: int, n_head: int, head_dim: int) -> None:
        super().__init__(n_layer, n_head, 1, head_dim)
        self._layers: dict[int, np.ndarray] = {}

    def _on_tensor(self, t: int, ask: bool, _user: int) -> bool:
        if not self.active:
            return False if ask else True
        wanted = self._wanted(t)
        if ask:
            return wanted is not None and wanted[0] == "Qcur"
        if wanted is None or wanted[0] != "Qcur":
            return True
        self._layers[wanted[1]] = tensor_floats(t, tensor_size(t)).reshape(-1, self.n_head, self.head_dim)
        return True

    def take(self, n_tokens: int) -> np.ndarray:
        """The queries of the ubatch just decoded (every layer must have been seen, for `n_tokens` tokens)."""
        if sorted(self._layers) != list(range(self.n_layer)) or any(q.shape[0] != n_tokens for q in self._layers.values()):
            raise EngineError(f"the capture saw {len(self._layers)} of {self.n_layer} layers' queries, "
                              f"not {n_tokens} tokens each")
        out = np.stack([self._layers[il] for il in range(self.n_layer)], axis=1)
        self._layers = {}
        return out
