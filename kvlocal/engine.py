"""The patched llama.cpp engine: import it, tell a patched build from a stock one, bind our C API,
and `EngineContext`, the one interface to a model and its context.

This is the only module that imports llama_cpp or calls the C API (llama_*, ggml_*): decoding, the
KV memory of every sequence (state, removal, copy, shift), the route settings and read statistics,
logits and token pieces, and the lab's graph callbacks. The session, the library, the routing
settings and the lab call methods here; tests/test_engine_boundary.py keeps it so.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import importlib.metadata
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from kvlocal.errors import EngineError, UsageError
from kvlocal.ggml_types import TYPE_IDS as KV_TYPES
from kvlocal.gguf_header import validate_gguf
from kvlocal.patchset import repo_patchset_id
from kvlocal.routing import ATTENTION_CODES, ReadStats, Route, RouteMode

ENGINE_VERSION = "0.3.36"
BUILD_HINT = "build it with: python vendor/build_engine.py"

# A failed GGML_ASSERT aborts the process; before that, ggml forks gdb (or lldb) to print a backtrace of
# every frame, which takes seconds and floods the terminal. ggml skips it when GGML_NO_BACKTRACE is set
# (read at the abort, and when the library loads for its std::terminate hook): set it before llama_cpp is
# imported (any value counts, so a backtrace is had by running under gdb instead).
os.environ.setdefault("GGML_NO_BACKTRACE", "1")


@dataclass(frozen=True)
class EngineInfo:
    version: str | None
    build_id: str | None  # "kvlocal:<patch-set id>" or None for a stock build
    repo_patchset: str | None
    gpu_offload: bool
    system_info: str

    @property
    def patched(self) -> bool:
        return self.build_id is not None and self.build_id.startswith("kvlocal:")

    @property
    def patchset(self) -> str | None:
        return self.build_id.split(":", 1)[1] if self.patched else None

    @property
    def current(self) -> bool:
        """The engine was built from this checkout's patches (or there is no checkout to compare)."""
        return self.patched and (self.repo_patchset is None or self.patchset == self.repo_patchset)


def default_threads() -> int:
    """Every core this process may run on (a container's or taskset's share, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@functools.cache
def llama_cpp() -> ModuleType:
    """Import llama_cpp quietly; EngineError if it is missing."""
    try:
        import llama_cpp as module
    except ImportError as err:
        raise EngineError(f"llama-cpp-python is not installed ({err}); {BUILD_HINT}") from None
    _silence_logs(module)
    return module


_LOG_CALLBACK = None


def _silence_logs(module: ModuleType) -> None:
    """Route llama.cpp's log lines away from the terminal (errors still reach our messages)."""
    global _LOG_CALLBACK

    @module.llama_log_callback
    def _drop(level, text, user_data):  # noqa: ARG001
        return None

    _LOG_CALLBACK = _drop  # keep a reference: llama.cpp holds the pointer
    module.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def engine_info() -> EngineInfo:
    module = llama_cpp()
    lib = module.llama_cpp._lib
    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        version = getattr(module, "__version__", None)
    build_id = None
    if hasattr(lib, "llama_kvlocal_build_id"):
        fn = lib.llama_kvlocal_build_id
        fn.restype = ctypes.c_char_p
        fn.argtypes = []
        build_id = fn().decode()
    return EngineInfo(
        version=version,
        build_id=build_id,
        repo_patchset=repo_patchset_id(),
        gpu_offload=local_gpu(),
        system_info=module.llama_print_system_info().decode(errors="replace").strip(),
    )


def require_patched() -> EngineInfo:
    """The engine info, or EngineError when the installed engine is stock or out of date."""
    info = engine_info()
    if not info.patched:
        raise EngineError(f"the installed llama-cpp-python is a stock build without kvlocal's patches; {BUILD_HINT}")
    if not info.current:
        raise EngineError(
            f"the installed engine was built from patch set {info.patchset}, "
            f"but patches/ is now {info.repo_patchset}; {BUILD_HINT}"
        )
    return info


class RouteParamsC(ctypes.Structure):
    """Mirror of struct llama_kv_route_params (the patched include/llama.h; checked against it by
    tests/test_engine_header.py)."""

    _fields_ = [
        ("mode", ctypes.c_int),  # enum llama_kv_route_mode
        ("region_size", ctypes.c_int32),
        ("top_k", ctypes.c_int32),
        ("n_window", ctypes.c_int32),
        ("n_sink", ctypes.c_int32),
        ("seed", ctypes.c_uint32),
        ("n_shortlist", ctypes.c_int32),
        ("keep", ctypes.c_float),
        ("top_k_batch", ctypes.c_int32),
        ("n_pin", ctypes.c_int32),
        ("n_follow", ctypes.c_int32),
        ("attn", ctypes.c_int),  # enum llama_kv_route_attn
    ]


# the rows and bytes a ubatch (or one sequence of it) read, as llama_kv_route_stats and
# llama_kv_route_seq_stats end
_READ_COUNTS = [
    ("rows_read", ctypes.c_int64),
    ("rows_dense", ctypes.c_int64),
    ("bytes_kv", ctypes.c_int64),
    ("bytes_meta", ctypes.c_int64),
    ("bytes_dense", ctypes.c_int64),
]


