"""A GGUF model file's header, read without the engine: is it complete, and can llama.cpp generate
text with it? A wrong or damaged model file is refused before any engine work."""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlocal.errors import ModelError


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    version: int
    architecture: str
    name: str | None
    context_length: int | None
    n_layer: int | None
    n_embd: int | None
    n_head: int | None
    n_head_kv: int | None
    head_dim: int | None
    n_tensors: int
    file_size: int
    causal: bool | None = None  # <arch>.attention.causal (absent: causal)
    pooling_type: int | None = None  # <arch>.pooling_type (embedding models)
    key_length: int | None = None  # <arch>.attention.key_length / value_length, when given
    value_length: int | None = None
    rope_dims: int | None = None  # <arch>.rope.dimension_count, when given
    file_type: int | None = None  # general.file_type (enum llama_ftype): the weights' type, when given

    @property
    def weight_type(self) -> str:
        """The weights' type as llama.cpp names it ("Q4_K_M", "F16", ...), or "unknown"."""
        if self.file_type is None:
            return "unknown"
        return FILE_TYPE_NAMES.get(self.file_type, f"file type {self.file_type}")


# enum llama_ftype, the common ones
FILE_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
                   11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
                   17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}



# GGUF metadata value types: fixed-size ones map to a struct code.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Short(Exception):
    """The header runs past the end of the file."""


@dataclass(frozen=True)
class _Array:
    """A metadata array, skipped over: only its length is kept."""

    count: int


