"""The routed decode graph keeps to what the CUDA and Metal backends implement.

No GPU is needed: a real routed decode step runs on the CPU with an eval callback that records
every node (op, types, shapes), and each node is checked against the conditions under which
ggml-cuda (`ggml_backend_cuda_device_supports_op`) and ggml-metal
(`ggml_metal_device_supports_op`) accept it in the pinned llama.cpp. The conditions are
mirrored below for the ops and types the routed graph uses; a second test checks that both
functions still name every one of those ops, so the mirror cannot silently go stale.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

from engine_probe import RawContext, ggml_base  # noqa: E402
from synth_gguf import write_tiny_olmo2_swa, write_tiny_qwen2, write_tiny_qwen35  # noqa: E402

from kvlocal.engine import apply_route, llama_cpp  # noqa: E402
from kvlocal.routing import PrefillConfig, Route  # noqa: E402

GGML_MAX_DIMS, GGML_MAX_SRC = 4, 10
F32, F16, Q8_0, I32, I64 = 0, 1, 8, 26, 27
FLOATS = {F32, F16}
# GGML_OP_UNARY nodes (ggml_op_desc names the unary op): ABS in the routed graph, the others in a
# hybrid model's recurrent layers and output gate
UNARY_OPS = {"ABS", "SIGMOID", "SILU", "SOFTPLUS"}
LAYOUT_OPS = {"NONE", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE"}  # no compute: every backend takes them


class GgmlTensor(ctypes.Structure):
    """The leading fields of struct ggml_tensor (ggml/include/ggml.h of the pinned ggml)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
    ]


def describe(lib, ptr) -> dict:
    t = GgmlTensor.from_address(ptr)
    srcs = []
    for s in t.src:
        if not s:
            break
        st = GgmlTensor.from_address(s)
        srcs.append({"type": st.type, "ne": tuple(st.ne), "contiguous": bool(lib.ggml_is_contiguous(s)),
                     "contiguous_rows": bool(lib.ggml_is_contiguous_rows(s))})
    return {
        "op": lib.ggml_op_desc(ptr).decode(),
        "name": lib.ggml_get_name(ptr).decode(),
        # where the scheduler computes it: the node's buffer ("CPU", "CUDA0", "Vulkan0", ...)
        "buffer": lib.ggml_backend_buffer_name(t.buffer).decode() if t.buffer else "",
        "type": t.type,
        "ne": tuple(t.ne),
        "src": srcs,
        # each source tensor's address and name: which nodes read the same tensor
        "src_at": [s for s in t.src if s],
        "src_names": [lib.ggml_get_name(s).decode() for s in t.src if s],
    }


def record_decode_graph(model: Path, kv_type: int, route: Route, n_doc: int = 1200, n_batch: int = 1,
                        centroid_type: int = F16, question: int = 0) -> list[dict]:
    """The nodes of a decode step (n_batch 1) or of a routed batch of n_batch tokens (a question);
    with `question` tokens read densely before the recorded step (the batch that writes the pins)."""
    lib = ggml_base()
    nodes: list[dict] = []
    state = {"on": False}
    module = llama_cpp()

    @module.ggml_backend_sched_eval_callback
    def callback(tensor, ask, user_data):  # noqa: ARG001
        if ask and state["on"]:
            nodes.append(describe(lib, tensor))
        return False

    class _Rec:
        pass

    rec = _Rec()
    rec.callback = callback
    raw = RawContext(model, n_ctx=2048, kv_type=kv_type, recorder=rec, centroid_type=centroid_type)
    try:
        raw.decode([(i * 37) % 250 for i in range(n_doc)])
        apply_route(raw.ctx, route, batch_top_k=route.top_k if n_batch > 1 and not question else 0)
        state["on"] = True
        if question:
            raw.decode([(i * 11) % 250 for i in range(question)])
        raw.decode([11 + i for i in range(n_batch)])
    finally:
        state["on"] = False
        raw.close()
    return nodes


# -- the conditions, per backend ------------------------------------------------------------------


