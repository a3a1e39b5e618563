"""--focus hinted on the tiny model: a set's answer reads only the document of the question's best hint,
exactly as if the other documents were not there; without a hint, in the parallel layout and on one
document it reads what it read before; and the set is left as it was."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

pytestmark = pytest.mark.engine

from kvlocal import library  # noqa: E402
from kvlocal.errors import UsageError  # noqa: E402
from kvlocal.ingest import Document  # noqa: E402
from kvlocal.library import load_set  # noqa: E402
from kvlocal.routing import Route, RouteConfig  # noqa: E402
from kvlocal.session import STAGING_SEQ, Session  # noqa: E402

_lines = [f"row {i} holds {i * 5 % 89} coins." for i in range(40)]
_lines[20] = "row 20 holds the zanzibar ledger code 4242."
Z = Document(" ".join(_lines), "z.txt", "txt")
# two documents of one padded length that differ in every number: what a focused answer must not see
B = Document(" ".join(f"line {i} says {i * 13 % 97} apples." for i in range(60)), "b.txt", "txt")
C = Document(" ".join(f"line {i} says {i * 11 % 97} apples." for i in range(60)), "c.txt", "txt")
HINTED = "Which ledger code does Zanzibar hold?"
FOCUS = RouteConfig(mode="geometric", top_k=2, region=64, focus="hinted")


@pytest.fixture
def lib(cache_dir, tiny_model):
    session = Session(str(tiny_model), threads=2)
    yield session
    session.close()


def _padded_cells(session: Session, doc: Document) -> int:
    n = len(session.tokenize(doc.text.strip(), bos=False))
    return n + (-n % library.LAYOUT_UNIT)


def _focused(session: Session, route: RouteConfig, question: str = HINTED):
    """The answer's summary, its tokens, and the logits after its last step."""
    answer = session.ask(question, route=route, max_tokens=6, want_regions=True)
    pieces = list(answer)
    return answer.summary(), [p.token for p in pieces], session.context.last_logits().copy()


@pytest.mark.parametrize("mode", ["full", "geometric"])
def test_a_focused_answer_does_not_depend_on_the_other_documents(lib, mode):
    """The exact oracle: the same document first in two sets whose second documents differ in every
    number (the same padded length, so every cell index is the same) answers token for token alike, and
    reads the same rows, in full attention and routed."""
    assert _padded_cells(lib, B) == _padded_cells(lib, C)
    route = replace(FOCUS, mode=mode)
    answers = []
    for other in (B, C):
        load_set(lib, [Z, other])
        summary, tokens, logits = _focused(lib, route)
        assert summary.focus == "z.txt" and summary.route.focus == "hinted"
        answers.append((tokens, summary.rows_read, summary.bytes_read, summary.region_reads, logits.tobytes()))
    assert answers[0] == answers[1]
    # while the same question over the whole set does see the other document
    unfocused = []
    for other in (B, C):
        load_set(lib, [Z, other])
        summary = lib.answer(HINTED, route=replace(route, focus="set"), max_tokens=6)
        assert summary.focus == "" and summary.route.focus == "set"
        unfocused.append(lib.context.last_logits().copy())
    assert not np.array_equal(unfocused[0], unfocused[1])


def test_a_focused_route_reads_only_its_document_the_head_and_its_own_cells(lib):
    load = load_set(lib, [B, Z])  # the hinted document second: the first is the one not to read
    summary, _, _ = _focused(lib, FOCUS)
    assert summary.focus == "z.txt"
    other = load.spans[0]
    regions = {region for (_, region) in summary.region_reads}
    assert regions and not any(other.start <= r * 64 < other.end for r in regions)
    assert any(load.spans[1].start <= r * 64 < load.spans[1].end for r in regions)
    # routed as one document of the cells it sees: the shortlist follows them, not the set's
    one = lib.resolve_answer_route(HINTED, RouteConfig(top_k=2, region=64), n_documents=1)
    assert summary.route.top_k >= 2 and summary.reduction > 1
    assert one.focus == "set"


def test_the_set_is_as_it_was_after_a_focused_answer(lib):
    load_set(lib, [Z, B])
    before = lib.answer(HINTED, route=replace(FOCUS, focus="set"), max_tokens=6)
    logits_before = lib.context.last_logits().copy()
    focused = lib.answer(HINTED, route=FOCUS, max_tokens=6)
    assert focused.focus == "z.txt"
    again = lib.answer(HINTED, route=replace(FOCUS, focus="set"), max_tokens=6)
    assert again.text == before.text
    np.testing.assert_array_equal(lib.context.last_logits(), logits_before)
    # the focused answer's sequence holds nothing once the next answer started
    from kvlocal.engine import llama_cpp

    module = llama_cpp()
    assert module.llama_memory_seq_pos_max(module.llama_get_memory(lib.context.raw_context), STAGING_SEQ) == -1
    # and two focused answers in a row answer alike
    assert lib.answer(HINTED, route=FOCUS, max_tokens=6).text == focused.text


def test_the_whole_set_is_read_where_the_focus_cannot_apply(lib):
    load_set(lib, [Z, B])
    plain = lib.answer("Which value?", route=FOCUS, max_tokens=2)  # no rare word: no hint, no focus
    assert plain.focus == "" and plain.route.focus == "set"
    load_set(lib, [Z])  # one document: nothing to focus on
    assert lib.answer(HINTED, route=FOCUS, max_tokens=2).focus == ""


@pytest.mark.parametrize("mode", ["full", "geometric"])
def test_a_focused_answer_in_the_parallel_layout_is_the_same_as_in_the_consecutive(lib, mode):
    """Where the documents share positions, the focused document's cells are shared by cell (patch
    0023): the document first in the set has the same positions in both layouts, so the focused answer
    is the same token for token, whatever sits beside it."""
    route = replace(FOCUS, mode=mode)
    got = []
    for layout, other in (("consecutive", B), ("parallel", B), ("parallel", C)):
        load_set(lib, [Z, other], layout=layout)
        summary, tokens, logits = _focused(lib, route)
        assert summary.focus == "z.txt"
        got.append((tokens, logits.tobytes()))
    assert got[0] == got[1] == got[2]


def test_a_focus_is_one_of_the_known_ones():
    with pytest.raises(UsageError, match="focus") as exc:
        RouteConfig(focus="nearest")
    assert exc.value.setting == "focus"
    assert "hint" in Route(mode="full", focus="hinted").describe()
    assert "hint" not in Route(mode="geometric", focus="set").describe()
