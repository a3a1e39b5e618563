"""Tests for kvlocal.ingest (every format and every bad input) and kvlocal.sample."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import random
import zipfile
from pathlib import Path

import pypdfium2 as pdfium
import pytest

from kvlocal.errors import DocumentError, UsageError
from kvlocal.ingest import Document, load_document, read_bytes
from kvlocal.sample import SAMPLE_ANSWER, SAMPLE_QUESTION, sample_document, write_sample

# -- fixtures: hand-written PDFs (optionally RC4-encrypted) and EPUBs --------

_PASSWORD_PAD = bytes.fromhex("28BF4E5E4E758A4164004E56FFFA01082E2E00B6D0683E802F0CA9FE6453697A")
_FILE_ID = b"kvlocal-test-id!"


def _rc4(key: bytes, data: bytes) -> bytes:
    state = list(range(256))
    j = 0
    for i in range(256):
        j = (j + state[i] + key[i % len(key)]) % 256
        state[i], state[j] = state[j], state[i]
    out = bytearray()
    i = j = 0
    for byte in data:
        i = (i + 1) % 256
        j = (j + state[i]) % 256
        state[i], state[j] = state[j], state[i]
        out.append(byte ^ state[(state[i] + state[j]) % 256])
    return bytes(out)


def _standard_security(password: str) -> tuple[bytes, bytes, bytes, int]:
    """(file key, /O, /U, /P) for the 40-bit RC4 standard handler, revision 2."""
    padded = (password.encode() + _PASSWORD_PAD)[:32]
    permissions = -44
    owner = _rc4(hashlib.md5(padded).digest()[:5], padded)
    key = hashlib.md5(padded + owner + permissions.to_bytes(4, "little", signed=True) + _FILE_ID).digest()[:5]
    return key, owner, _rc4(key, _PASSWORD_PAD), permissions


def make_pdf(pages: list[list[str]], password: str | None = None) -> bytes:
    """A valid PDF with one Helvetica line per string; pages may be empty (like a scan)."""
    security = _standard_security(password) if password else None
    objects = {
        1: b"<< /Type /Catalog /Pages 2 0 R >>",
        3: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    }
    kids = []
    for index, lines in enumerate(pages):
        page_num, content_num = 4 + 2 * index, 5 + 2 * index
        escaped = (line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)") for line in lines)
        operators = "".join(f"({line}) Tj T* " for line in escaped)
        stream = f"BT /F1 12 Tf 14 TL 72 720 Td {operators}ET".encode("latin-1")
        if security:
            object_key = hashlib.md5(security[0] + content_num.to_bytes(3, "little") + b"\0\0").digest()[:10]
            stream = _rc4(object_key, stream)
        kids.append(f"{page_num} 0 R")
        objects[page_num] = (
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            f"/Resources << /Font << /F1 3 0 R >> >> /Contents {content_num} 0 R >>"
        ).encode()
        objects[content_num] = b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream)
    objects[2] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {len(pages)} >>".encode()
    trailer = f"/Root 1 0 R /ID [<{_FILE_ID.hex()}> <{_FILE_ID.hex()}>]"
    if security:
        _, owner, user, permissions = security
        encrypt_num = len(objects) + 1
        objects[encrypt_num] = (
            f"<< /Filter /Standard /V 1 /R 2 /O <{owner.hex()}> /U <{user.hex()}> /P {permissions} >>"
        ).encode()
        trailer += f" /Encrypt {encrypt_num} 0 R"
    return _assemble_pdf(objects, trailer)


def _assemble_pdf(objects: dict[int, bytes], trailer: str) -> bytes:
    out = bytearray(b"%PDF-1.4\n")
    offsets = {}
    for num in sorted(objects):
        offsets[num] = len(out)
        out += b"%d 0 obj\n%s\nendobj\n" % (num, objects[num])
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offsets[num] for num in sorted(objects))
    out += f"trailer\n<< /Size {len(objects) + 1} {trailer} >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


CONTAINER_XML = """<?xml version="1.0"?>
<container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">
  <rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/></rootfiles>
