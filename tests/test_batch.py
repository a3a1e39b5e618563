"""Answers decoded together (kvlocal.batch) on the tiny model: with full attention, and with every region
selected, each answer of a batch is the answer `Session.ask` gives alone (text and tokens), answers join
and leave between steps, and room is bounded. Routed, with or without the selection memory and pins, an
answer decoded beside others is the answer decoded in a batch of its own, text and rows read (each keeps
to its own whole regions); beside `Session.ask`, whose question follows the documents in their last
region, it may read other regions."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

from kvlocal.batch import AnswerBatch  # noqa: E402
from kvlocal.errors import ContextOverflowError, UsageError  # noqa: E402
from kvlocal.ingest import Document  # noqa: E402
from kvlocal.library import load_set  # noqa: E402
from kvlocal.routing import Route  # noqa: E402
from kvlocal.session import Session  # noqa: E402


def words(tag: str, n: int = 120) -> str:
    return " ".join(f"{tag}{i} holds {i * 7 % 101} {tag}." for i in range(n))


QUESTIONS = ["what does alpha3 hold?", "what does alpha40 hold?", "which word follows alpha7?"]
ROUTED = Route(mode="geometric", top_k=2, region=64, shortlist=0, keep=0.0, pin=0)
REMEMBERING = Route(mode="geometric", top_k=3, region=64, shortlist=0, keep=0.9, pin=2)
EVERY = Route(mode="geometric", top_k=4096, region=64, shortlist=0, keep=0.0, pin=0)
FULL = Route(mode="full")
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=["one document", "a set"])
def session(request, tiny_model, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLOCAL_CACHE_DIR", str(tmp_path_factory.mktemp("batch-cache")))
        session = Session(str(tiny_model), threads=2, answers=3)
        docs = [Document(words("alpha"), "alpha.txt", "txt")]
        if request.param == "a set":
            docs.append(Document(words("bravo"), "bravo.txt", "txt"))
        load_set(session, docs)
        yield session
        session.close()


def alone(session: Session, route: Route, question: str):
    return session.answer(question, route=route, max_tokens=MAX_TOKENS)


def together(session: Session, route: Route, questions: list[str], join_after: int = 0):
    """Each question's summary, decoded in one batch; with `join_after` the last joins after that many steps."""
    batch = AnswerBatch(session, route)
    first, last = (questions[:-1], questions[-1:]) if join_after else (questions, [])
    handles = {batch.add(q, max_tokens=MAX_TOKENS): q for q in first}
    done, texts, steps = {}, {h: "" for h in handles}, 0
    while batch.open or last:
        if last and steps == join_after:
            handle = batch.add(last.pop(), max_tokens=MAX_TOKENS)
            handles[handle], texts[handle] = questions[-1], ""
        for step in batch.step():
            if step.piece is not None:
                texts[step.answer] += step.piece.text
            if step.summary is not None:
                done[handles[step.answer]] = step.summary
                assert step.summary.text == texts[step.answer]
        steps += 1
    batch.close()
    return done


@pytest.mark.parametrize("route", [ROUTED, REMEMBERING, FULL], ids=["routed", "memory-and-pins", "full"])
def test_each_answer_of_a_batch_is_its_answer_in_a_batch_of_its_own(session, route):
    expected = {q: together(session, route, [q])[q] for q in QUESTIONS}
    got = together(session, route, QUESTIONS)
    for q in QUESTIONS:
        assert got[q].text == expected[q].text, q
        assert got[q].n_answer_tokens == expected[q].n_answer_tokens > 0
        # its own regions only: the rows it gathers are the same; dense attention reads every answer's cells
        assert got[q].rows_read == expected[q].rows_read, q
        assert expected[q].rows_dense <= got[q].rows_dense
        if route.mode == "full":
            assert got[q].rows_read == got[q].rows_dense
        else:
            assert got[q].rows_read < got[q].rows_dense


def test_with_full_attention_a_batch_answers_as_ask(session):
    expected = {q: alone(session, FULL, q) for q in QUESTIONS}
    got = together(session, FULL, QUESTIONS)
    for q in QUESTIONS:
        assert got[q].text == expected[q].text, q
        assert got[q].n_answer_tokens == expected[q].n_answer_tokens


def test_every_region_selected_in_a_batch_is_dense_attention(session):
    dense = {q: alone(session, FULL, q).text for q in QUESTIONS}
    assert {q: s.text for q, s in together(session, EVERY, QUESTIONS).items()} == dense


def test_an_answer_joining_between_steps_is_its_answer_alone(session):
    expected = {q: alone(session, EVERY, q).text for q in QUESTIONS}
    got = together(session, EVERY, QUESTIONS, join_after=3)
    assert {q: s.text for q, s in got.items()} == expected


def test_the_session_answers_alone_after_a_batch(session):
    before = alone(session, ROUTED, QUESTIONS[0]).text
    together(session, ROUTED, QUESTIONS[1:])
    assert alone(session, ROUTED, QUESTIONS[0]).text == before


def test_a_full_batch_refuses_another_answer_until_one_ends(session):
    batch = AnswerBatch(session, ROUTED)
    for q in QUESTIONS:
        batch.add(q, max_tokens=MAX_TOKENS)
    assert not batch.can_take(10, MAX_TOKENS)
    with pytest.raises(ContextOverflowError):
        batch.add("one more?", max_tokens=MAX_TOKENS)
    while not any(step.summary for step in batch.step()):
        pass
    batch.add("one more?", max_tokens=MAX_TOKENS)
    batch.close()
    assert not batch.open


def test_a_session_of_one_answer_has_no_batch(tiny_model, cache_dir):
    single = Session(str(tiny_model), threads=2)
    single.load_document(words("alpha"), label="alpha")
    with pytest.raises(UsageError):
        AnswerBatch(single, ROUTED)
    single.close()
    with pytest.raises(UsageError):
        Session(str(tiny_model), answers=0)
