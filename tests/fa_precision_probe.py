"""How far dense and routed decoding move the logits of a sharp-attention model, against attention
without flash attention (the reference). Run by hand: `python tests/fa_precision_probe.py`.

It explains the tolerance of test_routing.py's iSWA oracle: the CPU flash-attention kernel
accumulates V in F16, and how many rows one accumulator sums depends on how the call is split
over threads (dense decode takes the split-KV path; the routed call, with KV heads on dim 3, does
not).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_probe import RawContext  # noqa: E402
from synth_gguf import write_tiny_olmo2_swa  # noqa: E402
from test_routing import N_DOC, decode_steps, doc_tokens  # noqa: E402

from kvlocal.engine import llama_cpp  # noqa: E402
from kvlocal.routing import Route  # noqa: E402


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x[0] - y[0]))) for x, y in zip(a, b))


def main() -> None:
    m = llama_cpp()
    steps = doc_tokens(8, seed=2)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_olmo2_swa(Path(tmp) / "iswa.gguf", seed=5)
        enabled = m.LLAMA_FLASH_ATTN_TYPE_ENABLED
        m.LLAMA_FLASH_ATTN_TYPE_ENABLED = m.LLAMA_FLASH_ATTN_TYPE_DISABLED  # RawContext reads it
        try:
            raw = RawContext(model, n_ctx=2048)
        finally:
            m.LLAMA_FLASH_ATTN_TYPE_ENABLED = enabled
        raw.decode(doc_tokens(N_DOC))
        reference = decode_steps(raw, N_DOC, steps, Route(mode="full"))
        raw.close()
        for threads in (2, 1):
            raw = RawContext(model, n_ctx=2048)
            m.llama_set_n_threads(raw.ctx, threads, threads)
            raw.decode(doc_tokens(N_DOC))
            dense = decode_steps(raw, N_DOC, steps, Route(mode="full"))
            routed = decode_steps(raw, N_DOC, steps, Route(mode="geometric", top_k=1000, region=64))
            raw.close()
            print(f"{threads} thread(s): max |logit diff| vs no flash attention: "
                  f"dense {max_diff(dense, reference):.2e}, routed (every region) {max_diff(routed, reference):.2e}")


if __name__ == "__main__":
    main()
