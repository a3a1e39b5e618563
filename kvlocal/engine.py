"""The patched llama.cpp engine: import it, tell a patched build from a stock one, bind our C API.

Only this module and the session import llama_cpp; nothing else reaches into the engine.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
from dataclasses import dataclass
from types import ModuleType

from kvlocal.errors import EngineError
from kvlocal.patchset import repo_patchset_id

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
        gpu_offload=bool(module.llama_supports_gpu_offload()),
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
        ("attn", ctypes.c_int),  # enum llama_kv_route_attn
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
        ("rows_read", ctypes.c_int64),
        ("rows_dense", ctypes.c_int64),
        ("bytes_kv", ctypes.c_int64),
        ("bytes_meta", ctypes.c_int64),
        ("bytes_dense", ctypes.c_int64),
    ]


def _lib_beside_llama(name: str) -> ctypes.CDLL:
    """The ggml library `name` ("ggml-base", "ggml") that the loaded libllama sits beside."""
    from pathlib import Path

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
            name=lib.ggml_backend_dev_name(dev).decode(errors="replace"),
            description=lib.ggml_backend_dev_description(dev).decode(errors="replace").strip(),
            kind=DEVICE_KINDS.get(lib.ggml_backend_dev_type(dev), "other"),
            memory_total=int(total.value),
        ))
    return devices


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
    for name in ("llama_kv_route_set_layer_top_k", "llama_kv_route_get_regions", "llama_kv_route_get_layers"):
        fn = getattr(lib, name)
        fn.argtypes = [ctx_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]
        fn.restype = ctypes.c_int32
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
