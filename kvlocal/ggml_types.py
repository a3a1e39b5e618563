"""ggml's tensor type ids (`enum ggml_type` in ggml.h) that kvlocal hands the engine or reads from a
saved KV state; tests/test_ggml_types.py checks them against gguf.GGMLQuantizationType."""

from __future__ import annotations

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_Q8_0 = 8

# the types a KV cache and the key centroids may be kept in, by the names the CLI takes
TYPE_IDS = {"f16": GGML_TYPE_F16, "q8_0": GGML_TYPE_Q8_0}