</container>"""

OPF_XML = """<?xml version="1.0" encoding="utf-8"?>
<package xmlns="http://www.idpf.org/2007/opf" version="3.0" unique-identifier="id">
  <metadata xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:title>Test Book</dc:title></metadata>
  <manifest>
    <item id="c1" href="text/chapter%201.xhtml" media-type="application/xhtml+xml"/>
    <item id="c2" href="text/chapter2.xhtml" media-type="application/xhtml+xml"/>
    <item id="css" href="style.css" media-type="text/css"/>
  </manifest>
  <spine><itemref idref="c2"/><itemref idref="css"/><itemref idref="c1"/></spine>
</package>"""

ENCRYPTION_XML = """<?xml version="1.0"?>
<encryption xmlns="urn:oasis:names:tc:opendocument:xmlns:container"
            xmlns:enc="http://www.w3.org/2001/04/xmlenc#">
  <enc:EncryptedData><enc:CipherData><enc:CipherReference URI="OEBPS/text/chapter2.xhtml"/></enc:CipherData>
  </enc:EncryptedData>
</encryption>"""


def _xhtml(title: str, body: str) -> str:
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n<html xmlns="http://www.w3.org/1999/xhtml">'
        f"<head><title>{title}</title></head><body>{body}</body></html>"
    )


def make_epub(members: dict[str, str] | None = None, *, skip: tuple[str, ...] = ()) -> bytes:
    """An EPUB whose spine reads chapter 2 before chapter 1; `members` override or add files."""
    files = {
        "META-INF/container.xml": CONTAINER_XML,
        "OEBPS/content.opf": OPF_XML,
        "OEBPS/text/chapter 1.xhtml": _xhtml("Book", "<h1>Chapter One</h1><p>The second part.</p>"),
        "OEBPS/text/chapter2.xhtml": _xhtml("Book", "<h1>Prologue</h1><p>It begins &amp; goes on.</p>"),
        "OEBPS/style.css": "p { margin: 0 }",
        **(members or {}),
    }
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("mimetype", "application/epub+zip", compress_type=zipfile.ZIP_STORED)
        for name, content in files.items():
            if name not in skip:
                archive.writestr(name, content, compress_type=zipfile.ZIP_DEFLATED)
    return buffer.getvalue()


def write(tmp_path: Path, name: str, data: bytes | str) -> Path:
    path = tmp_path / name
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def document_error(path: Path | str) -> str:
    with pytest.raises(DocumentError) as info:
        load_document(path)
    message = str(info.value)
    assert "\n" not in message
    return message


# -- PDF --------------------------------------------------------------------


def test_pdf_pages_are_joined_with_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "report.pdf", make_pdf([["Hello world", "second (line)"], ["Page two"]]))
    doc = load_document(path)
    assert doc == Document(text="Hello world\nsecond (line)\n\nPage two", source=str(path), kind="pdf")


def test_extension_is_case_insensitive(tmp_path: Path) -> None:
    assert load_document(write(tmp_path, "REPORT.PDF", make_pdf([["Shouting"]]))).text == "Shouting"


def test_pdf_without_text_says_it_may_be_scanned(tmp_path: Path) -> None:
    message = document_error(write(tmp_path, "scan.pdf", make_pdf([[], []])))
    assert "no extractable text" in message and "scanned" in message


def test_truncated_pdf_is_reported_as_damaged(tmp_path: Path) -> None:
    data = make_pdf([["Hello world"]])
    path = write(tmp_path, "cut.pdf", data[: len(data) // 2])
    assert document_error(path) == f"{path} is not a readable PDF (damaged or truncated)"


def test_encrypted_pdf_is_reported(tmp_path: Path) -> None:
    data = make_pdf([["Top secret"]], password="hunter2")
    unlocked = pdfium.PdfDocument(data, password="hunter2")  # the fixture really is encrypted
    assert unlocked[0].get_textpage().get_text_bounded() == "Top secret"
    unlocked.close()
    path = write(tmp_path, "locked.pdf", data)
    assert document_error(path) == f"{path} is encrypted (password-protected PDF)"


def test_unsupported_pdf_security_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise pdfium.PdfiumError("Failed to load document", err_code=pdfium.raw.FPDF_ERR_SECURITY)

    monkeypatch.setattr(pdfium, "PdfDocument", refuse)
    path = write(tmp_path, "drm.pdf", make_pdf([["x"]]))
    assert "unsupported security scheme" in document_error(path)


def test_pdf_page_failure_is_wrapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: object, **_kwargs: object) -> None:
        raise pdfium.PdfiumError("Failed to load text page.")

    monkeypatch.setattr(pdfium.PdfPage, "get_textpage", broken)
    path = write(tmp_path, "bad-page.pdf", make_pdf([["x"]]))
    assert document_error(path) == f"{path} is not a readable PDF (damaged or truncated)"


# -- plain text -------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kind"), [("a.txt", "txt"), ("a.text", "txt"), ("a.md", "md"), ("a.Markdown", "md")]
)
def test_text_kinds(tmp_path: Path, name: str, kind: str) -> None:
    doc = load_document(write(tmp_path, name, "# Title\n\nBody"))
    assert (doc.text, doc.kind) == ("# Title\n\nBody", kind)


def test_text_is_normalized(tmp_path: Path) -> None:
    raw = b"\xef\xbb\xbfline one   \r\nline two\t\r\n\r\n\r\n\r\n\r\n\r\nafter gap\rlast\x07 \n\n"
    doc = load_document(write(tmp_path, "notes.txt", raw))
    assert doc.text == "line one\nline two\n\n\nafter gap\nlast"


def test_utf16_text(tmp_path: Path) -> None:
    text = "Z\u00fcrich \u2013 \u6771\u4eac \u2013 na\u00efve"
    assert load_document(write(tmp_path, "u16.txt", text.encode("utf-16"))).text == text
    assert load_document(write(tmp_path, "u16be.txt", b"\xfe\xff" + text.encode("utf-16-be"))).text == text


def test_cp1252_text(tmp_path: Path) -> None:
    text = "Caf\u00e9 \u201cquoted\u201d \u2013 costs 5\u20ac"
    assert load_document(write(tmp_path, "win.txt", text.encode("cp1252"))).text == text


def test_latin1_fallback_for_bytes_cp1252_lacks(tmp_path: Path) -> None:
    assert load_document(write(tmp_path, "odd.txt", b"caf\xe9 \x81 bar")).text == "caf\u00e9 \x81 bar"


def test_binary_garbage_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "garbage.txt", random.Random(1).randbytes(4096))
    assert document_error(path) == f"{path} looks like binary data, not text"


def test_control_heavy_bytes_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "controls.md", b"ab\x01\x02\x03\x04\x05\x06cd" * 50)
    assert "binary" in document_error(path)


def test_broken_utf16_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "odd16.txt", b"\xff\xfea\x00b")
    assert "utf-16" in document_error(path)


# -- bad paths --------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pdf"
    assert document_error(missing) == f"no such file: {missing}"
    assert document_error(tmp_path / "nope.xyz").startswith("no such file")


def test_directory(tmp_path: Path) -> None:
    assert document_error(tmp_path) == f"{tmp_path} is a directory, not a document"


@pytest.mark.parametrize("content", [b"", b"  \n\r\n\t "])
@pytest.mark.parametrize("name", ["empty.txt", "empty.pdf", "empty.epub", "empty.html"])
def test_empty_file(tmp_path: Path, name: str, content: bytes) -> None:
    path = write(tmp_path, name, content)
    assert document_error(path) == f"{path} is empty"


def test_unknown_extension_with_binary_bytes_is_a_usage_error(tmp_path: Path) -> None:
    path = write(tmp_path, "data.xyz", random.Random(2).randbytes(4096))
    with pytest.raises(UsageError) as info:
        load_document(path)
    assert info.value.exit_code == 2
    assert str(info.value).startswith(f"unsupported document type '.xyz' ({path}): its bytes are not text")
    assert all(ext in str(info.value) for ext in (".pdf", ".txt", ".md", ".html", ".epub"))


def test_a_zip_that_is_no_epub_is_unsupported(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("word/document.xml", random.Random(3).randbytes(2048))
    with pytest.raises(UsageError, match=r"^unsupported document type '\.docx'"):
        load_document(write(tmp_path, "report.docx", buffer.getvalue()))


@pytest.mark.parametrize("name", ["notes.rst", "build.log", "paper.tex", "Apache-2.0", "data.xyz"])
def test_text_with_an_unknown_extension_is_read_as_text(tmp_path: Path, name: str) -> None:
    doc = load_document(write(tmp_path, name, "Licensed under the Apache License.\n\nSection 1."))
    assert (doc.kind, doc.text) == ("txt", "Licensed under the Apache License.\n\nSection 1.")


def test_an_unknown_extension_holding_a_pdf_or_html_is_read_as_one(tmp_path: Path) -> None:
    assert load_document(write(tmp_path, "scan.dat", make_pdf([["From PDF"]]))).text == "From PDF"
    page = load_document(write(tmp_path, "page.xhtml", b"<!DOCTYPE html><p>Hi <b>there</b></p>"))
    assert (page.kind, page.text) == ("html", "Hi there")


def test_uploaded_bytes_are_read_by_content_not_by_declared_type() -> None:
    pdf = make_pdf([["Uploaded PDF"]])
    assert read_bytes(pdf, "upload", "txt").text == "Uploaded PDF"  # declared wrong: the bytes decide
    assert read_bytes(pdf, "x.txt").kind == "pdf"
    assert read_bytes(b"plain words", "notes.rst").kind == "txt"  # no declared type, unknown extension
    assert read_bytes(b"<p>a <i>fragment</i></p>", "frag", "html").text == "a fragment"  # declared and text
    assert read_bytes(b"<p>a fragment</p>", "frag").text == "<p>a fragment</p>"  # nothing says HTML
    with pytest.raises(UsageError, match=r"^unsupported document type \(blob\): its bytes are not text"):
        read_bytes(random.Random(4).randbytes(4096), "blob", "pdf")
    with pytest.raises(DocumentError, match="is empty"):
        read_bytes(b"  ", "blank.txt")


def test_extensionless_file_is_sniffed(tmp_path: Path) -> None:
    assert load_document(write(tmp_path, "README", "plain words")).kind == "txt"
    assert load_document(write(tmp_path, "paper", make_pdf([["From PDF"]]))).text == "From PDF"


# -- HTML -------------------------------------------------------------------

HTML_PAGE = """<!DOCTYPE html>
<html><head><title>Page title</title><style>body { color: red }</style>
<script>var x = "<p>not text</p>";</script></head>
<body>
  <h1>Heading  &amp; more</h1>
  <div><div><p>First   paragraph
     wraps here.</p></div></div>
  <p>Line<br>break &lt;tag&gt; &eacute;&#233;&#x263A;</p>
  <ul><li>one</li><li>two</li></ul>
  <table><tr><td>a</td> <td>b</td></tr><tr><th>c</th><td>d</td></tr></table>
  <pre>  indented
    code</pre>
  <noscript>enable JS</noscript>
