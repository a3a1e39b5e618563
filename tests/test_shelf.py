"""A shelf (kvlocal.shelf): several documents side by side in one context, each in its own sequence and
cells, so that answers about different documents decode in one batch. On the tiny model: each answer of
a mixed batch is its answer decoded in a batch of its own (text, tokens and rows read), with and without
the selection memory and pins; with every region selected it is dense attention over its document; with
full attention it is `Session.ask` on that document alone; every region it gathers lies in its own
document's cells or its own question and answer; a shelf's documents are saved and found under the
keys `ask` uses; and a server started with named documents and --batch decodes requests about different
ones together."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

pytestmark = pytest.mark.engine

from kvlocal.batch import AnswerBatch  # noqa: E402
from kvlocal.errors import UsageError  # noqa: E402
from kvlocal.ingest import Document  # noqa: E402
from kvlocal.routing import Route  # noqa: E402
from kvlocal.session import Session  # noqa: E402
from kvlocal.shelf import load_shelf, plan_shelf  # noqa: E402


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i} holds {i * 7 % 101} {tag}." for i in range(n))


# documents of different lengths: their runs of cells, and their answers' positions, differ
DOCS = [Document(words("alpha", 40), "alpha.txt", "txt"), Document(words("bravo", 20), "bravo.txt", "txt"),
        Document(words("charlie", 50), "charlie.txt", "txt")]
ASKED = [(0, "what does alpha3 hold?"), (1, "what does bravo14 hold?"), (2, "which word follows charlie7?"),
         (0, "what does alpha30 hold?")]
ROUTED = Route(mode="geometric", top_k=2, region=64, shortlist=4, keep=0.0, pin=0)
REMEMBERING = Route(mode="geometric", top_k=3, region=64, shortlist=4, keep=0.9, pin=2)
BUDGETED = Route(mode="geometric", top_k=2, region=64, shortlist=4, keep=0.0, pin=0, layer_top_k="0=3")
EVERY = Route(mode="geometric", top_k=4096, region=64, shortlist=0, keep=0.0, pin=0)
FULL = Route(mode="full")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def shelf(tiny_model, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLOCAL_CACHE_DIR", str(tmp_path_factory.mktemp("shelf-cache")))
        session = Session(str(tiny_model), threads=2, answers=4)
        load = load_shelf(session, DOCS, region=64)
        yield session, load
        session.close()


def decode(session: Session, route: Route, asked: list[tuple[int, str]], prefixes) -> list:
    """The summary of each (document, question) of `asked`, decoded in one batch, with the cells each
    answer kept and the regions each step read (by the engine's per-sequence counts)."""
    batch = AnswerBatch(session, route)
    handles = [batch.add(q, max_tokens=MAX_TOKENS, want_regions=True, prefix=prefixes[d]) for d, q in asked]
    cells = {h: batch.open[h].cells for h in handles}
    regions = {h: set() for h in handles}
    done = {}
    while batch.open:
        for step in batch.step():
            if step.piece is not None and step.piece.stats is not None:
                regions[step.answer].update(int(r) for r in step.piece.stats.regions.ravel() if r >= 0)
            if step.summary is not None:
                done[step.answer] = step.summary
    batch.close()
    return [(done[h], cells[h], regions[h]) for h in handles]


@pytest.mark.parametrize("route", [ROUTED, REMEMBERING, BUDGETED, FULL],
                         ids=["routed", "memory-and-pins", "layer-budgets", "full"])
def test_answers_about_different_documents_decode_together_as_each_alone(shelf, route):
    session, load = shelf
    alone = [decode(session, route, [a], load.prefixes)[0][0] for a in ASKED]
    together = decode(session, route, ASKED, load.prefixes)
    for (d, q), expected, (got, _, _) in zip(ASKED, alone, together):
        assert got.text == expected.text, q
        assert got.n_answer_tokens == expected.n_answer_tokens > 0
        assert got.rows_read == expected.rows_read, q


def test_each_answer_gathers_only_its_own_documents_cells(shelf):
    session, load = shelf
    runs = [(p.first_cell, p.first_cell + p.run) for p in load.prefixes]
    assert all(a[1] <= b[0] for a, b in zip(runs, runs[1:]))  # side by side, no overlap
    for (d, q), (summary, cells, regions) in zip(ASKED, decode(session, ROUTED, ASKED, load.prefixes)):
        assert regions, q
        own = [runs[d], cells]
        for region in regions:
            lo, hi = region * ROUTED.region, (region + 1) * ROUTED.region
            assert any(a <= lo and hi <= b for a, b in own), (q, region, own)


def test_every_region_selected_is_full_attention_over_its_document(shelf):
    session, load = shelf
    every = decode(session, EVERY, ASKED, load.prefixes)
    full = decode(session, FULL, ASKED, load.prefixes)
    assert [s.text for s, _, _ in every] == [s.text for s, _, _ in full]


def test_full_attention_on_the_shelf_answers_as_ask_on_the_document_alone(shelf, tiny_model):
    session, load = shelf
    got = decode(session, FULL, ASKED, load.prefixes)
    alone = Session(str(tiny_model), threads=2)
    try:
        for (d, q), (summary, _, _) in zip(ASKED, got):
            result = alone.load_document(DOCS[d].text, label=DOCS[d].source)
            assert result.cache_hit  # the shelf saved it under the key `ask` looks for
            assert alone.answer(q, route=FULL, max_tokens=MAX_TOKENS).text == summary.text, q
    finally:
        alone.close()


@pytest.mark.parametrize("route", [ROUTED, FULL], ids=["routed", "full"])
def test_an_answer_counts_and_reads_alike_whatever_else_is_on_the_shelf(shelf, tiny_model, route):
    """The same question about alpha on a shelf of three documents (alpha first) and on one of two
    (alpha after bravo, so at other cells): the same text, rows read and dense rows; the dense figure is
    the cells the answer sees (its document's and its own), and full attention reads those only."""
    session, load = shelf
    (big, _, _), = decode(session, route, [ASKED[0]], load.prefixes)
    other = Session(str(tiny_model), threads=2, answers=2)
    try:
        small = load_shelf(other, [DOCS[1], DOCS[0]], region=64)
        assert small.prefixes[1].first_cell != load.prefixes[0].first_cell
        (got, _, _), = decode(other, route, [(1, ASKED[0][1])], small.prefixes)
    finally:
        other.close()
    assert got.text == big.text and got.n_answer_tokens == big.n_answer_tokens
    assert (got.rows_read, got.rows_dense, got.bytes_dense) == (big.rows_read, big.rows_dense, big.bytes_dense)
    if route is FULL:
        assert big.rows_read == big.rows_dense and big.bytes_read == big.bytes_dense


def test_the_shelf_loads_from_the_cache_and_an_answer_names_its_document(shelf, tiny_model):
    session, first = shelf
    again = Session(str(tiny_model), threads=2, answers=2)
    try:
        load = load_shelf(again, DOCS[:2], region=64)
        assert load.cache_hits == 2
        assert [p.n_prefix for p in load.prefixes] == [p.n_prefix for p in first.prefixes[:2]]
        batch = AnswerBatch(again, ROUTED)
        with pytest.raises(UsageError, match="names the document"):
            batch.add("what does alpha3 hold?")
        with pytest.raises(UsageError, match="not on the session's shelf"):
            batch.add("what does alpha3 hold?", prefix=first.prefixes[0])
        with pytest.raises(UsageError, match="kvlocal.batch"):
            again.answer("what does alpha3 hold?")
        # a document loaded alone takes the shelf's place: the session answers as before
        again.load_document(DOCS[1].text, label=DOCS[1].source)
        assert not again.shelf and again.answer("what does bravo4 hold?", max_tokens=4).n_answer_tokens > 0
    finally:
        again.close()


def test_an_answer_whose_route_sets_the_engine_otherwise_waits(shelf):
    """The engine's route is one per batch but for each sequence's hinted cells: a route with another
    top-k (a hint can raise it) or pin count does not join; one with other hinted cells does."""
    session, load = shelf
    batch = AnswerBatch(session, ROUTED)
    try:
        batch.add(ASKED[0][1], max_tokens=MAX_TOKENS, prefix=load.prefixes[0])
        assert batch.takes_route(replace(ROUTED, hint_cells=(70,)))
        assert batch.can_take(8, MAX_TOKENS, replace(ROUTED, hint_cells=(70,)))
        for other in (replace(ROUTED, top_k=3), replace(ROUTED, pin=2), FULL):
            assert not batch.takes_route(other) and not batch.can_take(8, MAX_TOKENS, other)
    finally:
        batch.close()


def test_a_worker_loads_the_asked_document_first_and_the_rest_while_idle(tiny_model, cache_dir):
    """A job about a shelf document not loaded yet waits for that document only; the others load one
    at a time as idle work, which ends once the server stops."""
    from kvlocal.routing import DEFAULT_ROUTE
    from kvlocal.serve.scheduler import Job, Worker

    lines: list[str] = []
    session = Session(str(tiny_model), threads=2, answers=2)
    try:
        worker = Worker(session, max_kv=None, log=lines.append, audit=False, route=DEFAULT_ROUTE, shelf=tuple(DOCS))
        assert not worker.shelf_ready
        records = []
        loop = asyncio.new_event_loop()
        worker.run_batch(Job([DOCS[2]], "which word follows charlie7?", 4, loop=loop), lambda can_join: [],
                         lambda job, record: records.append(record))
        loop.close()
        assert [r.outcome for r in records] == ["done"]
        assert [p.label for p in session.shelf.values()] == ["charlie.txt"] and session.shelf_places == 3
        assert worker.load_next() and len(session.shelf) == 2 and not worker.shelf_ready
        worker.cancel_loads.set()  # the server stops
        assert not worker.load_next() and len(session.shelf) == 2
        worker.cancel_loads.clear()
        assert worker.load_next() and worker.shelf_ready and not worker.load_next()
        assert [p.label for p in sorted(session.shelf.values(), key=lambda p: p.seq)] == [d.source for d in DOCS]
        assert any(line.startswith("shelf ready: 3 of 3 documents") for line in lines)
    finally:
        session.close()


def done_answer(job, loop) -> tuple[str, int]:
    """The text of the answer the worker sent `job` (its events, delivered on `loop`) and the KV rows
    its steps read."""
    loop.run_until_complete(asyncio.sleep(0))
    events = [job.events.get_nowait() for _ in range(job.events.qsize())]
    [result] = [value for kind, value in events if kind == "done"]
    return result.text, result.reads["rows_read"]


def test_a_document_is_prefilled_between_the_steps_of_answers_about_others(tiny_model, cache_dir):
    """A request about a shelf document not loaded yet, taken while an answer about another decodes:
    its document is prefilled between that answer's steps (ubatch by ubatch), and both answers are
    the ones each gets decoded alone (text and rows read: the steps between keep their route)."""
    from kvlocal.routing import DEFAULT_ROUTE
    from kvlocal.serve.scheduler import Job, Worker

    long_doc = Document(words("delta", 60), "delta.txt", "txt")
    lines: list[str] = []
    session = Session(str(tiny_model), threads=2, answers=2, n_batch=64)
    loop = asyncio.new_event_loop()
    try:
        worker = Worker(session, max_kv=None, log=lines.append, audit=False, route=DEFAULT_ROUTE,
                        shelf=(DOCS[0], long_doc))
        assert worker.load_next() and worker.load_next() and not worker.shelf_ready  # alpha only

        def asked():
            return (Job([DOCS[0]], "Write every alpha sentence out.", 40, loop=loop),
                    Job([long_doc], "what does delta9 hold?", 6, loop=loop))

        first, later = asked()
        handed: list = []

        def joining(can_join):
            if not handed and can_join(later):
                handed.append(later)
                return [later]
            return []

        worker.run_batch(first, joining, lambda job, record: None)
        assert handed and worker.shelf_ready, lines
        [line] = [line for line in lines if "decode steps of the other answers" in line]
        assert int(line.split(": ")[1].split()[0]) >= 2, line
        together = [done_answer(first, loop), done_answer(later, loop)]
        alone = []
        for job in asked():
            worker.run_batch(job, lambda can_join: [], lambda job, record: None)
            alone.append(done_answer(job, loop))
        assert together == alone
    finally:
        loop.close()
        session.close()


def test_plan_keeps_what_fits_the_kv_limit(shelf):
    session, _ = shelf
    chosen, notes = plan_shelf(session, DOCS, None)
    assert chosen == DOCS and notes == []
    chosen, notes = plan_shelf(session, DOCS, 1)
    assert chosen == [] and len(notes) == 3 and "KV limit" in notes[0]


def test_a_server_decodes_requests_about_different_named_documents_together(tiny_model, cache_dir, tmp_path):
    """Requests about three named documents, queued while the worker is held, decode in one batch, each
    reading only its own document's cells, and answer as the same requests sent one at a time do."""
    from test_serve import ask_body, serving

    for doc in DOCS:
        (tmp_path / doc.source).write_text(doc.text)
    asked = [(0, "what does alpha3 hold?"), (1, "what does bravo9 hold?"), (2, "which word follows charlie12?")]

    def body(d: int, q: str) -> dict:
        return ask_body(question=q, max_tokens=6, documents=[DOCS[d].source])

    sources = [tmp_path / doc.source for doc in DOCS]
    with serving(tiny_model, sources, answers=3) as running, ThreadPoolExecutor(3) as pool:
        assert running.scheduler.worker.shelf_documents
        # the server loads its shelf once started, before any request
        assert running.scheduler.wait_for(lambda s: s.worker.shelf_ready, 120)
        assert running.scheduler.worker.session.shelf_places == 3 and len(running.scheduler.worker.session.shelf) == 3
        running.scheduler.hold()
        futures = []
        for i, (d, q) in enumerate(asked):
            futures.append(pool.submit(running.post, body(d, q)))
            assert running.scheduler.wait_for(lambda s, n=i + 1: s.waiting == n, 60)
        running.scheduler.release()
        replies = [f.result().json() for f in futures]
        records = [running.record(r["id"]) for r in replies]
        alone = [running.post(body(d, q)).json() for d, q in asked]  # one at a time
    assert all(r.outcome == "done" for r in records)
    assert max(r.answered_beside for r in records) == 2
    for record in records:
        assert record.read_texts
        tag = record.documents[0].rsplit("/", 1)[-1].split(".")[0]
        assert all(label.endswith(f"{tag}.txt") and tag in text for label, text in record.read_texts)
    for reply, (d, q) in zip(replies, asked):
        reads = reply["kv_reads"]["documents"]
        assert [r["document"] for r in reads] == [str(tmp_path / DOCS[d].source)]
    assert [r["choices"][0]["message"]["content"] for r in replies] == \
        [r["choices"][0]["message"]["content"] for r in alone]