class RouteStatsC(ctypes.Structure):
    """Mirror of struct llama_kv_route_stats (the patched include/llama.h; checked against it by
    tests/test_engine_header.py)."""

    _fields_ = [
        ("mode", ctypes.c_int),  # enum llama_kv_route_mode
        ("fallback", ctypes.c_int),  # enum llama_kv_route_fallback
        ("n_layer", ctypes.c_int32),
        ("n_layer_routed", ctypes.c_int32),
        ("n_head_kv", ctypes.c_int32),
        ("n_kv", ctypes.c_int32),
        ("region_size", ctypes.c_int32),
        ("n_sel", ctypes.c_int32),
        *_READ_COUNTS,
    ]


class RouteSeqStatsC(ctypes.Structure):
    """Mirror of struct llama_kv_route_seq_stats (the patched include/llama.h; checked against it by
    tests/test_engine_header.py): what one sequence of a multi-sequence decode ubatch read."""

    _fields_ = [
        ("seq_id", ctypes.c_int32),
        ("n_sel", ctypes.c_int32),
        *_READ_COUNTS,
    ]


def _lib_beside_llama(name: str) -> ctypes.CDLL:
    """The ggml library `name` ("ggml-base", "ggml") that the loaded libllama sits beside."""
    lib_dir = Path(llama_cpp().llama_cpp._lib._name).parent
    found = sorted(lib_dir.glob(f"lib{name}.so*")) + sorted(lib_dir.glob(f"lib{name}.dylib")) + sorted(
        lib_dir.glob(f"{name}.dll"))
    if not found:
        raise EngineError(f"lib{name} not found beside {lib_dir}")
    return ctypes.CDLL(str(found[0]))


@functools.cache
def ggml_lib() -> ctypes.CDLL:
    """libggml-base beside the loaded libllama, with the tensor accessors that eval callbacks use."""
    lib = _lib_beside_llama("ggml-base")
    for name, argtypes, restype in (
        ("ggml_get_name", [ctypes.c_void_p], ctypes.c_char_p),
        ("ggml_op_desc", [ctypes.c_void_p], ctypes.c_char_p),
        ("ggml_type_name", [ctypes.c_int], ctypes.c_char_p),
        ("ggml_nelements", [ctypes.c_void_p], ctypes.c_int64),
        ("ggml_backend_tensor_get", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t], None),
        ("ggml_backend_buffer_name", [ctypes.c_void_p], ctypes.c_char_p),
        ("ggml_is_contiguous", [ctypes.c_void_p], ctypes.c_bool),
        ("ggml_is_contiguous_rows", [ctypes.c_void_p], ctypes.c_bool),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


@dataclass(frozen=True)
class BackendDevice:
    name: str  # "CPU", "Vulkan0", "CUDA0", "MTL0"
    description: str  # e.g. the GPU's name
    kind: str  # "cpu", "gpu", "igpu", "accel"
    memory_total: int  # bytes (0 where the backend does not say)


DEVICE_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}  # enum ggml_backend_dev_type


@functools.cache
def _ggml_devices_lib() -> ctypes.CDLL:
    """libggml (the backend registry) beside the loaded libllama, with the device accessors set."""
    lib = _lib_beside_llama("ggml")
    for name, argtypes, restype in (
        ("ggml_backend_dev_count", [], ctypes.c_size_t),
        ("ggml_backend_dev_get", [ctypes.c_size_t], ctypes.c_void_p),
        ("ggml_backend_dev_name", [ctypes.c_void_p], ctypes.c_char_p),
        ("ggml_backend_dev_description", [ctypes.c_void_p], ctypes.c_char_p),
        ("ggml_backend_dev_type", [ctypes.c_void_p], ctypes.c_int),
        ("ggml_backend_dev_memory", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                     ctypes.POINTER(ctypes.c_size_t)], None),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def _device_name(dev: int) -> str:
    return _ggml_devices_lib().ggml_backend_dev_name(dev).decode(errors="replace")


def _device_description(dev: int) -> str:
    return _ggml_devices_lib().ggml_backend_dev_description(dev).decode(errors="replace").strip()


def backend_devices() -> list[BackendDevice]:
    """The devices the engine's backends registered (ggml_backend_dev_*), in ggml's order: the ones
    llama.cpp offloads layers to come first, the CPU last."""
    lib = _ggml_devices_lib()
    devices = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        devices.append(BackendDevice(
            name=_device_name(dev),
            description=_device_description(dev),
            kind=DEVICE_KINDS.get(lib.ggml_backend_dev_type(dev), "other"),
            memory_total=int(total.value),
        ))
    return devices


def local_gpu() -> bool:
    """This machine has a GPU the engine offloads to (llama_supports_gpu_offload also says yes for an
    engine with the RPC backend, whose servers are no GPU of this machine's)."""
    return any(dev.kind in ("gpu", "igpu") for dev in backend_devices())