</body></html>"""

HTML_TEXT = (
    "Heading & more\n\nFirst paragraph wraps here.\n\nLine\nbreak <tag> \u00e9\u00e9\u263a\n\n"
    "one\ntwo\n\na\tb\nc\td\n\n  indented\n    code"
)


@pytest.mark.parametrize("name", ["page.html", "page.HTM"])
def test_html_visible_text_only(tmp_path: Path, name: str) -> None:
    doc = load_document(write(tmp_path, name, HTML_PAGE))
    assert (doc.text, doc.kind) == (HTML_TEXT, "html")


def test_html_in_cp1252(tmp_path: Path) -> None:
    doc = load_document(write(tmp_path, "old.html", "<p>na\u00efve \u2013 ok</p>".encode("cp1252")))
    assert doc.text == "na\u00efve \u2013 ok"


def test_html_without_text(tmp_path: Path) -> None:
    path = write(tmp_path, "blank.html", "<html><script>alert(1)</script><img src=x></html>")
    assert document_error(path) == f"{path} contains no text"


# -- EPUB -------------------------------------------------------------------


def test_epub_follows_spine_order(tmp_path: Path) -> None:
    doc = load_document(write(tmp_path, "book.epub", make_epub()))
    assert doc.kind == "epub"
    assert doc.text == "Prologue\n\nIt begins & goes on.\n\nChapter One\n\nThe second part."


def test_epub_that_is_not_a_zip(tmp_path: Path) -> None:
    path = write(tmp_path, "broken.epub", b"PK\x03\x04 this is not really a zip")
    assert document_error(path) == f"{path} is not a readable EPUB (damaged or not a ZIP archive)"


def test_truncated_epub(tmp_path: Path) -> None:
    data = make_epub()
    assert "not a readable EPUB" in document_error(write(tmp_path, "cut.epub", data[: len(data) // 2]))


@pytest.mark.parametrize(
    ("epub", "reason"),
    [
        (make_epub(skip=("META-INF/container.xml",)), "missing META-INF/container.xml"),
        (make_epub(skip=("OEBPS/content.opf",)), "missing OEBPS/content.opf"),
        (make_epub(skip=("OEBPS/text/chapter2.xhtml",)), "missing OEBPS/text/chapter2.xhtml"),
        (make_epub({"OEBPS/content.opf": "<package><manifest>"}), "malformed XML"),
        (make_epub({"META-INF/container.xml": "<container/>"}), "META-INF/container.xml names no package file"),
        (make_epub({"OEBPS/content.opf": "<package><spine/></package>"}), "its spine lists no XHTML chapters"),
    ],
)
def test_corrupt_epub_structure(tmp_path: Path, epub: bytes, reason: str) -> None:
    path = write(tmp_path, "bad.epub", epub)
    assert document_error(path) == f"{path} is not a readable EPUB ({reason})"


def test_drm_epub(tmp_path: Path) -> None:
    path = write(tmp_path, "drm.epub", make_epub({"META-INF/encryption.xml": ENCRYPTION_XML}))
    assert document_error(path) == f"{path} is encrypted (DRM-protected EPUB)"


# -- stdin ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "kind", "text"),
    [
        (b"just some words\n", "txt", "just some words"),
        ("caf\u00e9".encode("cp1252"), "txt", "caf\u00e9"),
        (make_pdf([["Piped PDF"]]), "pdf", "Piped PDF"),
        (b"\n<!DOCTYPE html><p>Piped &amp; parsed</p>", "html", "Piped & parsed"),
        (b'<?xml version="1.0"?>\n<html><body>X</body></html>', "html", "X"),
        (make_epub(), "epub", "Prologue\n\nIt begins & goes on.\n\nChapter One\n\nThe second part."),
    ],
)
def test_stdin_is_sniffed(data: bytes, kind: str, text: str) -> None:
    doc = load_document("-", stdin=io.BytesIO(data))
    assert doc == Document(text=text, source="<stdin>", kind=kind)


def test_stdin_zip_that_is_not_epub() -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("data.bin", bytes(range(256)))
    with pytest.raises(DocumentError, match="binary"):
        load_document("-", stdin=io.BytesIO(buffer.getvalue()))


def test_stdin_empty() -> None:
    with pytest.raises(DocumentError, match=r"^<stdin> is empty$"):
        load_document("-", stdin=io.BytesIO(b""))


def test_document_is_frozen(tmp_path: Path) -> None:
    doc = load_document(write(tmp_path, "a.txt", "x"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        doc.text = "y"  # type: ignore[misc]


# -- sample document --------------------------------------------------------


def test_sample_document_is_long_deterministic_and_plants_the_answer_once() -> None:
    text = sample_document()
    assert len(text) > 8000
    assert 2000 <= len(text.split()) <= 2500
    assert text == sample_document()
    assert text.count(SAMPLE_ANSWER) == 1
    assert 0.25 <= text.index(SAMPLE_ANSWER) / len(text) <= 0.40
    assert SAMPLE_QUESTION.endswith("?")


def test_sample_prose_is_varied() -> None:
    sentences = [s for s in sample_document().replace("\n", " ").split(". ") if s]
    assert len(set(sentences)) > 0.9 * len(sentences)


def test_write_sample_round_trips(tmp_path: Path) -> None:
    path = write_sample(tmp_path / "sub" / "sample.txt")
    assert path == tmp_path / "sub" / "sample.txt"
    assert load_document(path).text == sample_document().strip()


# -- bounds: memory and time stay small whatever the input ------------------------------------


def test_an_endless_stream_is_refused_within_bounded_memory() -> None:
    # a child process, so that its peak RSS is the ingestion's alone
    import subprocess
    import sys

    code = (
        "import io, resource, time\n"
        "from kvlocal.ingest import load_document\n"
        "from kvlocal.errors import DocumentError\n"
        "class Yes(io.RawIOBase):\n"
        "    def readable(self): return True\n"
        "    def readinto(self, b):\n"
        "        b[:] = b'yes\\n' * (len(b) // 4) + b'y' * (len(b) % 4); return len(b)\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "start = time.perf_counter()\n"
        "try:\n"
        "    load_document('-', stdin=io.BufferedReader(Yes()))\n"
        "except DocumentError as err:\n"
        "    print(err)\n"
        "print(time.perf_counter() - start)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    message, seconds, grown_kib = out.strip().split("\n")
    assert message.startswith("<stdin> is larger than 8 MiB")
    assert float(seconds) < 5
    assert int(grown_kib) < 100 * 1024  # the 8 MiB bound and its copies, not the stream


def test_a_file_over_the_bound_is_refused_before_it_is_read(tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    with open(big, "wb") as fh:
        fh.truncate(9 * 1024 * 1024)  # sparse: nothing to read quickly if the size were ignored
    assert "big.txt is larger than 8 MiB" in document_error(big)


def test_an_endless_device_is_refused(tmp_path: Path) -> None:
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    assert "binary" in document_error("/dev/zero")


def test_text_longer_than_any_context_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlocal import ingest

    monkeypatch.setattr(ingest, "MAX_TEXT_CHARS", 1000)
    assert "more than 1,000 characters" in document_error(write(tmp_path, "long.md", "word " * 300))
    assert load_document(write(tmp_path, "short.md", "word " * 150)).text


def test_a_pdf_stops_extracting_past_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlocal import ingest

    monkeypatch.setattr(ingest, "MAX_TEXT_CHARS", 30)
    pages_read = []
    original = ingest._page_text
    monkeypatch.setattr(ingest, "_page_text", lambda page: pages_read.append(1) or original(page))
    path = write(tmp_path, "many.pdf", make_pdf([[f"Page number {i} text"] for i in range(6)]))
    assert "more than 30 characters" in document_error(path)
    assert len(pages_read) == 2


def test_an_epub_member_that_inflates_past_the_bound_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlocal import ingest

    monkeypatch.setitem(ingest.MAX_INPUT_BYTES, "html", 64 * 1024)
    bomb = make_epub({"OEBPS/text/chapter2.xhtml": _xhtml("Book", "<p>" + "a" * 200_000 + "</p>")})
    assert len(bomb) < 10_000  # it is small until inflated
    message = document_error(write(tmp_path, "bomb.epub", bomb))
    assert "not a readable EPUB" in message and "inflates to more than" in message


def test_a_piped_epub_larger_than_the_sniffed_head_is_still_an_epub(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlocal import ingest

    monkeypatch.setattr(ingest, "_READ_CHUNK", 256)  # the ZIP directory lies past the first chunk
    doc = load_document("-", stdin=io.BytesIO(make_epub()))
    assert doc.kind == "epub" and "Chapter One" in doc.text


def test_piped_utf16_text_is_not_taken_for_binary() -> None:
    doc = load_document("-", stdin=io.BytesIO("Grüße aus Köln".encode("utf-16")))
    assert doc.text == "Grüße aus Köln"
