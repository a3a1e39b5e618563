"""Sessions on the tiny model: two at once in one process, and an answer abandoned part-way."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

from kvlocal.routing import Route  # noqa: E402
from kvlocal.session import AnswerPiece, Session  # noqa: E402

TEXT_A = " ".join(f"entry {i}: value {i * 7 % 101}." for i in range(60))
TEXT_B = " ".join(f"line {i} says {i * 13 % 97} apples." for i in range(60))
ROUTE = Route(mode="geometric", top_k=2, region=64)


def answer(session: Session, question: str) -> str:
    return session.answer(question, route=ROUTE, max_tokens=12).text


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(tmp_path))


def test_two_sessions_in_one_process_do_not_disturb_each_other(cache, tiny_model):
    """Each session answers as it does alone, whatever the other did in between, even with
    different centroid blocks (chosen per session when its context is created)."""
    solo_a = Session(str(tiny_model), threads=2, centroid_block=16)
    solo_a.load_document(TEXT_A, use_cache=False)
    want_a = answer(solo_a, "which value?")
    solo_a.close()
    solo_b = Session(str(tiny_model), threads=2, centroid_block=4)
    solo_b.load_document(TEXT_B, use_cache=False)
    want_b = answer(solo_b, "how many apples?")
    solo_b.close()

    a = Session(str(tiny_model), threads=2, centroid_block=16)
    b = Session(str(tiny_model), threads=2, centroid_block=4)
    try:
        a.load_document(TEXT_A, use_cache=False)
        b.load_document(TEXT_B, use_cache=False)
        # each context's KV cache keeps the block its session asked for (a context parameter)
        assert [s.context.route_centroid_block() for s in (a, b)] == [16, 4]
        assert answer(a, "which value?") == want_a
        assert answer(b, "how many apples?") == want_b
        assert answer(a, "which value?") == want_a  # after b's steps, a still routes over its own cache
    finally:
        a.close()
        b.close()


def test_an_abandoned_answer_leaves_the_session_usable(cache, tiny_model):
    session = Session(str(tiny_model), threads=2)
    try:
        session.load_document(TEXT_A, use_cache=False)
        want = answer(session, "which value?")
        stream = session.ask("which value?", route=ROUTE, max_tokens=12)
        first = [next(stream), next(stream)]
        assert all(isinstance(p, AnswerPiece) for p in first)
        stream.close()  # the caller walks away after two tokens
        assert answer(session, "which value?") == want  # the next question starts from the document again
        other = session.ask("which value?", route=ROUTE, max_tokens=12)
        next(other)
        del other  # dropped without close(): the generator is finalised, the lock released
        assert answer(session, "which value?") == want
    finally:
        session.close()


def test_the_question_pass_decides_how_the_question_reads_the_document(cache, tiny_model):
    """steps: one routed step per question token; dense: one batch that reads the whole cache once;
    routed: one batch that reads its own regions once. The answer's steps are routed in all three,
    and the next document's prefill stays dense after a routed question."""
    text = " ".join(f"entry {i}: value {i * 7 % 101}." for i in range(150))
    session = Session(str(tiny_model), threads=2)

    def run(question_pass):
        route = Route(mode="geometric", top_k=2, region=64, question=question_pass, question_top_k=3, pin=0)
        answer = session.ask("which value?", route=route, max_tokens=4)
        answer_steps = [piece.stats for piece in answer if piece.stats is not None]
        summary = answer.summary()
        # what the question read, and what it would read densely
        return summary, (summary.bytes_read - sum(st.bytes_read for st in answer_steps),
                         summary.bytes_dense - sum(st.bytes_dense for st in answer_steps))

    try:
        session.load_document(text, use_cache=False)
        (steps, _), (dense, dense_q), (routed, routed_q) = run("steps"), run("dense"), run("routed")
        assert steps.n_question_tokens > 1 and steps.steps == steps.n_question_tokens + steps.n_answer_tokens
        for summary in (dense, routed):
            assert summary.steps == 1 + summary.n_answer_tokens
            assert not summary.fallback  # a dense question batch is a choice, not a fallback
        assert dense_q[0] == dense_q[1] == routed_q[1] > 0  # the whole cache, once
        assert 0 < routed_q[0] < routed_q[1]  # its regions (and centroids), once
        session.load_document(text + " more.", use_cache=False)
        st = session.context.read_stats()
        assert st.n_layer_routed == 0 and st.rows_read == st.rows_dense  # the prefill read densely
    finally:
        session.close()


def test_a_prefill_writes_the_same_state_whatever_the_context_size(cache, tiny_model):
    """The same document prefilled in contexts of different sizes (and sequences) gives the same K/V
    bytes, so one saved state serves them all: found by `--ctx N` and by a session of several answers,
    which answer as the fresh prefill does."""
    states, answers = [], []
    for n_ctx, n_answers in ((None, 1), (4096, 1), (None, 3)):
        session = Session(str(tiny_model), n_ctx=n_ctx, threads=2, answers=n_answers)
        session.load_document(TEXT_A, use_cache=False)
        states.append(session.kv_state())
        answers.append(answer(session, "what is entry 3?"))
        session.close()
    assert states[0] == states[1] == states[2]
    first = Session(str(tiny_model), threads=2)
    saved = first.load_document(TEXT_A)
    assert not saved.cache_hit and saved.saved
    first.close()
    for n_ctx, n_answers in ((4096, 1), (None, 3)):
        session = Session(str(tiny_model), n_ctx=n_ctx, threads=2, answers=n_answers)
        loaded = session.load_document(TEXT_A)
        assert loaded.cache_hit and loaded.n_ctx != saved.n_ctx, (n_ctx, n_answers)
        assert answer(session, "what is entry 3?") == answers[0]
        session.close()
