"""A set of documents to ask at once (the library's input side): paths and folders expanded into
documents, the files that could not be used named, and the set's KV bytes estimated before any
engine work.

`expand_documents` reads what it is given with kvlocal.ingest (its formats, size bounds and error
messages); a folder contributes its files of the supported kinds, recursively, in a stable order,
hidden files and folders left out. An unreadable or unsupported file is skipped and reported in one
line (`DocumentSet.skipped`, for the exit status); an empty folder, a set with no document left, a
path that does not exist and a document given twice (the same text) are refused with a UsageError
or DocumentError. `estimate_kv` sizes the set's KV cache from the characters and the model's GGUF
header, and `check_kv_limit` refuses a set over the limit (`default_max_kv` by default).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from kvlocal.errors import ContextOverflowError, DocumentError, KvlocalError, UsageError
from kvlocal.ggml_types import TYPE_IDS
from kvlocal.gguf_header import GGUFInfo
from kvlocal.ingest import KIND_BY_SUFFIX, Document, load_document
from kvlocal.route_settings import ANSWER_RESERVE, COARSE_BLOCK, DEFAULT_CENTROID_BLOCK, DEFAULT_CENTROID_TYPE
from kvlocal.units import human_bytes, parse_bytes

STDIN = "-"

# characters per token for the estimate: English prose runs about 4 with Qwen's tokenizer (ingest's
# "32k tokens take about 130 KB"), tables, numbers and code nearer 3; the lower figure errs towards
# refusing a set that would just fit rather than running out of memory halfway through loading it
CHARS_PER_TOKEN = 3.5
# tokens a document's KV state holds besides its text: the prompt template's head (about 60 tokens
# with kvlocal's instructions) and the padding to a whole region
TOKENS_PER_DOCUMENT = 128

# the default --max-kv: this share of the machine's physical memory (the weights, the centroids'
# scratch and the rest of the system need the remainder)
DEFAULT_MAX_KV_SHARE = 0.5


@dataclass(frozen=True)
class Skipped:
    """A file left out of the set; `message` is the one line that says which and why."""

    source: str
    message: str


@dataclass
class DocumentSet:
    """The documents of a set in their stable order, and the files that were skipped."""

    documents: list[Document]
    skipped: list[Skipped] = field(default_factory=list)

    @property
    def n_chars(self) -> int:
        return sum(len(doc.text) for doc in self.documents)

    @property
    def complete(self) -> bool:
        """Every file named or found was used (the exit status says so when not)."""
        return not self.skipped


@dataclass(frozen=True)
class KVEstimate:
    """The KV cache a set of documents needs, estimated before anything is loaded."""

    tokens: int  # estimated cells: every document's text, template and padding, and the answer's room
    bytes_per_token: int  # K and V of every layer at the cache type, plus the region centroids
    per_document: tuple[int, ...]  # estimated tokens of each document (template and padding included)

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    def describe(self) -> str:
        return (f"{len(self.per_document)} documents, about {self.tokens:,} tokens: "
                f"{human_bytes(self.bytes)} of KV cache")


# -- expanding paths ----------------------------------------------------------------------


def expand_documents(sources: list[str | os.PathLike[str]], *, stdin: BinaryIO | None = None) -> DocumentSet:
    """The documents named by `sources` (files, folders, "-" for stdin once), read and checked.

    Raises UsageError for no sources, a path that does not exist, stdin named twice or a folder that
    holds no document of a supported kind; DocumentError when no document is left after skipping
    or two sources hold the same text. An unreadable or unsupported file is skipped (DocumentSet.skipped)."""
    if not sources:
        raise UsageError("no documents given: name files or folders")
    candidates: list[str] = []
    skipped: list[Skipped] = []
    stdin_seen = False
    for source in sources:
        name = os.fspath(source)
        if name == STDIN:
            if stdin_seen:
                raise UsageError("'-' (stdin) is named twice; it can be read once")
            stdin_seen = True
            candidates.append(name)
            continue
        path = Path(name)
        if path.is_dir():
            found, unusable = _folder_files(path)
            if not found and not unusable:
                raise UsageError(f"the folder {name} holds no documents ({_supported()})")
            candidates += found
            skipped += unusable
        elif path.exists() or path.is_symlink():
            candidates.append(name)
        else:
            raise UsageError(f"no such file or folder: {name}")

    documents: list[Document] = []
    seen: dict[str, str] = {}  # text digest -> the source it came from
    for name in candidates:
        try:
            doc = load_document(name, stdin=stdin)
        except KvlocalError as err:  # DocumentError, or UsageError for an unsupported suffix
            skipped.append(Skipped(name, f"skipped {name}: {err}"))
            continue
        digest = text_digest(doc.text)
        if digest in seen:
            first = seen[digest]
            what = "is named twice" if _same_file(first, name) else f"has the same text as {first}"
            raise DocumentError(f"{name} {what}; give each document once")
        seen[digest] = name
        documents.append(doc)
    if not documents:
        raise DocumentError(f"no document could be read (skipped {len(skipped)}: "
                            f"{', '.join(s.source for s in skipped)})")
    return DocumentSet(documents, skipped)


def text_digest(text: str) -> str:
    """What makes two documents the same one: their text as the prompt holds it (stripped)."""
    return hashlib.sha256(text.strip().encode()).hexdigest()


def _folder_files(folder: Path) -> tuple[list[str], list[Skipped]]:
    """The folder's files of the supported kinds (recursively, sorted by their path in the folder,
    hidden files and folders left out), and the other files and unreadable subfolders, skipped."""
    found: list[str] = []
    skipped: list[Skipped] = []

    def unreadable(err: OSError) -> None:
        where = err.filename or folder
        skipped.append(Skipped(str(where), f"skipped {where}: cannot read the folder ({err.strerror or err})"))

    # os.walk does not follow symlinked folders (no loops); a symlinked file is read like a file
    for root, dirs, files in os.walk(folder, onerror=unreadable):
        dirs[:] = sorted((d for d in dirs if not d.startswith(".")), key=_order)
        for name in sorted((f for f in files if not f.startswith(".")), key=_order):
            path = os.path.join(root, name)
            if Path(name).suffix.lower() in KIND_BY_SUFFIX:
                found.append(path)
            else:
                skipped.append(Skipped(path, f"skipped {path}: not a supported document type ({_supported()})"))
    return found, skipped


def _order(name: str) -> tuple[str, str]:
    return name.casefold(), name


def _supported() -> str:
    return ", ".join(KIND_BY_SUFFIX)


def _same_file(a: str, b: str) -> bool:
    if STDIN in (a, b):
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# -- the KV estimate ----------------------------------------------------------------------


def type_size(kv_type: str) -> float:
    """Bytes per element of a KV cache or centroid type, by the names the CLI takes."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # lazy: pulls in numpy

    if kv_type not in TYPE_IDS:
        raise UsageError(f"unknown KV cache type {kv_type!r}; choose one of {', '.join(TYPE_IDS)}")
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(TYPE_IDS[kv_type])]
    return size / block


