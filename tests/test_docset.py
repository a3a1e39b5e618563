"""kvlocal.docset: a set of documents from paths and folders, what is skipped and why, and the set's
KV estimate against the limit (no engine)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from kvlocal import docset
from kvlocal.docset import (
    DocumentSet, check_kv_limit, default_max_kv, estimate_kv, expand_documents, kv_bytes_per_token, parse_size,
)
from kvlocal.errors import ContextOverflowError, DocumentError, UsageError
from kvlocal.gguf_header import GGUFInfo, validate_gguf
from kvlocal.ingest import Document
from kvlocal.session import ANSWER_RESERVE

GiB = 1 << 30


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def sources(result: DocumentSet) -> list[str]:
    return [doc.source for doc in result.documents]


@pytest.fixture
def library(tmp_path: Path) -> Path:
    """A folder of documents: nested, mixed case, hidden entries, a file of another kind."""
    root = tmp_path / "lib"
    write(root / "b.txt", "second report")
    write(root / "A.md", "# first report")
    write(root / "sub" / "c.html", "<html><body><p>third report</p></body></html>")
    write(root / "sub" / "deeper" / "d.TXT", "fourth report")
    write(root / ".hidden.txt", "a hidden note")
    write(root / ".git" / "notes.txt", "a hidden folder's file")
    write(root / "sub" / "photo.jpg", b"\xff\xd8\xff\xe0 not a document")
    return root


def test_a_folder_gives_its_supported_files_recursively_in_a_stable_order(library: Path):
    result = expand_documents([library])
    assert sources(result) == [str(library / p) for p in ("A.md", "b.txt", "sub/c.html", "sub/deeper/d.TXT")]
    assert [doc.kind for doc in result.documents] == ["md", "txt", "html", "txt"]
    assert result.documents[2].text == "third report"
    # hidden files and folders are left out silently; a file of another kind is named once
    assert [s.source for s in result.skipped] == [str(library / "sub" / "photo.jpg")]
    assert "not a supported document type" in result.skipped[0].message
    assert not result.complete


def test_paths_and_folders_keep_the_order_given(library: Path, tmp_path: Path):
    extra = write(tmp_path / "z.txt", "an extra document")
    first = write(tmp_path / "0.md", "the very first")
    result = expand_documents([extra, library / "sub", str(first)])
    assert sources(result) == [str(extra), str(library / "sub" / "c.html"), str(library / "sub" / "deeper" / "d.TXT"),
                               str(first)]


def test_a_file_named_explicitly_is_read_even_when_hidden(tmp_path: Path):
    hidden = write(tmp_path / ".notes.txt", "hidden but named")
    assert sources(expand_documents([hidden])) == [str(hidden)]
    assert expand_documents([hidden]).complete


def test_unreadable_and_unsupported_files_are_skipped_in_one_line_each(tmp_path: Path):
    folder = tmp_path / "mixed"
    good = write(folder / "good.txt", "a good document")
    write(folder / "empty.txt", "")
    write(folder / "binary.txt", bytes(range(256)) * 8)
    write(folder / "broken.pdf", b"%PDF-1.4 truncated")
    (folder / "gone.md").symlink_to(folder / "nowhere.md")  # a dangling link
    named = write(tmp_path / "report.docx", b"PK\x03\x04" + bytes(range(256)) * 4)  # a ZIP, no EPUB
    result = expand_documents([folder, named])
    assert sources(result) == [str(good)]
    skipped = {Path(s.source).name: s.message for s in result.skipped}
    assert set(skipped) == {"binary.txt", "broken.pdf", "empty.txt", "gone.md", "report.docx"}
    for name, message in skipped.items():
        assert "\n" not in message and message.startswith("skipped ") and name in message
    assert "is empty" in skipped["empty.txt"]
    assert "binary" in skipped["binary.txt"]
    assert "not a readable PDF" in skipped["broken.pdf"]
    assert "unsupported document type" in skipped["report.docx"]


def test_an_unreadable_subfolder_is_skipped_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    folder = tmp_path / "f"
    write(folder / "a.txt", "readable")
    walk = os.walk

    def failing_walk(top, onerror=None, **kwargs):
        onerror(PermissionError(13, "Permission denied", str(folder / "locked")))
        yield from walk(top, onerror=onerror, **kwargs)

    monkeypatch.setattr(docset.os, "walk", failing_walk)
    result = expand_documents([folder])
    assert sources(result) == [str(folder / "a.txt")]
    assert result.skipped[0].message == f"skipped {folder / 'locked'}: cannot read the folder (Permission denied)"


@pytest.mark.parametrize("make", [
    lambda root: root,  # empty
    lambda root: write(root / ".only-hidden.txt", "x").parent,
    lambda root: (root / "nested" / "empty").mkdir(parents=True) or root,
])
def test_a_folder_without_documents_is_refused(tmp_path: Path, make):
    root = tmp_path / "empty"
    root.mkdir()
    with pytest.raises(UsageError, match="holds no documents"):
        expand_documents([make(root)])


def test_no_document_left_is_refused(tmp_path: Path):
    folder = tmp_path / "bad"
    write(folder / "empty.txt", "")
    write(folder / "x.jpg", b"\xff\xd8")
    with pytest.raises(DocumentError, match=r"no document could be read \(skipped 2"):
        expand_documents([folder])


def test_missing_paths_and_no_paths_are_usage_errors(tmp_path: Path):
    with pytest.raises(UsageError, match="no such file or folder"):
        expand_documents([write(tmp_path / "a.txt", "here"), tmp_path / "typo.txt"])
    with pytest.raises(UsageError, match="no documents given"):
        expand_documents([])


def test_a_duplicate_document_is_refused(tmp_path: Path):
    a = write(tmp_path / "a.txt", "the same clause\n")
    b = write(tmp_path / "copy" / "b.md", "the same clause")  # the same text once stripped
    with pytest.raises(DocumentError, match=f"{b} has the same text as {a}"):
        expand_documents([a, tmp_path / "copy"])
    alias = tmp_path / "alias.txt"
    alias.symlink_to(a)
    with pytest.raises(DocumentError, match=f"{alias} is named twice"):
        expand_documents([a, alias])


def test_stdin_is_a_document_once(tmp_path: Path):
    a = write(tmp_path / "a.txt", "from a file")
    result = expand_documents([a, "-"], stdin=io.BytesIO(b"from stdin"))
    assert [(d.source, d.text) for d in result.documents] == [(str(a), "from a file"), ("<stdin>", "from stdin")]
    with pytest.raises(UsageError, match="named twice"):
        expand_documents(["-", "-"], stdin=io.BytesIO(b"x"))


# -- the estimate ---------------------------------------------------------------------------


def qwen25_1_5b() -> GGUFInfo:
    """The default model's header fields (Qwen2.5 1.5B: 28 layers, 2 KV heads of 128)."""
    return GGUFInfo(path=Path("qwen.gguf"), version=3, architecture="qwen2", name=None, context_length=32768,
                    n_layer=28, n_embd=1536, n_head=12, n_head_kv=2, head_dim=128, n_tensors=0, file_size=0)