def cuda_supports(n: dict) -> bool:
    op, s = n["op"], n["src"]
    if op in LAYOUT_OPS:
        return True
    if op == "GET_ROWS":  # src0 f16/f32/i32/q8_0 (and other quants)
        return s[0]["type"] in {F32, F16, I32, Q8_0}
    if op == "SET_ROWS":  # f32 -> f16/f32/q8_0 with i32/i64 indices
        return n["type"] in {F32, F16, Q8_0} and s[0]["type"] == F32 and s[1]["type"] in {I32, I64}
    if op in ("CPY", "CONT"):  # float <-> float, f32 <-> i32, f32 <-> q8_0
        pair = (s[0]["type"], n["type"])
        return pair in {(a, b) for a in FLOATS for b in FLOATS} | {(F32, I32), (I32, F32), (F32, Q8_0), (Q8_0, F32)}
    if op == "CONCAT":
        return s[0]["type"] == s[1]["type"] == n["type"] == F32
    if op == "TOP_K":  # without CUB (older toolkits) rows are limited to 1024
        return s[0]["ne"][0] <= 1024
    if op == "FLASH_ATTN_EXT":  # fattn.cu: head size 64/128 with equal V size, f16/q8_0 K and V, mask ne[2] == 1
        mask_ok = len(s) < 4 or s[3]["ne"][2] == 1
        return (
            s[1]["ne"][0] in (64, 128) and s[2]["ne"][0] == s[1]["ne"][0] and s[1]["type"] in {F16, Q8_0}
            and s[2]["type"] in {F16, Q8_0} and mask_ok
        )
    if op == "MUL_MAT":
        return s[1]["type"] == F32
    if op in UNARY_OPS:  # the listed unary ops over a contiguous source
        return s[0]["contiguous"]
    if op == "SUM_ROWS":  # f32
        return s[0]["type"] == F32
    if op == "SSM_CONV":  # the hybrid's recurrent layers: d_inner a multiple of the block of threads
        return s[0]["ne"][1] % 128 == 0
    if op == "CLAMP":  # f32 (the kernel's type)
        return s[0]["type"] == F32
    return op in {"ADD", "SUB", "MUL", "SCALE", "REPEAT", "ARANGE", "POOL_2D", "RMS_NORM", "ROPE", "SWIGLU", "SOFT_MAX",
                  "GATED_DELTA_NET", "FILL"}


