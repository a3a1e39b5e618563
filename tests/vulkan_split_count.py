# Not a test: where the default model's pin-writing question graph and the routed step after it ran, node by
# node (BENCHMARKS.md section 8). Run with GGML_VK_VISIBLE_DEVICES=0 .venv-vulkan/bin/python tests/vulkan_split_count.py
# (about 7 minutes on 2 cores through lavapipe, most of it the 640-token prefill).
import sys
from collections import Counter

sys.path.insert(0, "tests")
from test_gpu_ops import F16, LAYOUT_OPS, backend_runs, record_decode_graph  # noqa: E402

from kvlocal.models import DEFAULT_ALIAS, model_path  # noqa: E402
from kvlocal.routing import RouteConfig  # noqa: E402

route = RouteConfig(mode="geometric", top_k=2, region=64, keep=0.9, pin=2)
nodes = record_decode_graph(model_path(DEFAULT_ALIAS), F16, route, n_doc=640, question=9)
routed = [n for n in nodes if n["name"].startswith(("kv_route", "kv_cent"))]
print(f"{len(nodes)} nodes by buffer: {dict(Counter(n['buffer'] for n in nodes))}")
print(f"routed nodes by buffer: {dict(Counter(n['buffer'] for n in routed))}")
print(f"backend runs (a change of backend is a split): {backend_runs(nodes)}")
print("computed off Vulkan0:", [(n["op"], n["name"]) for n in nodes
                                if n["op"] not in LAYOUT_OPS and n["buffer"] and n["buffer"] != "Vulkan0"])
