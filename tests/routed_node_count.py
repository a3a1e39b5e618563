# Not a test: how many compute nodes the routed graph of one decode step adds per layer beyond full
# attention, by route mode, on a tiny model with the default model's head size and GQA (BENCHMARKS.md,
# "Decoding on a GPU"); .ci/gpu-check runs it. By hand: .venv/bin/python tests/routed_node_count.py
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from synth_gguf import write_tiny_qwen2  # noqa: E402
from test_gpu_ops import F16, LAYOUT_OPS, record_decode_graph  # noqa: E402

from kvlocal.routing import Route  # noqa: E402

N_LAYER = 2
ROUTES = {
    "full": Route(mode="full"),
    "geometric": Route(mode="geometric", top_k=3, region=64),  # shortlist, selection memory, pins
    "geometric (one level, no memory)": Route(mode="geometric", top_k=3, region=64, shortlist=0, keep=0.0, pin=0),
    "window": Route(mode="window", top_k=3, region=64),
    "random": Route(mode="random", top_k=3, region=64),
    # the paths a step can read its regions by (auto: in place on CUDA, gathered elsewhere)
    "geometric, gathered": Route(mode="geometric", top_k=3, region=64, attention="gather"),
    "geometric, in place": Route(mode="geometric", top_k=3, region=64, attention="in-place"),
    "window, gathered": Route(mode="window", top_k=3, region=64, attention="gather"),
    "window, in place": Route(mode="window", top_k=3, region=64, attention="in-place"),
}


def compute_nodes(nodes: list[dict]) -> list[dict]:
    return [n for n in nodes if n["op"] not in LAYOUT_OPS]


with tempfile.TemporaryDirectory() as tmp:
    # head size 128 and 6 query heads per KV head, as Qwen2.5 1.5B
    model = write_tiny_qwen2(Path(tmp) / "m.gguf", n_layer=N_LAYER, n_embd=1536, n_head=12, n_head_kv=2, n_ff=256)
    counts = {name: compute_nodes(record_decode_graph(model, F16, route)) for name, route in ROUTES.items()}
full = len(counts["full"])
print(f"compute nodes of one decode step, {N_LAYER} layers (full attention: {full})")
for name, nodes in counts.items():
    extra = (len(nodes) - full) / N_LAYER
    ops = Counter(n["op"] for n in nodes) - Counter(n["op"] for n in counts["full"])
    print(f"{name} {extra:+.1f} per layer: {dict(sorted(ops.items()))}")