def test_bytes_per_token_from_the_header():
    info = qwen25_1_5b()
    assert kv_bytes_per_token(info, "f16", centroid_block=0) == 28_672  # docs/DESIGN: 28,672 B at F16
    assert kv_bytes_per_token(info, "q8_0", centroid_block=0) == 28 * 2 * 256 * 34 // 32
    # 8-cell blocks: mean keys and values per 8 cells and per 64 cells, in f16
    assert kv_bytes_per_token(info, "f16", centroid_block=8) == 28_672 + round(28_672 * (1 / 8 + 1 / 64))
    assert kv_bytes_per_token(info, "f16", centroid_block=64) == 28_672 + 28_672 // 64  # no coarse level


def test_bytes_per_token_of_a_real_header(tiny_model: Path):
    info = validate_gguf(tiny_model)  # 2 layers, 2 KV heads of 16
    assert kv_bytes_per_token(info, "f16", centroid_block=0) == 2 * 2 * (16 + 16) * 2


def test_a_header_without_the_attention_shape_cannot_be_estimated():
    info = GGUFInfo(path=Path("odd.gguf"), version=3, architecture="x", name=None, context_length=None, n_layer=None,
                    n_embd=None, n_head=None, n_head_kv=None, head_dim=None, n_tensors=0, file_size=0)
    with pytest.raises(UsageError, match="attention shape"):
        kv_bytes_per_token(info)


def test_the_set_estimate_counts_text_template_and_answer():
    docs = [Document("x" * 35_000, "a.txt", "txt"), Document("y" * 7, "b.txt", "txt")]
    est = estimate_kv(DocumentSet(docs), qwen25_1_5b(), centroid_block=0)
    assert est.per_document == (10_000 + docset.TOKENS_PER_DOCUMENT, 2 + docset.TOKENS_PER_DOCUMENT)
    assert est.tokens == sum(est.per_document) + ANSWER_RESERVE
    assert est.bytes == est.tokens * 28_672
    assert "2 documents" in est.describe()


def test_sixteen_8k_documents_fit_a_16_gib_machine_by_default():
    # the 128k set: 16 documents of ~8k tokens, about 3.5 GiB at F16 plus centroids
    docs = [Document("w" * int(8000 * docset.CHARS_PER_TOKEN), f"{i}.txt", "txt") for i in range(16)]
    est = estimate_kv(docs, qwen25_1_5b())
    assert 3.5 * GiB < est.bytes < 5 * GiB
    check_kv_limit(est, default_max_kv(16 * GiB))
    with pytest.raises(ContextOverflowError, match=r"over the limit of 2\.0 GiB") as err:
        check_kv_limit(est, 2 * GiB)
    assert "\n" not in str(err.value) and err.value.setting == "max_kv"
    check_kv_limit(est, None)  # no limit known


def test_the_default_limit_is_half_the_memory():
    assert default_max_kv(16 * GiB) == 8 * GiB
    memory = docset.physical_memory()
    assert memory is None or default_max_kv() == memory // 2


@pytest.mark.parametrize(("text", "value"), [
    ("8GiB", 8 * GiB), ("8G", 8 * GiB), ("8gb", 8 * GiB), ("512M", 512 << 20), ("1.5g", int(1.5 * GiB)),
    ("2000000000", 2_000_000_000), (" 64 KiB ", 64 << 10), ("1T", 1 << 40),
])
def test_sizes_parse(text: str, value: int):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "G", "-1G", "8 GB extra", "8X", "0", "0.1", "8Gi"])
def test_bad_sizes_are_refused(text: str):
    with pytest.raises(UsageError):
        parse_size(text)