@functools.cache
def route_api() -> ctypes.CDLL:
    """The routing functions of the loaded library, with their signatures set."""
    lib = llama_cpp().llama_cpp._lib
    if not hasattr(lib, "llama_kv_route_set"):
        raise EngineError(f"the installed engine has no routed attention; {BUILD_HINT}")
    ctx_p = ctypes.c_void_p
    lib.llama_kv_route_default_params.argtypes = []
    lib.llama_kv_route_default_params.restype = RouteParamsC
    lib.llama_kv_route_set.argtypes = [ctx_p, RouteParamsC]
    lib.llama_kv_route_set.restype = ctypes.c_int32
    lib.llama_kv_route_cent_blk.argtypes = [ctx_p]
    lib.llama_kv_route_cent_blk.restype = ctypes.c_int32
    lib.llama_kv_route_get_stats.argtypes = [ctx_p, ctypes.POINTER(RouteStatsC)]
    lib.llama_kv_route_get_stats.restype = ctypes.c_int32
    lib.llama_kv_route_set_hints.argtypes = [ctx_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]
    lib.llama_kv_route_set_hints.restype = ctypes.c_int32
    lib.llama_kv_route_set_hints_seq.argtypes = [ctx_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]
    lib.llama_kv_route_set_hints_seq.restype = ctypes.c_int32
    lib.llama_kv_route_set_seq_cells.argtypes = [ctx_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
    lib.llama_kv_route_set_seq_cells.restype = ctypes.c_int32
    lib.llama_kv_route_seq_share_cells.argtypes = [ctx_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
    lib.llama_kv_route_seq_share_cells.restype = ctypes.c_int32
    for name in ("llama_kv_route_set_layer_top_k", "llama_kv_route_get_regions", "llama_kv_route_get_layers"):
        fn = getattr(lib, name)
        fn.argtypes = [ctx_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]
        fn.restype = ctypes.c_int32
    lib.llama_kv_route_get_n_seq.argtypes = [ctx_p]
    lib.llama_kv_route_get_n_seq.restype = ctypes.c_int32
    lib.llama_kv_route_get_seq_stats.argtypes = [ctx_p, ctypes.c_int32, ctypes.POINTER(RouteSeqStatsC)]
    lib.llama_kv_route_get_seq_stats.restype = ctypes.c_int32
    lib.llama_kv_route_get_seq_regions.argtypes = [ctx_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]
    lib.llama_kv_route_get_seq_regions.restype = ctypes.c_int32
    return lib


QUANT_TYPES = {"q4_k_m": 15, "q8_0": 7, "f16": 1}  # enum llama_ftype: LLAMA_FTYPE_MOSTLY_<name>


def quantize_model(src: str | os.PathLike[str], dst: str | os.PathLike[str], quant: str = "q4_k_m",
                   threads: int = 0) -> None:
    """Write `src` (a GGUF) to `dst` quantized to `quant` with llama.cpp's own llama_model_quantize;
    EngineError when the engine refuses. `threads` 0: all cores."""
    module = llama_cpp()
    if quant not in QUANT_TYPES:
        raise EngineError(f"unknown quantization {quant!r}; choose one of {', '.join(QUANT_TYPES)}")
    params = module.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[quant]
    params.nthread = threads
    status = module.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params))
    if status != 0:
        raise EngineError(f"llama_model_quantize could not write {dst} ({quant}): status {status}")


def greedy_loop_seconds(ctx: ctypes.c_void_p, first_token: int, n_tokens: int) -> tuple[int, float]:
    """llama.cpp's own decoding as the bindings' plainest loop: one llama_decode of one token and one
    greedy sample in the engine's sampler per step, nothing else, continuing sequence 0 where it ends.
    Returns (tokens decoded, seconds). The reference that kvlocal's own decode loop is held against."""
    import time

    module = llama_cpp()
    sampler = module.llama_sampler_init_greedy()
    token = (ctypes.c_int32 * 1)(first_token)
    decoded = 0
    try:
        start = time.perf_counter()
        for _ in range(n_tokens):
            if module.llama_decode(ctx, module.llama_batch_get_one(token, 1)) != 0:
                break
            token[0] = module.llama_sampler_sample(sampler, ctx, -1)
            decoded += 1
        return decoded, time.perf_counter() - start
    finally:
        module.llama_sampler_free(sampler)


# -- routing on a context -------------------------------------------------------------------------
# These take a raw `llama_context *`: EngineContext calls them on its own, and the tests' probes
# (tests/engine_probe.py) on contexts they made with the C API.

def apply_route(ctx: ctypes.c_void_p, route: Route, *, batch_top_k: int = 0) -> None:
    """Set the context's routing to `route` (kvlocal.routing.resolve_route). A batch of several tokens
    routes to `batch_top_k` regions, or reads densely with 0 (the default, so a document's prefill stays
    dense). An automatic shortlist (a route resolved without a document, as the prefill's and the
    tests' probes are) is taken for what the context holds now."""
    module = llama_cpp()
    n_cells = module.llama_memory_seq_pos_max(module.llama_get_memory(ctx), 0) + 1
    api = route_api()
    params = api.llama_kv_route_default_params()
    params.mode = int(route.route_mode)
    params.region_size = route.region
    params.top_k = route.top_k
    params.n_window = route.window
    params.n_sink = route.sinks
    params.seed = route.seed & 0xFFFFFFFF
    params.n_shortlist = route.shortlist_at(max(0, n_cells))
    params.keep = route.keep
    params.top_k_batch = batch_top_k
    params.n_pin = route.pins
    params.n_follow = route.follows
    params.attn = int(ATTENTION_CODES[route.attention])
    if api.llama_kv_route_set(ctx, params) != 0:
        blk = api.llama_kv_route_cent_blk(ctx)
        raise UsageError(f"the engine rejected the routing settings {route} (centroid block {blk})")
    budgets = route.layer_budgets(module.llama_model_n_layer(module.llama_get_model(ctx)))
    array = (ctypes.c_int32 * len(budgets))(*budgets)
    if api.llama_kv_route_set_layer_top_k(ctx, array, len(budgets)) != 0:
        raise UsageError(f"the engine rejected the budgets per layer {route.layer_top_k!r}", setting="layer_top_k")


