"""PDF pages through the library: where each page starts in the text (ingest), in the assembled cache
(DocumentSpan.pages), in an answer's reads (SetReads.pages, describe) and in the TUI's sources and
read summary of a set."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from test_ingest import make_pdf

from kvlocal.ingest import Document, load_document, page_starts
from kvlocal.layout import DocumentSpan, SetReads
from kvlocal.library import load_set
from kvlocal.routing import ReadStats, Route, RouteMode

PAGES = [
    [f"Page {p} line {i}: the valve {p * 100 + i} holds {(p * 31 + i * 7) % 97} litres." for i in range(24)]
    for p in (1, 2, 3)
]
OTHER = Document(" ".join(f"line {i} says {i * 13 % 97} apples." for i in range(70)), "b.txt", "txt")


def write_pdf(tmp_path: Path, pages: list[list[str]], name: str = "report.pdf") -> Path:
    path = tmp_path / name
    path.write_bytes(make_pdf(pages))
    return path


def stats(regions: list[list[list[int]]], *, n_layer: int, n_kv: int = 512, R: int = 64) -> ReadStats:
    arr = np.array(regions, np.int32)
    return ReadStats(RouteMode.GEOMETRIC, 0, n_layer=n_layer, n_layer_routed=arr.shape[0], n_head_kv=arr.shape[1],
                     n_kv=n_kv, region_size=R, n_sel=arr.shape[2], rows_read=0, rows_dense=0, bytes_kv=0,
                     bytes_meta=0, bytes_dense=0, layers=np.arange(arr.shape[0], dtype=np.int32), regions=arr)


# -- ingest ------------------------------------------------------------------------------------------


def test_a_pdf_says_where_each_page_starts_in_its_text(tmp_path):
    doc = load_document(write_pdf(tmp_path, [["Hello world", "second (line)"], [], ["Page three"], []]))
    assert doc.text == "Hello world\nsecond (line)\n\n\nPage three"  # the empty page's blank lines, collapsed
    # an empty page starts where the next page's text does (the last one: at the end)
    assert doc.pages == (0, 28, 28, len(doc.text))
    assert doc.text[doc.pages[2]:] == "Page three"
    # pages are derived from the text: equality is by text, source and kind, as before
    assert doc == Document(doc.text, doc.source, "pdf")


def test_other_kinds_have_no_pages(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("one\n\ntwo")
    assert load_document(path).pages == ()
    assert Document("x", "y", "txt").pages == ()  # positional construction still works


def test_page_starts_survive_normalization():
    pages = ["first\x01 page  \nend", "", "second\r\npage", "third"]
    text = "first page\nend\n\n\nsecond\npage\n\nthird"  # what normalize_text makes of their join
    starts = page_starts(text, pages)
    assert starts == (0, text.index("second"), text.index("second"), text.index("third"))


# -- SetReads by page ----------------------------------------------------------------------------------


def test_reads_are_counted_by_page_and_add_up_to_the_document():
    spans = (DocumentSpan("dir/a.pdf", 64, 192, 100, 64, (64, 100, 150)), DocumentSpan("b.txt", 192, 256, 50, 192))
    tally = SetReads(spans, prefix_cells=300)
    # one routed layer of two: regions 1 (cells 64-127) and 2 (128-191, by both KV heads); the dense layer reads all
    tally.add(stats([[[0, 1, 3], [2, 2, 4]]], n_layer=2))
    assert tally.pages == [[2 * 36 + 36, 2 * 50 + 28 + 2 * 22, 2 * 42 + 2 * 42], []]
    assert sum(tally.pages[0]) == tally.documents[0]
    assert tally.total == 6 * 64 + 2 * 512  # the parts still add up to the engine's rows
    assert [spans[0].page_at(c) for c in (63, 64, 99, 100, 149, 150, 191, 192)] == [None, 1, 1, 2, 2, 3, 3, None]
    assert spans[1].page_at(200) is None
    line = tally.describe()
    assert line.startswith("reads by document: dir/a.pdf 70% (most on pp. 1, 2, 3), b.txt 30%; of all rows read")
    assert tally.describe(rest=False, basename=True) == "reads by document: a.pdf 70% (most on pp. 1, 2, 3), b.txt 30%"


def test_only_the_most_read_pages_are_named():
    spans = (DocumentSpan("a.pdf", 64, 320, 256, 64, (64, 128, 192, 256)),)
    tally = SetReads(spans, prefix_cells=400)
    for _ in range(3):
        tally.add(stats([[[3, 3, 1]]], n_layer=1))  # page 3 six times, page 1 three times
    tally.add(stats([[[3, 4, 2]]], n_layer=1))  # page 3 once more, pages 4 and 2 once
    assert tally.pages == [[3 * 64, 64, 7 * 64, 64]]  # page 1 is read less than half as much as page 3
    assert tally.top_pages(0) == [3] and "(most on p. 3)" in tally.describe()


def test_a_dense_answer_names_no_pages():
    spans = (DocumentSpan("a.pdf", 64, 192, 100, 64, (64, 100)),)
    tally = SetReads(spans, prefix_cells=256)
    tally.add(ReadStats(RouteMode.FULL, 1, 2, 0, 2, 256, 64, 0, 0, 0, 0, 0, 0))
    assert sum(tally.pages[0]) == tally.documents[0] > 0
    assert "most on" not in tally.describe() and "dense" in tally.describe()


# -- on the tiny model ---------------------------------------------------------------------------------


@pytest.fixture
def lib(cache_dir, tiny_model):
    from kvlocal.session import Session

    library = Session(str(tiny_model), threads=2)
    yield library
    library.close()


@pytest.mark.engine
def test_a_set_knows_the_cell_each_page_starts_at_and_its_reads_by_page(lib, tmp_path):
    pdf = load_document(write_pdf(tmp_path, PAGES))
    assert len(pdf.pages) == 3
    load = load_set(lib, [OTHER, pdf])
    span = load.spans[1]
    assert span.label == pdf.source and load.spans[0].pages == ()
    assert span.pages[0] == span.start and list(span.pages) == sorted(span.pages)
    assert span.pages[-1] < span.start + span.n_tokens
    for k, (cell, lines) in enumerate(zip(span.pages, PAGES)):
        # the page's first cell holds its first words (a token reaching over the break may hold its newlines)
        first = lib.span_text(cell, cell + 3).lstrip()
        assert first and lines[0].startswith(first)
        if k:  # and the cells before it end the page before
            assert PAGES[k - 1][-1].endswith(lib.span_text(cell - 3, cell).rstrip())
    assert [span.page_at(c) for c in span.pages] == [1, 2, 3] and span.page_at(span.end - 1) == 3

    tally = lib.read_tally()
    rows = 0
    for piece in lib.ask("which valve holds 40 litres?", route=Route(mode="geometric", top_k=2, region=64, focus="set"),
                         max_tokens=6, want_regions=True):
        tally.add(piece.stats)
        rows += piece.stats.rows_read if piece.stats else 0
    assert tally.steps and tally.total == rows
    assert tally.pages[0] == [] and len(tally.pages[1]) == 3
    assert sum(tally.pages[1]) == tally.documents[1] > 0
    line = tally.describe()
    assert f"{pdf.source} " in line and ("(most on p. " in line or "(most on pp. " in line)

    # the set's cells of the pages, relative to the body, are the single-document path's
    single = load_set(lib, [pdf])
    assert single.layout == "single"
    assert [c - single.spans[0].start for c in single.spans[0].pages] == [c - span.start for c in span.pages]


@pytest.mark.engine
@pytest.mark.asyncio
async def test_tiny_model_set_answer_names_documents_and_pages(cache_dir, tmp_path, tiny_model):
    from test_tui import QUESTION, notices, wait_for

    from kvlocal.session import Session
    from kvlocal.tui.app import KvlocalApp
    from kvlocal.tui.sources import SourcesList

    folder = tmp_path / "set"
    folder.mkdir()
    write_pdf(folder, PAGES, "a.pdf")
    (folder / "b.txt").write_text(OTHER.text)
    app = KvlocalApp([folder], session_factory=lambda progress: Session(str(tiny_model), threads=2,
                                                                        model_progress=progress), max_tokens=6)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.document is not None or (app.busy is None and len(notices(app)) > 1), 120)
        assert app.document is not None, notices(app)
        app.route = dataclasses.replace(app.route, mode="random")  # regions all over the set, both documents
        assert app.ask(QUESTION)
        await wait_for(pilot, lambda: app.busy is None and app.log_widget.entries[0].done)
        entry = app.log_widget.entries[0]
        # the per-document line under the answer's summary, documents by file name
        assert entry.reads_by_document.startswith("reads by document: ")
        assert "a.pdf" in entry.reads_by_document and str(folder) not in entry.reads_by_document
        assert str(entry.query_one("#reads-by-document").render()) == entry.reads_by_document
        # each listed region names its document, and its page in the PDF
        sources = app.query_one(SourcesList).sources
        assert sources
        for source in sources:
            start = source.region * 64
            span = app.session.document_at(start)
            if span is None:
                continue
            if not span.pages:
                assert source.snippet.startswith(f"[{Path(span.label).name}] "), source.snippet
                continue
            first, last = span.page_at(start), span.page_at(start + 63)  # a region can hold a page break
            want = f"[a.pdf p. {first}] " if first == last else f"[a.pdf pp. {first}–{last}] "
            assert source.snippet.startswith(want), source.snippet
        assert any(s.snippet.startswith("[a.pdf p") for s in sources)
        # the region view says where the highlighted source lies too
        index = next(i for i, s in enumerate(sources) if s.snippet.startswith("[a.pdf p"))
        app.query_one(SourcesList).highlighted = index
        await pilot.pause()
        assert app.heatmap.selected == sources[index].region
        assert sources[index].snippet[1:].split("]")[0] in str(app.query_one("#region-title").render())