class _Header:
    """A minimal GGUF header walker over an mmap: fast even for 150k-token vocabularies
    (gguf.GGUFReader takes ~13 s on the 0.5B model because it builds a numpy view per
    array element)."""

    def __init__(self, buf: mmap.mmap, endian: str) -> None:
        self.buf, self.end, self.pos = buf, len(buf), 0
        self.structs = {code: struct.Struct(endian + code) for code in _SCALARS.values()}

    def take(self, fmt: str) -> Any:
        st = self.structs[fmt]
        if self.pos + st.size > self.end:
            raise _Short
        (value,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return value

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.end:
            raise _Short
        self.pos += n

    def string(self) -> bytes:
        n = self.take("Q")
        start = self.pos
        self.skip(n)
        return self.buf[start : self.pos]

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string().decode("utf-8", "replace")
        if vtype == _ARRAY:
            itype, count = self.take("I"), self.take("Q")
            if itype in _SCALARS:
                self.skip(count * self.structs[_SCALARS[itype]].size)
            elif itype == _STRING:  # hot loop for vocabularies: kept inline
                unpack, buf, end, pos = self.structs["Q"].unpack_from, self.buf, self.end, self.pos
                for _ in range(count):
                    if pos + 8 > end:
                        raise _Short
                    pos += 8 + unpack(buf, pos)[0]
                self.pos = pos
                self.skip(0)  # raises if the last string ran past the end
            else:
                for _ in range(count):
                    self.value(itype)
            return _Array(count)
        raise ValueError(f"unknown metadata type {vtype}")


def validate_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Check that `path` is a complete GGUF file (header parses, tensor data present)."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"model file {path} does not exist")
    if not path.is_file():
        raise ModelError(f"{path} is not a GGUF model file (not a regular file)")
    size = path.stat().st_size
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{path} is not a GGUF model file")
        if size < 24:
            raise ModelError(f"{path} is truncated or damaged (the GGUF header is incomplete)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse(path, buf, size)
            except _Short:
                raise ModelError(f"{path} is truncated or damaged (the GGUF header is incomplete)") from None
            except (ValueError, UnicodeDecodeError, OverflowError) as err:
                raise ModelError(f"{path} is truncated or damaged ({err})") from None


def _parse(path: Path, buf: mmap.mmap, size: int) -> GGUFInfo:
    (version,) = struct.unpack_from("<I", buf, 4)
    endian = "<"
    if version & 0xFFFF == 0:  # written on a big-endian host
        endian, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in (2, 3):
        raise ModelError(f"{path} uses GGUF version {version}, which is not supported (need 2 or 3)")
    h = _Header(buf, endian)
    h.pos = 8
    n_tensors, n_kv = h.take("Q"), h.take("Q")
    if n_tensors > size or n_kv > size:
        raise ValueError("implausible tensor or metadata count")

    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = h.string().decode("utf-8", "replace")
        meta[key] = h.value(h.take("I"))

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # lazy: pulls in numpy

    data_bytes = 0
    for _ in range(n_tensors):
        name = h.string().decode("utf-8", "replace")
        n_dims = h.take("I")
        if n_dims > 4:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        n_elems = 1
        for _ in range(n_dims):
            n_elems *= h.take("Q")
        raw_type, offset = h.take("I"), h.take("Q")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
        except (ValueError, KeyError):
            raise ModelError(f"{path} uses tensor type {raw_type}, which this kvlocal does not know") from None
        data_bytes = max(data_bytes, offset + n_elems // block * type_size)

    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"invalid alignment {alignment!r}")
    data_start = -(-h.pos // alignment) * alignment
    have = max(size - data_start, 0)
    if data_bytes > have:
        raise ModelError(
            f"{path} is truncated or damaged (expected {data_bytes} bytes of tensor data, file has {have})"
        )

    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelError(f"{path} is not a GGUF model file (no general.architecture)")

    def hp(key: str) -> int | None:
        value = meta.get(f"{arch}.{key}")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    n_embd, n_head = hp("embedding_length"), hp("attention.head_count")
    head_dim = hp("attention.key_length") or (n_embd // n_head if n_embd and n_head else None)
    name = meta.get("general.name")
    causal = meta.get(f"{arch}.attention.causal")
    return GGUFInfo(
        path=path,
        version=version,
        architecture=arch,
        name=name if isinstance(name, str) else None,
        context_length=hp("context_length"),
        n_layer=hp("block_count"),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=hp("attention.head_count_kv") or n_head,
        head_dim=head_dim,
        n_tensors=n_tensors,
        file_size=size,
        causal=causal if isinstance(causal, bool) else None,
        pooling_type=hp("pooling_type"),
        file_type=meta.get("general.file_type") if isinstance(meta.get("general.file_type"), int) else None,
        key_length=hp("attention.key_length"),
        value_length=hp("attention.value_length"),
        rope_dims=hp("rope.dimension_count"),
    )


# llama.cpp architectures that cannot generate text one token after another: llama.cpp gives them no KV
# cache (llama_model::create_memory; llama-cpp-python then fails with "Memory is not initialized") or
# they have no decoder at all.
_NOT_TEXT_GENERATION = {
    **dict.fromkeys(
        ("bert", "modern-bert", "nomic-bert", "nomic-bert-moe", "neo-bert", "jina-bert-v2", "jina-bert-v3",
         "eurobert", "gemma-embedding", "t5encoder"),
        "an embedding/encoder model",
    ),
    **dict.fromkeys(("dream", "llada", "llada-moe", "rnd1"), "a diffusion model"),
    "wavtokenizer-dec": "an audio decoder",
}


def check_text_model(info: GGUFInfo) -> GGUFInfo:
    """`info` if llama.cpp can generate text with this model; ModelError (before any engine work) for an
    embedding/encoder model or attention shapes that abort inside ggml."""
    path, arch = info.path, info.architecture
    kind = _NOT_TEXT_GENERATION.get(arch)
    if kind is not None:
        raise ModelError(f"{path} is not a text-generation model (architecture {arch}: {kind})")
    if info.causal is False:
        raise ModelError(
            f"{path} is not a text-generation model (architecture {arch} without causal attention: "
            "an embedding/encoder model)"
        )
    # ggml's RoPE and attention kernels work on pairs of dimensions: an odd size aborts the process
    sizes: list[tuple[int, str]] = []
    if info.key_length is not None:
        sizes.append((info.key_length, f"{arch}.attention.key_length"))
    if info.value_length is not None:
        sizes.append((info.value_length, f"{arch}.attention.value_length"))
    if (info.key_length is None or info.value_length is None) and info.n_embd and info.n_head:
        if info.n_embd % info.n_head:
            raise ModelError(
                f"{path} has an embedding length ({info.n_embd}) that does not divide into its "
                f"{info.n_head} attention heads; llama.cpp cannot run it"
            )
        sizes.append((info.n_embd // info.n_head, f"embedding length {info.n_embd} / {info.n_head} heads"))
    for size, source in sizes:
        if size % 2:
            raise ModelError(
                f"{path} has an odd attention head size ({size}, {source}); llama.cpp needs an even one "
                "(RoPE rotates pairs of dimensions), so it cannot run this model"
            )
    if info.rope_dims is not None and info.rope_dims % 2:
        raise ModelError(
            f"{path} has an odd RoPE dimension count ({info.rope_dims}, {arch}.rope.dimension_count); "
            "llama.cpp needs an even one, so it cannot run this model"
        )
    return info