def metal_supports(n: dict) -> bool:
    op, s = n["op"], n["src"]
    if op in LAYOUT_OPS | {"SCALE", "ARANGE", "TOP_K"}:
        return True
    if op in ("FILL", "CLAMP"):  # contiguous f32/f16 rows
        return s[0]["contiguous_rows"] and s[0]["type"] in {F32, F16}
    if op == "GET_ROWS":
        return True  # every type but NVFP4 / TQ1_0
    if op == "SET_ROWS":
        return s[0]["type"] == F32 and n["type"] in {F32, F16, Q8_0}
    if op in ("CPY", "CONT"):
        src, dst = s[0]["type"], n["type"]
        return (src == F32 and dst in {F32, F16, Q8_0, I32}) or (src in {F16, Q8_0} and dst in FLOATS) or (
            src == I32 and dst in {F32, I32}
        )
    if op == "CONCAT":
        return s[0]["type"] == s[1]["type"] == n["type"] and n["type"] in FLOATS
    if op == "POOL_2D":
        return s[0]["type"] == F32
    if op == "FLASH_ATTN_EXT":  # listed head sizes; K and V of one type among f16/q8_0/...
        return s[0]["ne"][0] in (32, 64, 128) and s[1]["type"] == s[2]["type"] and s[1]["type"] in {F16, Q8_0}
    if op == "MUL_MAT":
        return s[1]["type"] == F32
    if op in UNARY_OPS:  # contiguous f32/f16 rows
        return s[0]["contiguous_rows"] and s[0]["type"] in FLOATS
    if op == "SUM_ROWS":  # f32
        return s[0]["type"] == F32
    # the hybrid's recurrent layers need simdgroup reduction (every Apple-silicon GPU has it)
    if op == "GATED_DELTA_NET":  # and a value head size that is a multiple of 32
        return s[2]["ne"][0] % 32 == 0
    return op in {"ADD", "SUB", "MUL", "REPEAT", "RMS_NORM", "ROPE", "SWIGLU", "SOFT_MAX", "SSM_CONV"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny models by architecture, head_dim 64 like the default model (flash attention kernels exist
    for 64 and 128)."""
    root = tmp_path_factory.mktemp("gpu")
    return {
        "qwen2": write_tiny_qwen2(root / "m64.gguf", n_embd=256, n_head=4, n_head_kv=2, seed=5),
        # an iSWA model (sliding-window and full-attention layers)
        "olmo2-iswa": write_tiny_olmo2_swa(root / "iswa64.gguf", n_embd=256, n_head=4, n_head_kv=2, seed=6),
        # a hybrid model (Qwen3.5: Gated DeltaNet layers with a recurrent state, full attention every 4th)
        "qwen35-hybrid": write_tiny_qwen35(root / "hybrid64.gguf", head_dim=64, seed=8),
    }


ARCHS = ["qwen2", "olmo2-iswa", "qwen35-hybrid"]


# (KV cache type, centroid type)
TYPES = [(F16, F16), (Q8_0, F16), (F16, Q8_0)]


@pytest.mark.parametrize("n_batch", [1, 9])  # a decode step; a question read as one routed batch
@pytest.mark.parametrize("kv_type, centroid_type", TYPES)
@pytest.mark.parametrize("mode", ["geometric", "window", "random"])
@pytest.mark.parametrize("arch", ARCHS)
def test_routed_graph_nodes_are_supported_on_cuda_and_metal(models, kv_type, centroid_type, mode, arch,
                                                            n_batch):
    model = models[arch]
    nodes = record_decode_graph(model, kv_type, Route(mode=mode, top_k=3, region=64),
                                n_batch=n_batch, centroid_type=centroid_type)
    routed = [n for n in nodes if n["name"].startswith(("kv_route", "kv_cent"))]
    assert routed, "the decode step did not take the routed path"
    bad_cuda = [(n["op"], n["name"]) for n in nodes if not cuda_supports(n)]
    bad_metal = [(n["op"], n["name"]) for n in nodes if not metal_supports(n)]
    assert not bad_cuda, f"nodes CUDA would not run: {bad_cuda}"
    assert not bad_metal, f"nodes Metal would not run: {bad_metal}"


@pytest.mark.parametrize("mode", ["geometric", "window", "random"])
def test_an_in_place_step_is_supported_on_cuda_and_metal(models, mode):
    # the step that attends to the cache under a mask of its regions (the path a CUDA build takes)
    nodes = record_decode_graph(models["qwen2"], F16, Route(mode=mode, top_k=3, region=64, attention="in-place"))
    assert any(n["name"].startswith("kv_route_mask") for n in nodes), "the step did not attend in place"
    bad_cuda = [(n["op"], n["name"]) for n in nodes if not cuda_supports(n)]
    bad_metal = [(n["op"], n["name"]) for n in nodes if not metal_supports(n)]
    assert not bad_cuda, f"nodes CUDA would not run: {bad_cuda}"
    assert not bad_metal, f"nodes Metal would not run: {bad_metal}"


@pytest.mark.parametrize("attention", ["gather", "in-place"])
@pytest.mark.parametrize("arch", ["qwen2", "olmo2-iswa"])
def test_the_routed_layers_of_a_step_read_one_view_of_its_mask_row(models, arch, attention):
    # a backend other than the mask's (an RPC server, a GPU) receives a copy of every view of an input:
    # one view shared by the step's routed layers crosses once a step, not once a layer
    nodes = record_decode_graph(models[arch], F16, Route(mode="geometric", top_k=3, region=64, attention=attention))
    layers = {n["name"] for n in nodes if n["name"].startswith("kv_route_fattn")}
    reads = [n for n in nodes if n["op"] == "GET_ROWS" and n["src_names"][0].startswith("kv_route_mask_row ")]
    assert len(layers) >= 2, f"the step routed {len(layers)} layers"
    assert len(reads) == len(layers), f"{len(reads)} reads of a mask row view for {len(layers)} routed layers"
    assert len({n["src_at"][0] for n in reads}) == 1, "the routed layers read different views of the mask row"


def routed_nodes(nodes: list[dict]) -> list[dict]:
    """The nodes kvlocal's routing computes (its names; views and reshapes left out)."""
    return [n for n in nodes if n["name"].startswith(("kv_route", "kv_cent")) and n["op"] not in LAYOUT_OPS]


def backend_runs(nodes: list[dict]) -> list[tuple[str, int]]:
    """The computed nodes' buffers in the order the scheduler ran them, as (buffer, nodes) runs: one
    run per backend change, which is what a scheduler split costs (a copy and a synchronisation)."""
    runs: list[tuple[str, int]] = []
    for n in nodes:
        if n["op"] in LAYOUT_OPS or not n["buffer"]:
            continue
        if runs and runs[-1][0] == n["buffer"]:
            runs[-1] = (n["buffer"], runs[-1][1] + 1)
        else:
            runs.append((n["buffer"], 1))
    return runs


@pytest.mark.parametrize("mode", ["geometric", "window", "random"])
@pytest.mark.parametrize("arch", ARCHS)
def test_routed_nodes_run_where_their_layer_runs(models, arch, mode):
    # on a GPU build every layer is offloaded: a routed node computed elsewhere would be a scheduler
    # split back to the CPU (on a CPU build there is one backend and this holds trivially)
    nodes = record_decode_graph(models[arch], F16, Route(mode=mode, top_k=3, region=64))
    layer_buffers = {n["buffer"] for n in nodes if n["op"] == "MUL_MAT" and n["name"].startswith("Qcur")}
    assert len(layer_buffers) == 1, f"the attention layers ran on several buffers: {layer_buffers}"
    routed = routed_nodes(nodes)
    assert routed, "the decode step did not take the routed path"
    elsewhere = sorted({(n["op"], n["name"], n["buffer"]) for n in routed if n["buffer"] not in layer_buffers})
    runs = backend_runs(nodes)
    assert not elsewhere, f"routed nodes off the layers' backend {layer_buffers}: {elsewhere}; runs {runs}"


@pytest.mark.parametrize("kv_type, centroid_type", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_a_routed_prefill_ubatch_is_supported_on_cuda_and_metal(models, kv_type, centroid_type, arch):
    # a document's ubatch routed as PrefillConfig does it: many queries, causal inside the ubatch
    model = models[arch]
    route = PrefillConfig(mode="routed", top_k=3).route()
    nodes = record_decode_graph(model, kv_type, route, n_batch=128, centroid_type=centroid_type)
    assert any(n["name"].startswith("kv_route_fattn") for n in nodes), "the ubatch did not take the routed path"
    bad = [(n["op"], n["name"]) for n in nodes if not (cuda_supports(n) and metal_supports(n))]
    assert not bad, f"nodes CUDA or Metal would not run: {bad}"


@pytest.mark.parametrize("kv_type, centroid_type", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_pins_from_a_dense_question_are_supported_on_cuda_and_metal(models, kv_type, centroid_type, arch):
    # the question's dense batch that sums its attention per region, then the step that reads the pins
    model = models[arch]
    route = Route(mode="geometric", top_k=3, region=64, keep=0.9, pin=2)
    nodes = record_decode_graph(model, kv_type, route, centroid_type=centroid_type, question=9)
    assert any(n["name"].startswith("kv_route_pin_mass") for n in nodes), "the question wrote no pins"
    assert any(n["name"].startswith("kv_route_pins") for n in nodes), "the step read no pins"
    # with pin 2 of top-3 the step also chooses one region among the others, the pinned ones masked out
    assert any(n["name"].startswith("kv_route_kept") and n["op"] == "SET_ROWS" for n in nodes)
    bad = [(n["op"], n["name"]) for n in nodes if not (cuda_supports(n) and metal_supports(n))]
    assert not bad, f"nodes CUDA or Metal would not run: {bad}"


@pytest.mark.parametrize("pin", [0, 2])  # the followed choices: by kept score; the pins
@pytest.mark.parametrize("kv_type, centroid_type", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_following_the_first_choices_is_supported_on_cuda_and_metal(models, kv_type, centroid_type, arch, pin):
    model = models[arch]
    route = Route(mode="geometric", top_k=3, region=64, keep=0.9, pin=pin, follow=1)
    nodes = record_decode_graph(model, kv_type, route, centroid_type=centroid_type, question=9)
    assert any(n["name"].startswith("kv_route_follow") for n in nodes), "the step followed no choice"
    bad = [(n["op"], n["name"]) for n in nodes if not (cuda_supports(n) and metal_supports(n))]
    assert not bad, f"nodes CUDA or Metal would not run: {bad}"


def test_top_k_rows_stay_within_the_cuda_limit_at_the_trained_context():
    # top_k scores one row of regions per KV head: 32,768 tokens / 64 = 512 regions <= 1024
    assert 32768 // Route().region <= 1024


def _vendored_ggml() -> Path | None:
    root = Path(__file__).resolve().parent.parent / "vendor" / "src"
    # the unpacked sdist, or an engine pack (vendor/build_engine.py --from-pack)
    hits = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp/ggml/src")) + sorted(
        root.glob("kvlocal-engine-*/vendor/llama.cpp/ggml/src"))
    return hits[0] if hits else None


@pytest.mark.skipif(_vendored_ggml() is None, reason="the engine sources are not unpacked (vendor/build_engine.py)")
def test_backends_still_list_the_ops_we_use():
    src = _vendored_ggml()
    used = {"GET_ROWS", "SET_ROWS", "CPY", "CONT", "CONCAT", "TOP_K", "FLASH_ATTN_EXT", "MUL_MAT", "ADD", "SUB", "SCALE",
            "REPEAT", "ARANGE", "POOL_2D", "SOFT_MAX", "UNARY", "SUM_ROWS", "SSM_CONV", "GATED_DELTA_NET", "CLAMP"}
    for path, fn in [
        (src / "ggml-cuda" / "ggml-cuda.cu", "ggml_backend_cuda_device_supports_op"),
        (src / "ggml-metal" / "ggml-metal-device.m", "ggml_metal_device_supports_op"),
    ]:
        text = path.read_text()
        body = text[text.index(f"bool {fn}(") :]
        body = body[: body.index("\n}\n")]
        listed = set(re.findall(r"case GGML_OP_([A-Z0-9_]+):", body))
        assert used <= listed, f"{path.name}: {sorted(used - listed)} no longer listed in {fn}"