def read_stats(ctx: ctypes.c_void_p, *, with_regions: bool = True) -> ReadStats | None:
    """The statistics of the context's last ubatch (a decode step, or a batch read at once), or None
    before the first one. A ubatch of one step of each of several sequences counts every sequence
    in the totals and each one on its own in `sequences` (by sequence id), with the regions it read."""
    api = route_api()
    raw = RouteStatsC()
    if api.llama_kv_route_get_stats(ctx, ctypes.byref(raw)) != 0:
        return None
    stats = ReadStats(
        mode=RouteMode(raw.mode), **{name: getattr(raw, name) for name, _ in RouteStatsC._fields_ if name != "mode"}
    )
    n_seq = api.llama_kv_route_get_n_seq(ctx)
    if n_seq:
        stats.sequences = _sequence_stats(ctx, stats, n_seq, with_regions=with_regions)
    elif with_regions and raw.n_layer_routed:
        n = api.llama_kv_route_get_regions(ctx, None, 0)
        regions = np.zeros(n, np.int32)
        api.llama_kv_route_get_regions(ctx, regions.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n)
        stats.layers = _routed_layers(ctx, raw.n_layer_routed)
        stats.regions = regions.reshape(raw.n_layer_routed, raw.n_head_kv, raw.n_sel)
    return stats


def _routed_layers(ctx: ctypes.c_void_p, n_layer_routed: int) -> np.ndarray:
    layers = np.zeros(n_layer_routed, np.int32)
    route_api().llama_kv_route_get_layers(ctx, layers.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), len(layers))
    return layers


def _sequence_stats(ctx: ctypes.c_void_p, total: ReadStats, n_seq: int, *, with_regions: bool) -> dict[int, ReadStats]:
    """What each sequence of a multi-sequence decode ubatch read, by sequence id: the ubatch's
    geometry with the sequence's own counts and regions ([layer, head, its n_sel], -1 padded)."""
    api = route_api()
    layers = _routed_layers(ctx, total.n_layer_routed) if with_regions else None
    out = {}
    for i in range(n_seq):
        raw = RouteSeqStatsC()
        if api.llama_kv_route_get_seq_stats(ctx, i, ctypes.byref(raw)) != 0:
            raise EngineError(f"the engine has no statistics of sequence {i} of {n_seq}")
        own = {name: getattr(raw, name) for name, _ in RouteSeqStatsC._fields_ if name != "seq_id"}
        seq = dataclasses.replace(total, **own, sequences={})
        if layers is not None:
            n = api.llama_kv_route_get_seq_regions(ctx, i, None, 0)
            regions = np.zeros(n, np.int32)
            api.llama_kv_route_get_seq_regions(ctx, i, regions.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n)
            seq.layers = layers
            seq.regions = regions.reshape(total.n_layer_routed, total.n_head_kv, raw.n_sel)
        out[raw.seq_id] = seq
    return out


@dataclass(frozen=True)
class SequenceStep:
    """One token decoded into sequence `seq` at position `pos` (a step of a multi-sequence batch)."""

    seq: int
    token: int
    pos: int


