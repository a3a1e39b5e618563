"""Document ingestion: turn a path (or "-" for stdin) into plain text."""

from __future__ import annotations

import codecs
import io
import os
import posixpath
import re
import sys
import xml.etree.ElementTree as ET
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote

import pypdfium2 as pdfium

from kvlocal.errors import DocumentError, KvlocalError, UsageError

KIND_BY_SUFFIX = {
    ".pdf": "pdf",
    ".txt": "txt",
    ".text": "txt",
    ".md": "md",
    ".markdown": "md",
    ".html": "html",
    ".htm": "html",
    ".epub": "epub",
}
STDIN_NAME = "<stdin>"

# Bounds that keep memory (and the wait before an error) small whatever the input. A 32k-token
# context holds about 130 KB of prose, a 128k one about 0.5 MB; text beyond MAX_TEXT_CHARS can fit
# no context kvlocal runs, and is refused as soon as it is seen, without reading the rest.
MAX_TEXT_CHARS = 2 * 1024 * 1024
_MiB = 1024 * 1024
MAX_INPUT_BYTES = {"txt": 8 * _MiB, "md": 8 * _MiB, "html": 16 * _MiB, "epub": 64 * _MiB, "pdf": 256 * _MiB}
_READ_CHUNK = _MiB

_BOMS = (
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
_CONTROL_BYTES = bytes(sorted(set(range(32)) - {0x09, 0x0A, 0x0C, 0x0D, 0x1B})) + b"\x7f"
_CONTROL_CHARS = re.compile("[\x00-\x08\x0e-\x1f\x7f\ufffe\uffff]")
_EPUB_MIMETYPE = b"application/epub+zip"
_XHTML_TYPES = {"application/xhtml+xml", "text/html"}


class _EpubError(Exception):
    """An EPUB lacks a required part; `str(err)` says which."""


_EPUB_ERRORS = (
    _EpubError, zipfile.BadZipFile, zlib.error, ET.ParseError, EOFError, RuntimeError, NotImplementedError
)


@dataclass(frozen=True)
class Document:
    """Extracted text of one document. `pages`: for a PDF, the offset in `text` where each page starts
    (page 1 first; an empty page starts where the next page's text does); empty for other kinds. It is
    derived from the text, so two documents are equal by their text, source and kind alone."""

    text: str
    source: str
    kind: str
    pages: tuple[int, ...] = field(default=(), compare=False)


def load_document(source: str | os.PathLike[str], *, stdin: BinaryIO | None = None) -> Document:
    """Read `source` ("-" means stdin) and return its text; raise DocumentError/UsageError."""
    if os.fspath(source) == "-":
        name = STDIN_NAME
        kind, data = _read_stdin(stdin)
    else:
        name = os.fspath(source)
        kind, data = _read_file(Path(source), name)
    return _document(data, name, kind)


def _document(data: bytes, name: str, kind: str) -> Document:
    """The text of `data`, read as `kind`; DocumentError when it has none."""
    if not data or data.isspace():
        raise DocumentError(f"{name} is empty")
    pages: list[str] = []
    if kind == "pdf":
        pages = _pdf_pages(data, name)
        text = _PAGE_SEPARATOR.join(pages)
    else:
        text = _EXTRACTORS[kind](data, name)
    _check_text_size(len(text), name)
    text = normalize_text(text)
    if not text:
        raise DocumentError(_no_text_message(name, kind))
    return Document(text=text, source=name, kind=kind, pages=page_starts(text, pages))


def sniff_kind(data: bytes) -> str:
    """Guess the document kind from its first bytes."""
    if b"%PDF-" in data[:1024]:
        return "pdf"
    if data.startswith(b"PK") and _is_epub(data):
        return "epub"
    head = data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if head.startswith((b"<!doctype html", b"<html")) or (head.startswith(b"<?xml") and b"<html" in head):
        return "html"
    return "txt"


def decode_text(data: bytes, name: str) -> str:
    """Decode bytes as UTF-8 / UTF-16 (by BOM) / cp1252 / latin-1, refusing binary data."""
    for bom, codec in _BOMS:
        if data.startswith(bom):
            try:
                return data.decode(codec)
            except UnicodeDecodeError:
                encoding = codec.removesuffix("-sig")
                raise DocumentError(f"{name} is not valid {encoding} text despite its byte-order mark") from None
    if _looks_binary(data):
        raise DocumentError(f"{name} looks like binary data, not text")
    for codec in ("utf-8", "cp1252"):
        try:
            return data.decode(codec)
        except UnicodeDecodeError:
            pass
    return data.decode("latin-1")


def normalize_text(text: str) -> str:
    """Unify newlines, drop control characters and trailing spaces, collapse long blank runs."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\f", "\n").replace("\v", "\n")
    text = _CONTROL_CHARS.sub("", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip("\n")


def html_to_text(markup: str) -> str:
    """Visible text of an HTML/XHTML document, with blocks on their own lines."""
    parser = _HTMLText()
    parser.feed(markup)
    parser.close()
    return parser.text()


# -- reading ----------------------------------------------------------------


def _read_stdin(stdin: BinaryIO | None) -> tuple[str, bytes]:
    """The kind sniffed from the stream's first bytes, and its bytes (at most the kind's bound)."""
    if stdin is None and sys.stdin.isatty():
        raise UsageError("no document on stdin: pipe one in, or give a file path instead of '-'")
    stream = stdin if stdin is not None else sys.stdin.buffer
    try:
        return _read_sniffed(stream, STDIN_NAME)
    except OSError as err:
        raise DocumentError(f"cannot read {STDIN_NAME}: {err.strerror or err}") from None


def _read_file(path: Path, name: str) -> tuple[str, bytes]:
    """The file's kind (by extension, else sniffed) and its bytes (at most the kind's bound)."""
    if not path.exists():
        raise DocumentError(f"no such file: {name}")
    if path.is_dir():
        raise DocumentError(f"{name} is a directory, not a document")
    kind = KIND_BY_SUFFIX.get(path.suffix.lower())  # an unknown suffix (notes.rst, Apache-2.0): by content
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size  # 0 for a pipe or a device such as /dev/zero
            if kind and size > MAX_INPUT_BYTES[kind]:
                raise DocumentError(_too_large_message(name, kind))
            if kind:
                return kind, _read_capped(fh, MAX_INPUT_BYTES[kind], name, kind)
            return _read_sniffed(fh, name, path.suffix or None)
    except OSError as err:
        raise DocumentError(f"cannot read {name}: {err.strerror or err}") from None


def _read_sniffed(stream: BinaryIO, name: str, suffix: str | None = None) -> tuple[str, bytes]:
    """Kind and bytes of a stream whose kind is told by its content, read up to that kind's bound.
    `suffix`: the name's extension, where the stream is a named file's or an upload's (binary
    content is then refused as an unsupported type, in the words an unknown extension always got)."""
    head = stream.read(_READ_CHUNK)
    # a ZIP's directory sits at its end: an EPUB is only recognised once read whole
    bound_kind = "epub" if head.startswith(b"PK") else sniff_kind(head)
    if bound_kind == "txt" and _binary_text(head):
        raise _binary_error(name, suffix)  # said before reading on
    data = head + _read_capped(stream, MAX_INPUT_BYTES[bound_kind] - len(head), name, bound_kind)
    kind = sniff_kind(data) if bound_kind == "epub" else bound_kind
    if len(data) > MAX_INPUT_BYTES[kind]:
        raise DocumentError(_too_large_message(name, kind))
    if kind == "txt" and bound_kind == "epub" and _binary_text(data):
        raise _binary_error(name, suffix)  # a ZIP that is no EPUB (a .docx, a .jar)
    return kind, data


def read_bytes(data: bytes, name: str, declared: str | None = None) -> Document:
    """A document from bytes received whole (an upload): its kind told by its content, the `declared`
    kind ("pdf", "html", "txt", ... or None) taken only where the content agrees with it: a PDF or an
    EPUB is one by its bytes whatever was declared, and declared HTML or Markdown text is read so
    when the bytes are text. DocumentError or UsageError as load_document raises them."""
    if len(data) > max(MAX_INPUT_BYTES.values()):
        raise DocumentError(_too_large_message(name, "pdf"))
    declared = declared or KIND_BY_SUFFIX.get(Path(name).suffix.lower())
    kind, data = _read_sniffed(io.BytesIO(data), name, Path(name).suffix)
    if kind == "txt" and declared in ("html", "md"):
        kind = declared
    return _document(data, name, kind)


def _read_capped(stream: BinaryIO, limit: int, name: str, kind: str) -> bytes:
    """The rest of `stream`, or DocumentError as soon as it passes `limit` bytes (an endless stream too)."""
    chunks: list[bytes] = []
    total = 0
    while chunk := stream.read(_READ_CHUNK):
        total += len(chunk)
        if total > limit:
            raise DocumentError(_too_large_message(name, kind))
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large_message(name: str, kind: str) -> str:
    return (f"{name} is larger than {MAX_INPUT_BYTES[kind] // _MiB} MiB, far more than a context window holds "
            "(32k tokens take about 130 KB of text); give kvlocal the part you want to ask about")


def _check_text_size(n_chars: int, name: str) -> None:
    if n_chars > MAX_TEXT_CHARS:
        raise DocumentError(
            f"{name} holds more than {MAX_TEXT_CHARS:,} characters of text, far more than a context window holds "
            "(32k tokens take about 130,000); give kvlocal the part you want to ask about")


def _binary_text(data: bytes) -> bool:
    """Bytes sniffed as text that are binary after all (a byte-order mark says text)."""
    return not data.startswith(tuple(bom for bom, _ in _BOMS)) and _looks_binary(data)


def _binary_error(name: str, suffix: str | None) -> KvlocalError:
    """The error for binary content that is no PDF or EPUB: an unsupported type where the name has an
    extension kvlocal does not know, else binary data."""
    if suffix is None:
        return DocumentError(f"{name} looks like binary data, not text")
    supported = ", ".join(KIND_BY_SUFFIX)
    what = f"'{suffix}' " if suffix else ""
    return UsageError(f"unsupported document type {what}({name}): its bytes are not text, and not a PDF, "
                      f"EPUB or HTML; supported: {supported}, or any text file")


def _looks_binary(data: bytes) -> bool:
    sample = data[:65536]
    if b"\x00" in sample:
        return True
    controls = len(sample) - len(sample.translate(None, _CONTROL_BYTES))
    return controls > len(sample) // 20


def _no_text_message(name: str, kind: str) -> str:
    if kind == "pdf":
        return f"{name} has no extractable text (a scanned PDF? run OCR on it first)"
    return f"{name} contains no text"


# -- PDF --------------------------------------------------------------------


_PAGE_SEPARATOR = "\n\n"  # between a PDF's pages


def _pdf_text(data: bytes, name: str) -> str:
    return _PAGE_SEPARATOR.join(_pdf_pages(data, name))


def _pdf_pages(data: bytes, name: str) -> list[str]:
    """The text of each page, stripped."""
    try:
        pdf = pdfium.PdfDocument(data)
    except pdfium.PdfiumError as err:
        raise DocumentError(_pdf_open_message(err, name)) from None
    try:
        pages, n_chars = [], 0
        for page in pdf:
            pages.append(_page_text(page))
            n_chars += len(pages[-1]) + len(_PAGE_SEPARATOR)
            _check_text_size(n_chars, name)
        return pages
    except pdfium.PdfiumError:
        raise DocumentError(f"{name} is not a readable PDF (damaged or truncated)") from None
    finally:
        pdf.close()


def page_starts(text: str, pages: list[str]) -> tuple[int, ...]:
    """Where each of `pages` starts in `text`, their normalized join (`normalize_text` works line by
    line, so each page's normalized text appears in it whole, in order). An empty page starts where
    the next page with text does (or at the end); a page not found (not expected) where the one
    before it ended."""
    starts: list[int | None] = []
    cursor = 0
    for page in pages:
        norm = normalize_text(page)
        if not norm:
            starts.append(None)
            continue
        at = text.find(norm[:200], cursor)
        at = cursor if at < 0 else at
        starts.append(at)
        cursor = min(len(text), at + len(norm))
    following = len(text)
    for i in range(len(starts) - 1, -1, -1):
        if starts[i] is None:
            starts[i] = following
        following = starts[i]
    return tuple(starts)  # type: ignore[arg-type]


def _page_text(page: pdfium.PdfPage) -> str:
    textpage = page.get_textpage()
    try:
        return textpage.get_text_bounded().strip()
    finally:
        textpage.close()
        page.close()


def _pdf_open_message(err: pdfium.PdfiumError, name: str) -> str:
    if err.err_code == pdfium.raw.FPDF_ERR_PASSWORD:
        return f"{name} is encrypted (password-protected PDF)"
    if err.err_code == pdfium.raw.FPDF_ERR_SECURITY:
        return f"{name} is encrypted with an unsupported security scheme"
    return f"{name} is not a readable PDF (damaged or truncated)"


# -- HTML -------------------------------------------------------------------


class _HTMLText(HTMLParser):
    """Collects visible text; block elements become line or paragraph breaks."""

    SKIP = frozenset({"script", "style", "noscript", "template", "title"})
    PARAGRAPH = frozenset({
        "address", "article", "aside", "blockquote", "dl", "figure", "footer", "form", "h1", "h2", "h3",
        "h4", "h5", "h6", "header", "hr", "main", "nav", "ol", "p", "pre", "section", "table", "ul",
    })
    LINE = frozenset({"body", "dd", "details", "div", "dt", "figcaption", "li", "summary", "tr"})
    CELL = frozenset({"td", "th"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self._parts: list[str] = []
        self._pending_breaks = 0
        self._skip_depth = 0
        self._pre_depth = 0

    def text(self) -> str:
        return "".join(self._parts)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.SKIP:
            self._skip_depth += 1
        elif tag == "br":
            self._pending_breaks += 1
        elif tag in self.CELL and not self._at_line_start():
            self._parts[-1] = self._parts[-1].rstrip(" ")
            self._parts.append("\t")
        self._block_boundary(tag)
        if tag == "pre":
            self._pre_depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP:
            self._skip_depth = max(0, self._skip_depth - 1)
        elif tag == "pre":
            self._pre_depth = max(0, self._pre_depth - 1)
        self._block_boundary(tag)

    def handle_data(self, data: str) -> None:
        if self._skip_depth:
            return
        if not self._pre_depth:
            data = re.sub(r"\s+", " ", data)
            if self._at_line_start() or self._parts[-1][-1:].isspace():
                data = data.lstrip(" ")
        if not data:
            return
        if self._pending_breaks and self._parts:
            self._parts.append("\n" * self._pending_breaks)
        self._pending_breaks = 0
        self._parts.append(data)

    def _block_boundary(self, tag: str) -> None:
        if tag in self.PARAGRAPH:
            self._pending_breaks = max(self._pending_breaks, 2)
        elif tag in self.LINE:
            self._pending_breaks = max(self._pending_breaks, 1)

    def _at_line_start(self) -> bool:
        return not self._parts or self._pending_breaks > 0 or self._parts[-1].endswith("\n")


def _html_text(data: bytes, name: str) -> str:
    return html_to_text(decode_text(data, name))


# -- EPUB -------------------------------------------------------------------


def _is_epub(data: bytes) -> bool:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return archive.read("mimetype").strip() == _EPUB_MIMETYPE
    except (KeyError, zipfile.BadZipFile, zlib.error, EOFError, RuntimeError, NotImplementedError):
        return False


def _epub_text(data: bytes, name: str) -> str:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            chapters = _spine_paths(archive)
            _refuse_drm(archive, chapters, name)
            texts, n_chars = [], 0
            for path in chapters:
                texts.append(html_to_text(decode_text(_member(archive, path), name)))
                n_chars += len(texts[-1]) + 2
                _check_text_size(n_chars, name)
            return "\n\n".join(texts)
    except _EPUB_ERRORS as err:
        raise DocumentError(f"{name} is not a readable EPUB ({_epub_reason(err)})") from None


def _spine_paths(archive: zipfile.ZipFile) -> list[str]:
    """Archive paths of the XHTML documents in reading (spine) order."""
    container = ET.fromstring(_member(archive, "META-INF/container.xml"))
    rootfile = next((el for el in container.iter() if _local(el.tag) == "rootfile"), None)
    opf_path = rootfile.get("full-path", "") if rootfile is not None else ""
    if not opf_path:
        raise _EpubError("META-INF/container.xml names no package file")
    package = ET.fromstring(_member(archive, opf_path))
    manifest = {el.get("id"): el for el in package.iter() if _local(el.tag) == "item"}
    base = posixpath.dirname(opf_path)
    paths = []
    for ref in (el for el in package.iter() if _local(el.tag) == "itemref"):
        item = manifest.get(ref.get("idref"))
        if item is not None and item.get("media-type") in _XHTML_TYPES and item.get("href"):
            paths.append(posixpath.normpath(posixpath.join(base, unquote(item.get("href", "")))))
    if not paths:
        raise _EpubError("its spine lists no XHTML chapters")
    return paths


def _refuse_drm(archive: zipfile.ZipFile, chapters: list[str], name: str) -> None:
    try:
        encryption = archive.read("META-INF/encryption.xml")
    except KeyError:
        return
    references = (el for el in ET.fromstring(encryption).iter() if _local(el.tag) == "CipherReference")
    encrypted = {unquote(el.get("URI", "")) for el in references}
    if encrypted & set(chapters):
        raise DocumentError(f"{name} is encrypted (DRM-protected EPUB)")


def _member(archive: zipfile.ZipFile, path: str) -> bytes:
    """A member's bytes; a member that inflates past the HTML bound (a zip bomb) is refused unread."""
    limit = MAX_INPUT_BYTES["html"]
    try:
        with archive.open(path) as fh:
            data = fh.read(limit + 1)
    except KeyError:
        raise _EpubError(f"missing {path}") from None
    if len(data) > limit:
        raise _EpubError(f"{path} inflates to more than {limit // _MiB} MiB")
    return data


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _epub_reason(err: Exception) -> str:
    if isinstance(err, _EpubError):
        return str(err)
    if isinstance(err, ET.ParseError):
        return "malformed XML"
    return "damaged or not a ZIP archive"


_EXTRACTORS: dict[str, Callable[[bytes, str], str]] = {
    "pdf": _pdf_text,
    "txt": decode_text,
    "md": decode_text,
    "html": _html_text,
    "epub": _epub_text,
}