def kv_bytes_per_token(info: GGUFInfo, kv_type: str = "f16", *, centroid_block: int = DEFAULT_CENTROID_BLOCK,
                       centroid_type: str = DEFAULT_CENTROID_TYPE) -> int:
    """Bytes one cached token takes: K and V of every layer and KV head at `kv_type`, plus the share
    of the region centroids kept beside them (mean keys and values per centroid block and per 64
    cells). A header without the attention shape raises UsageError."""
    if not (info.n_layer and info.n_head_kv and info.head_dim):
        raise UsageError(f"{info.path.name} does not give its attention shape (layers, KV heads, head size); "
                         "its KV cache cannot be estimated")
    k_dim = info.key_length or info.head_dim
    v_dim = info.value_length or info.head_dim
    per_layer = info.n_head_kv * (k_dim + v_dim) * type_size(kv_type)
    if centroid_block:
        # mean keys (in centroid_type) and mean values (f16) of every block and every coarse block
        per_cell = 1 / centroid_block + (1 / COARSE_BLOCK if centroid_block < COARSE_BLOCK else 0)
        per_layer += info.n_head_kv * per_cell * (k_dim * type_size(centroid_type) + v_dim * type_size("f16"))
    return math.ceil(info.n_layer * per_layer)


def estimate_tokens(n_chars: int) -> int:
    """Tokens a document of `n_chars` characters is estimated to take (without the template)."""
    return math.ceil(n_chars / CHARS_PER_TOKEN)


def estimate_kv(docs: DocumentSet | list[Document], info: GGUFInfo, kv_type: str = "f16", *,
                centroid_block: int = DEFAULT_CENTROID_BLOCK, centroid_type: str = DEFAULT_CENTROID_TYPE) -> KVEstimate:
    """The set's KV cache, from its characters and the model's header: nothing is loaded."""
    documents = docs.documents if isinstance(docs, DocumentSet) else docs
    per_document = tuple(estimate_tokens(len(doc.text)) + TOKENS_PER_DOCUMENT for doc in documents)
    return KVEstimate(
        tokens=sum(per_document) + ANSWER_RESERVE,
        bytes_per_token=kv_bytes_per_token(info, kv_type, centroid_block=centroid_block, centroid_type=centroid_type),
        per_document=per_document,
    )


# -- the limit ----------------------------------------------------------------------------


def physical_memory() -> int | None:
    """The machine's physical memory in bytes, or None where it cannot be told."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def default_max_kv(memory: int | None = None) -> int | None:
    """The default limit on a set's KV bytes: half the machine's physical memory (`memory` overrides
    it, for tests); None (no limit) where the memory cannot be told."""
    memory = physical_memory() if memory is None else memory
    return int(memory * DEFAULT_MAX_KV_SHARE) if memory else None


def parse_size(text: str) -> int:
    """Bytes from a size such as `8GiB`, `8G`, `512M`, `1.5g` or `1000000` (binary units); UsageError otherwise."""
    value = parse_bytes(text)
    if value is None:
        raise UsageError(f"not a size: {text!r} (for example 8GiB, 512M or 2000000000)", setting="max_kv")
    if value < 1:
        raise UsageError(f"the KV limit must be at least 1 byte (got {text!r})", setting="max_kv")
    return int(value)


def check_kv_limit(estimate: KVEstimate, max_kv: int | None) -> None:
    """ContextOverflowError, in one line, when the set's estimated KV bytes exceed `max_kv` (None: no limit)."""
    if max_kv is None or estimate.bytes <= max_kv:
        return
    raise ContextOverflowError(
        f"the set needs about {human_bytes(estimate.bytes)} of KV cache ({len(estimate.per_document)} documents, "
        f"about {estimate.tokens:,} tokens), over the limit of {human_bytes(max_kv)}; "
        "ask fewer documents or raise the limit", setting="max_kv")