def decode_batch(ctx: ctypes.c_void_p, steps: Sequence[SequenceStep], *, logits: Sequence[bool]) -> None:
    """Decode `steps` in one llama_batch (llama_decode splits it into ubatches of the context's
    n_ubatch), with logits for the steps where `logits` is true."""
    module = llama_cpp()
    batch = module.llama_batch_init(len(steps), 0, 1)
    try:
        batch.n_tokens = len(steps)
        for i, (step, want) in enumerate(zip(steps, logits, strict=True)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = step.token, step.pos, 1, want
            batch.seq_id[i][0] = step.seq
        status = module.llama_decode(ctx, batch)
    finally:
        module.llama_batch_free(batch)
    if status != 0:
        raise EngineError(f"llama_decode failed ({status}) on a batch of {len(steps)} tokens")


# -- one model and its context ----------------------------------------------------------------------

_SEQUENCES_LOCK = threading.Lock()


@contextlib.contextmanager
def _llama_params(n_seq_max: int, devices: Sequence[int] | None) -> Iterator[None]:
    """While a Llama is built: its context parameters ask for `n_seq_max` sequences in one unified KV
    cache, and its model parameters name the `devices` its offloaded layers go to (None: llama.cpp's
    choice). llama-cpp-python's Llama takes neither; it reads llama_context_default_params and
    llama_model_default_params when built."""
    if n_seq_max <= 1 and devices is None:
        yield
        return
    bindings = llama_cpp().llama_cpp  # what llama_cpp.llama.Llama calls
    device_list = None if devices is None else (ctypes.c_void_p * (len(devices) + 1))(*devices, None)

    with _SEQUENCES_LOCK:
        context_defaults, model_defaults = bindings.llama_context_default_params, bindings.llama_model_default_params

        def with_sequences():
            params = context_defaults()
            if n_seq_max > 1:
                params.n_seq_max = n_seq_max
                params.kv_unified = True
            return params

        def with_devices():
            params = model_defaults()
            if device_list is not None:
                params.devices = ctypes.cast(device_list, ctypes.c_void_p)
            return params

        bindings.llama_context_default_params, bindings.llama_model_default_params = with_sequences, with_devices
        try:
            yield
        finally:
            bindings.llama_context_default_params, bindings.llama_model_default_params = context_defaults, model_defaults


_LAYER_LINE = re.compile(r"layer\s+(\d+) assigned to device (\S+?),")


@contextlib.contextmanager
def _layer_log(found: dict[int, str]) -> Iterator[None]:
    """While a model loads: the device llama.cpp assigns each layer to, from its own log lines
    (`load_tensors: layer N assigned to device D`; layer n_layer is the output layer)."""
    module = llama_cpp()

    @module.llama_log_callback
    def _keep(level, text, user_data):  # noqa: ARG001
        match = _LAYER_LINE.search(text.decode(errors="replace")) if text else None
        if match:
            found[int(match.group(1))] = match.group(2)

    module.llama_log_set(_keep, ctypes.c_void_p(0))
    try:
        yield
    finally:
        module.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


# -- llama.cpp's RPC backend (kvlocal.rpc probes the servers before they get here) ------------------

def rpc_server_binary() -> Path:
    """llama.cpp's ggml-rpc-server, built with this engine and installed beside its libraries."""
    lib_dir = Path(llama_cpp().llama_cpp._lib._name).parent
    path = lib_dir / ("ggml-rpc-server.exe" if os.name == "nt" else "ggml-rpc-server")
    if not path.is_file():
        raise EngineError(f"this engine was built without llama.cpp's RPC server ({path} is missing); {BUILD_HINT}")
    return path


@functools.cache
def _rpc_lib() -> ctypes.CDLL:
    """libggml with the backend registry's calls that reach the RPC backend."""
    lib = _ggml_devices_lib()
    for name, argtypes, restype in (
        ("ggml_backend_reg_by_name", [ctypes.c_char_p], ctypes.c_void_p),
        ("ggml_backend_reg_get_proc_address", [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p),
        ("ggml_backend_reg_dev_count", [ctypes.c_void_p], ctypes.c_size_t),
        ("ggml_backend_reg_dev_get", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p),
        ("ggml_set_abort_callback", [ctypes.c_void_p], ctypes.c_void_p),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def rpc_devices(endpoints: Sequence[str]) -> list[int]:
    """The devices of the RPC servers at `endpoints` ("host:port"), in order, as llama.cpp's
    --rpc adds them (ggml_backend_rpc_add_server through the RPC backend's proc address). They are not
    registered globally: only a context opened with them uses them."""
    lib = _rpc_lib()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise EngineError(f"this engine was built without llama.cpp's RPC backend (GGML_RPC); {BUILD_HINT}")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(
        lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server"))
    devices = []
    for endpoint in endpoints:
        server = add_server(endpoint.encode())
        if not server:
            raise EngineError(f"RPC server {endpoint} offers no devices")
        devices += [lib.ggml_backend_reg_dev_get(server, i) for i in range(lib.ggml_backend_reg_dev_count(server))]
    return devices


def layer_plan(n_layer: int, shares: Sequence[float]) -> tuple[int, list[float]]:
    """llama.cpp's n_gpu_layers and tensor_split that give this machine and each RPC server its share
    (`shares`: this machine's, then each server's) of a model's layers. llama.cpp splits the N layers
    and the output layer (N + 1 places): the first n_layer + 1 - n_gpu_layers stay on the CPU here,
    the rest go to the devices in tensor_split's proportions, in order."""
    places = n_layer + 1
    local = round(places * shares[0] / sum(shares))
    return places - local, list(shares[1:])


_ABORT_CALLBACK = None


def exit_on_engine_abort(message: Callable[[str], str]) -> None:
    """From now on a fatal engine error (GGML_ABORT: e.g. an RPC server that stopped answering in the
    middle of a step, which ggml cannot recover from) prints `message(ggml's text)` as one line on
    stderr and ends the process with exit status 1, instead of SIGABRT and a core dump. Nothing of
    kvlocal's is half-written then: its cache writes are atomic."""
    global _ABORT_CALLBACK

    @ctypes.CFUNCTYPE(None, ctypes.c_char_p)
    def on_abort(text):
        detail = (text or b"").decode(errors="replace").strip().split(": ", 1)[-1]  # drop ggml's file:line
        os.write(2, (message(detail).replace("\n", " ") + "\n").encode())
        os._exit(1)

    _ABORT_CALLBACK = on_abort  # keep a reference: ggml holds the pointer
    _rpc_lib().ggml_set_abort_callback(ctypes.cast(on_abort, ctypes.c_void_p))


class EngineContext:
    """A model and its llama.cpp context (a llama-cpp-python Llama), and the one interface to them:
    tokens in and out, decoding, the KV memory of each sequence, routing and its statistics.

    Mutation goes through here alone, in the spirit of llama.cpp's llama_memory_i: `decode` appends
    to sequence 0 at `n_tokens` (the next position); `clear`, `truncate`, `remove_positions`,
    `copy_sequence`, `shift_sequence` and `load_state` change the memory, and `continue_at` /
    `mark_tokens` set where the next decode goes and which tokens the cells hold. A context opened
    `vocab_only` has the vocabulary and the model's header but no weights: it tokenizes."""

    def __init__(self, llm, centroid_type: str) -> None:
        self._llm = llm
        self.centroid_type = centroid_type  # the type its KV cache keeps the key centroids in
        self._vocab = llama_cpp().llama_model_get_vocab(llm.model)
        self.layer_devices: list[str] = []  # the device of each layer, then the output layer's (llama.cpp's names)
        self.device_labels: dict[str, str] = {}  # a device's name -> where it is ("this machine", host:port)

    @classmethod
    def open(cls, model_path: Path, *, n_batch: int, threads: int, kv_type: str, centroid_block: int,
             centroid_type: str, vocab_only: bool = False, n_ctx: int = 512, n_seq_max: int = 1,
             rpc_servers: Sequence[str] = (), rpc_shares: Sequence[float] = ()) -> EngineContext:
        """Load the model at `model_path` with a context of `n_ctx` cells; with `n_seq_max` > 1 the context
        holds that many sequences in one unified KV cache (one stream: copying a sequence shares its
        cells), which Llama's constructor cannot ask for. With `rpc_servers` ("host:port", kvlocal.rpc
        probes them first) the model's layers and their KV cache are split over this machine and those
        servers by `rpc_shares` (this machine's first: layer_plan)."""
        module = llama_cpp()
        devices, split = None, {"n_gpu_layers": -1 if local_gpu() else 0}
        if rpc_servers and not vocab_only:
            devices = rpc_devices(rpc_servers)
            n_gpu_layers, shares = layer_plan(validate_gguf(model_path).n_layer or 0, rpc_shares)
            split = {"n_gpu_layers": n_gpu_layers, "tensor_split": shares}
        layers: dict[int, str] = {}
        with _llama_params(n_seq_max, devices), _layer_log(layers):
            try:
                llm = module.Llama(
                    model_path=str(model_path),
                    vocab_only=vocab_only,
                    n_ctx=n_ctx,
                    n_batch=n_batch,
                    n_ubatch=n_batch,
                    n_threads=threads,
                    n_threads_batch=threads,
                    **split,
                    flash_attn=True,  # routed decoding needs the non-transposed V cache
                    type_k=KV_TYPES[kv_type],
                    type_v=KV_TYPES[kv_type],
                    kv_centroid_block=centroid_block,  # fixed for the context's KV cache
                    kv_centroid_type=KV_TYPES[centroid_type],  # and its type
                    verbose=False,
                )
            except (ValueError, RuntimeError) as err:
                raise EngineError(f"llama.cpp could not load {model_path.name}: {err}") from None
        context = cls(llm, centroid_type)
        context.layer_devices = [layers[i] for i in sorted(layers)]
        context.device_labels = {"CPU": "this machine"} | {
            _device_name(dev): _device_description(dev) for dev in (devices or [])}
        return context

    def close(self) -> None:
        """Free the model and its context now (an RPC server's buffers and connection with them)."""
        self._llm.close()

    # -- the model ------------------------------------------------------------------------

    @property
    def metadata(self) -> dict[str, str]:
        """The model file's GGUF metadata."""
        return self._llm.metadata

    @property
    def recurrent(self) -> bool:
        """The model keeps recurrent memory (a state per sequence, not per cell)."""
        return bool(llama_cpp().llama_model_is_recurrent(self._llm.model))

    @property
    def hybrid(self) -> bool:
        """The model has recurrent and attention layers."""
        return bool(llama_cpp().llama_model_is_hybrid(self._llm.model))

    @property
    def n_swa(self) -> int:
        """The sliding window of the model's sliding-window layers (0: none, or a vocabulary-only context)."""
        return int(llama_cpp().llama_model_n_swa(self._llm.model))

    @property
    def n_vocab(self) -> int:
        return self._llm.n_vocab()

    @property
    def n_ctx(self) -> int:
        """Cells the context holds."""
        return self._llm.n_ctx()

    @property
    def raw_context(self) -> ctypes.c_void_p:
        """The `llama_context *`, for tests that drive the C API themselves (kvlocal calls the methods)."""
        return self._llm.ctx

    @property
    def raw_model(self) -> ctypes.c_void_p:
        """The `llama_model *`, for tests that drive the C API themselves."""
        return self._llm.model

    # -- tokens ---------------------------------------------------------------------------

    def tokenize(self, text: str, *, bos: bool, special: bool = False) -> list[int]:
        """Token ids of `text`; control-token spellings in it stay plain text unless `special`."""
        return self._llm.tokenize(text.encode(), add_bos=bos, special=special)

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> bytes:
        return self._llm.detokenize(list(tokens), special=special)

    def piece_lengths(self, tokens: Iterable[int]) -> dict[int, int]:
        """The byte length of each distinct token's piece as the vocabulary spells it (control tokens
        not rendered)."""
        module = llama_cpp()
        buf = ctypes.create_string_buffer(256)
        return {token: abs(module.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False))
                for token in set(tokens)}

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp().llama_vocab_is_eog(self._vocab, token))

    # -- decoding -------------------------------------------------------------------------

    @property
    def n_tokens(self) -> int:
        """The position the next `decode` starts at."""
        return self._llm.n_tokens

    def tokens(self, start: int = 0, end: int | None = None) -> list[int]:
        """The tokens decoded (or marked) at positions [start, end)."""
        return [int(t) for t in self._llm.input_ids[start:end]]

    def decode(self, tokens: Sequence[int]) -> None:
        """Decode `tokens` into sequence 0 from `n_tokens` on (in batches of the context's n_batch)."""
        self._llm.eval(tokens)

    def decode_steps(self, steps: Sequence[SequenceStep]) -> list[np.ndarray]:
        """Decode one token of each of several sequences in one batch, and return each step's logits
        (copies, in the order of `steps`). With routing on, the engine routes every sequence over its
        own cells (patch 0017); `read_stats().sequences` then says what each one read. `n_tokens`
        (sequence 0's next position for `decode`) does not move."""
        if len({step.seq for step in steps}) != len(steps):
            raise UsageError("a batch of steps takes one token of each sequence")
        decode_batch(self._llm.ctx, steps, logits=[True] * len(steps))
        module = llama_cpp()
        return [np.ctypeslib.as_array(module.llama_get_logits_ith(self._llm.ctx, i), shape=(self.n_vocab,)).copy()
                for i in range(len(steps))]

    def feed_sequence(self, seq: int, tokens: Sequence[int], pos: int) -> None:
        """Decode `tokens` into sequence `seq` from position `pos` on (in batches of the context's
        n_batch), the last one's logits left for `last_logits`; `n_tokens` does not move."""
        if not tokens:
            raise UsageError("nothing to decode")
        n_batch = self._llm.n_batch
        for start in range(0, len(tokens), n_batch):
            chunk = tokens[start:start + n_batch]
            steps = [SequenceStep(seq, token, pos + start + j) for j, token in enumerate(chunk)]
            decode_batch(self._llm.ctx, steps, logits=[j == len(chunk) - 1 for j in range(len(chunk))])

    def decode_sequence(self, seq: int, tokens: Sequence[int], pos: int) -> np.ndarray:
        """feed_sequence, and the logits of the last token (a copy, kept past the next decode)."""
        self.feed_sequence(seq, tokens, pos)
        return self.last_logits().copy()

    def last_logits(self) -> np.ndarray:
        """The logits of the last token decoded: a view valid until the next decode (copy it to keep it)."""
        logits = llama_cpp().llama_get_logits_ith(self._llm.ctx, -1)
        return np.ctypeslib.as_array(logits, shape=(self.n_vocab,))

    def continue_at(self, position: int) -> None:
        """The next `decode` starts at `position` (the cells already there stay)."""
        self._llm.n_tokens = position

    def mark_tokens(self, tokens: Sequence[int]) -> None:
        """Record that positions [0, len(tokens)) hold `tokens` (after a state load); decoding goes on after them."""
        self._llm.input_ids[: len(tokens)] = tokens
        self._llm.n_tokens = len(tokens)

    # -- memory ---------------------------------------------------------------------------

    def _memory(self):
        module = llama_cpp()
        return module, module.llama_get_memory(self._llm.ctx)

    def clear(self) -> None:
        """Empty every sequence (llama_memory_clear, data included); the next decode starts at 0."""
        module, mem = self._memory()
        module.llama_memory_clear(mem, True)
        self._llm.n_tokens = 0

    def truncate(self, position: int) -> None:
        """Drop sequence 0's cells from `position` on; the next decode starts there."""
        self.remove_positions(0, position, -1)
        self._llm.n_tokens = position

    def remove_positions(self, seq: int, start: int = -1, end: int = -1) -> None:
        """Drop the cells of sequence `seq` at positions [start, end) (-1: from the first, to the last)."""
        module, mem = self._memory()
        module.llama_memory_seq_rm(mem, seq, start, end)

    def keep_cells(self, seq: int, start: int = 0, end: int = 0) -> None:
        """Sequence `seq`'s next tokens go into cells [start, end), and no other sequence's do (start ==
        end: anywhere); EngineError if the range is outside the cache or overlaps another sequence's."""
        if route_api().llama_kv_route_set_seq_cells(self._llm.ctx, seq, start, end) != 0:
            raise EngineError(f"the engine did not give sequence {seq} the cells {start}-{end}")

    def copy_sequence(self, source: int, dest: int) -> None:
        """Share every cell of sequence `source` with sequence `dest`."""
        module, mem = self._memory()
        module.llama_memory_seq_cp(mem, source, dest, -1, -1)

    def share_cells(self, source: int, dest: int, start: int, end: int) -> None:
        """Share the cells [start, end) that sequence `source` holds with sequence `dest`, whatever their
        positions (patch 0023); EngineError if the engine does not take the range."""
        if route_api().llama_kv_route_seq_share_cells(self._llm.ctx, source, dest, start, end) != 0:
            raise EngineError(f"the engine did not share the cells {start}-{end} of sequence {source} with {dest}")

    def shift_sequence(self, seq: int, delta: int) -> None:
        """Move every position of sequence `seq` by `delta` (the keys are re-roped at the next decode)."""
        module, mem = self._memory()
        module.llama_memory_seq_add(mem, seq, -1, -1, delta)

    def state_size(self, seq: int = 0) -> int:
        """Bytes of the state of sequence `seq` (what a saved state stores)."""
        return int(llama_cpp().llama_state_seq_get_size(self._llm.ctx, seq))

    def state(self, seq: int = 0) -> bytes:
        """The state of sequence `seq`: its cells' positions, keys and values (and recurrent state)."""
        module = llama_cpp()
        size = module.llama_state_seq_get_size(self._llm.ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        if module.llama_state_seq_get_data(self._llm.ctx, buf, size, seq) != size:
            raise EngineError("could not read the KV state from the engine")
        return bytes(buf)

    def load_state(self, state: bytes, seq: int = 0) -> bool:
        """Load a state (from `state`) into sequence `seq`; whether the engine took all of it."""
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        return llama_cpp().llama_state_seq_set_data(self._llm.ctx, buf, len(state), seq) == len(state)

    # -- routing --------------------------------------------------------------------------

    def apply_route(self, route: Route, *, batch_top_k: int = 0) -> None:
        """Set the routing of the next decodes (see the module's `apply_route`)."""
        apply_route(self._llm.ctx, route, batch_top_k=batch_top_k)

    def read_stats(self, *, with_regions: bool = True) -> ReadStats | None:
        """What the last ubatch read (see the module's `read_stats`)."""
        return read_stats(self._llm.ctx, with_regions=with_regions)

    def set_hints(self, cells: Sequence[int], seq: int | None = None) -> None:
        """Name the cells the next decodes read in place of top-k choices (none: clear them): of every
        sequence (which drops those any sequence was given alone), or of sequence `seq` alone (its
        steps read these in place of every sequence's); EngineError if the engine does not take them."""
        array = (ctypes.c_int32 * max(1, len(cells)))(*cells)
        api = route_api()
        if seq is None:
            failed = api.llama_kv_route_set_hints(self._llm.ctx, array, len(cells)) != 0 and cells
        else:
            failed = api.llama_kv_route_set_hints_seq(self._llm.ctx, seq, array, len(cells)) != 0
        if failed:
            raise EngineError("the engine did not take the route hints")

    def route_centroid_block(self) -> int:
        """The centroid block the KV cache keeps (0: none)."""
        return int(route_api().llama_kv_route_cent_blk(self._llm.ctx))

    def greedy_loop_seconds(self, first_token: int, n_tokens: int) -> tuple[int, float]:
        """llama.cpp's own greedy loop on this context from `first_token` (the module's
        greedy_loop_seconds): (tokens decoded, seconds); the next decode goes on after them."""
        decoded, seconds = greedy_loop_seconds(self._llm.ctx, first_token, n_tokens)
        self._llm.n_tokens += decoded
        return decoded, seconds


# -- the graph's tensors, for the lab's capture -----------------------------------------------------

def eval_callback(on_tensor: Callable[[int, bool, int], bool]):
    """`on_tensor(tensor, ask, user_data)` as the C callback ggml's scheduler calls for every graph
    node (keep the returned object alive as long as a context uses it)."""
    return llama_cpp().llama_cpp.ggml_backend_sched_eval_callback(on_tensor)


@contextlib.contextmanager
def eval_callback_installed(callback) -> Iterator[None]:
    """Contexts created inside this block (an EngineContext opened in it) call `callback`, made by
    eval_callback, for every graph node."""
    bindings = llama_cpp().llama_cpp
    original = bindings.llama_init_from_model

    def init_with_callback(model, params):
        params.cb_eval = callback
        params.cb_eval_user_data = None
        return original(model, params)

    bindings.llama_init_from_model = init_with_callback
    try:
        yield
    finally:
        bindings.llama_init_from_model = original


def tensor_name(tensor: int) -> str:
    return ggml_lib().ggml_get_name(tensor).decode(errors="replace")


def tensor_op(tensor: int) -> str:
    """The tensor's operation as ggml names it ("ROPE", "MUL_MAT", ...)."""
    return ggml_lib().ggml_op_desc(tensor).decode(errors="replace")


def tensor_size(tensor: int) -> int:
    """The tensor's number of elements."""
    return int(ggml_lib().ggml_nelements(tensor))


def tensor_floats(tensor: int, n: int) -> np.ndarray:
    """The first `n` values of an F32 tensor, copied from its backend."""
    buf = np.empty(n, np.float32)
    ggml_lib().ggml_backend_tensor_get(tensor, buf.ctypes.data, 0, buf.nbytes)
    return buf
