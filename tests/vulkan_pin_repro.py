import os  # a lavapipe crash reproduction (docs/experiments/lavapipe-crash.md); not a test: run it with .venv-vulkan/bin/python
import sys
sys.path.insert(0, "tests")
import numpy as np
from engine_probe import RawContext
from synth_gguf import write_tiny_qwen2
from kvlocal.engine import apply_route, llama_cpp, read_stats
from kvlocal.routing import Route
from pathlib import Path
import tempfile
d = Path(tempfile.mkdtemp())
path = write_tiny_qwen2(d / "tiny64.gguf", n_embd=128, n_head=2, n_head_kv=1, seed=3)
def toks(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 250, size=n)]
m = llama_cpp()
raw = RawContext(path, n_ctx=2048)
raw.decode(toks(1500, 0)); (m.llama_synchronize(raw.ctx) if os.environ.get("SYNC") else None); print("doc ok", flush=True)
for pin in [0, 2]:
    m.llama_memory_seq_rm(m.llama_get_memory(raw.ctx), 0, 1500, -1); raw.n_past = 1500
    route = Route(mode="geometric", top_k=2, region=64, shortlist=0, keep=0.9, pin=pin)
    apply_route(raw.ctx, route)
    raw.decode(toks(9, 7)); (m.llama_synchronize(raw.ctx) if os.environ.get("SYNC") else None); print(pin, "question ok", read_stats(raw.ctx).bytes_meta, flush=True)
    raw.decode(toks(1, 8)); (m.llama_synchronize(raw.ctx) if os.environ.get("SYNC") else None); print(pin, "step ok", read_stats(raw.ctx).regions.tolist(), flush=True)
m.llama_memory_seq_rm(m.llama_get_memory(raw.ctx), 0, 1509, -1); raw.n_past = 1509
raw.decode(toks(1, 8)); (m.llama_synchronize(raw.ctx) if os.environ.get("SYNC") else None); print("forgot ok", flush=True)
raw.close(); print("closed", flush=True)
