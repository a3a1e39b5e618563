"""Text hints: which cells a question's words name (kvlocal/hints.py), without an engine."""

from __future__ import annotations

import pytest

from kvlocal.errors import UsageError
from kvlocal.hints import FOLLOW, TextIndex, hint_cells, question_words
from kvlocal.route_settings import UNCALIBRATED_ROUTE
from kvlocal.routing import Route, RouteConfig, RouteFacts, resolve_route


def index_of(words: list[str]) -> TextIndex:
    """One word per cell (with its leading space), as a tokenizer of whole words would split."""
    return TextIndex.of(f" {w}".encode() for w in words)


def filler(n: int) -> list[str]:
    return [f"w{i % 50}" for i in range(n)]


def test_the_index_maps_words_to_the_cells_they_start_at():
    index = TextIndex.of([b"The", b" night", b"-shift", b" locker", b" at", b" Oslo", b"."])
    assert index.n_cells == 7
    assert index.words["night-shift"] == (1,)
    assert index.words["oslo"] == (5,)
    assert index.words["the"] == (0,)


def test_a_character_split_over_tokens_counts_to_the_cell_that_completes_it():
    e_acute = "é".encode()
    index = TextIndex.of([b" caf", e_acute[:1], e_acute[1:], b" ok"])
    assert index.words["café"] == (0,)  # the word starts in cell 0
    assert index.words["ok"] == (3,)


def test_the_region_holding_the_rare_key_word_is_hinted_with_the_tokens_after_it():
    words = filler(640)
    # four look-alike facts, one word apart, in regions 2, 4, 6 and 8 (64 cells each)
    for region, city in ((2, "oslo"), (4, "lyon"), (6, "porto"), (8, "turin")):
        at = region * 64 + 40
        words[at : at + 8] = ["locker", "at", "the", city, "depot", "opens", "with", "code"]
    index = index_of(words)
    cells = hint_cells(index, "Which code opens the locker at the Porto depot?", n=1, region=64)
    porto = 6 * 64 + 43
    assert cells == [porto, porto + 64]  # no sentence ends in this text: a region's length on
    assert {c // 64 for c in cells} == {6, 7}  # the value after the key may sit in the next region
    # a second hint needs a second region with a rare word: the look-alikes' words are in 4 of 10
    # regions here, common
    assert hint_cells(index, "Which code opens the locker at the Porto depot?", n=2, region=64) == cells
    # in a longer text they are rare, and the next best region is a look-alike
    index = index_of(words + filler(64 * 30))
    two = hint_cells(index, "Which code opens the locker at the Porto depot?", n=2, region=64)
    assert two[:2] == cells and two[2] // 64 in {2, 4, 8}


def test_the_sink_regions_are_not_hinted():
    """The prompt's own instructions sit in the sinks (always read): a question word found only there
    ("Answer with the code only") must not take the hint from the fact."""
    words = ["answer", "questions", "briefly", "locker", "at", "kyoto", "depot"] + filler(640)
    words[6 * 64 + 40 : 6 * 64 + 44] = ["locker", "at", "porto", "depot"]
    index = index_of(words)
    question = "Which locker at the Porto depot? Answer with the code only."
    assert hint_cells(index, question, n=1, region=64)[0] == 0  # without: the instructions' region ties and wins
    assert hint_cells(index, question, n=1, region=64, skip_regions=1)[0] == 6 * 64 + 42


def test_no_hint_without_a_rare_word():
    words = filler(640)
    index = index_of(words)
    assert hint_cells(index, "What is w3 about?", n=2, region=64) == []  # w3 is in every region
    assert hint_cells(index, "Where is Oslo?", n=2, region=64) == []  # not in the text
    assert hint_cells(index, "Where is the w3?", n=0, region=64) == []


def test_question_words_drop_the_stopwords_and_case():
    assert question_words("What is the code of the Oslo depot?") == {"code", "oslo", "depot"}


def test_hints_apply_to_geometric_routing_only_and_are_bounded():
    assert Route(mode="geometric", hints=1).hinted == 1
    assert Route(mode="window", hints=1).hinted == 0
    assert Route(mode="random", hints=1).hinted == 0
    with pytest.raises(UsageError):
        RouteConfig(hints=-1)


def test_a_fact_cut_by_a_region_boundary_beats_a_look_alike_that_fills_one_region():
    """Scored by whole regions, a look-alike that fills one region outscores the asked fact when a
    region boundary cuts the fact's sentence in two (the library's wrong-document hints); scored by
    the words within the sentence's reach of the rare word, the asked fact wins."""
    words = filler(64 * 40)
    words[2 * 64 + 10 : 2 * 64 + 17] = ["locker", "at", "the", "oslo", "depot", "opens", "code"]
    porto = 6 * 64 + 63  # the last cell of region 6: its sentence runs on into region 7
    words[porto - 3 : porto + 4] = ["locker", "at", "the", "porto", "depot", "opens", "code"]
    index = index_of(words)
    question = "Which code opens the locker at the Porto depot?"
    assert hint_cells(index, question, n=1, region=64, scope="region")[0] // 64 == 2
    cells = hint_cells(index, question, n=1, region=64)
    assert cells[0] == porto
    assert {c // 64 for c in cells} == {6, 7}
    with pytest.raises(ValueError):
        hint_cells(index, question, n=1, region=64, scope="page")


def test_two_places_in_one_region_make_one_hint():
    words = filler(64 * 40)
    words[5 * 64 + 2 : 5 * 64 + 5] = ["porto", "depot", "code"]
    words[5 * 64 + 30 : 5 * 64 + 33] = ["porto", "depot", "code"]
    words[9 * 64 + 2 : 9 * 64 + 5] = ["porto", "depot", "code"]
    cells = hint_cells(index_of(words), "The Porto depot code?", n=2, region=64)
    assert [c // 64 for c in cells[::2]] == [5, 9]


def test_a_route_makes_room_for_its_hinted_regions():
    def resolved(route: RouteConfig, cells: list[int]) -> Route:  # over a prefix of 40 regions of 64 cells
        return resolve_route(route, UNCALIBRATED_ROUTE, RouteFacts(1, 40 * 64, lambda n, region, skip: cells))

    route = RouteConfig(mode="geometric", top_k=1, hints=1, question="steps")
    runs_on = [10 * 64 + 60, 11 * 64 + 20]  # a hinted word's sentence runs on into the next region
    assert resolved(route, runs_on).top_k == 2 and resolved(route, runs_on).hint_cells == tuple(runs_on)
    assert resolved(route, [10 * 64 + 5, 10 * 64 + 29]).top_k == 1 and resolved(route, []).top_k == 1
    assert resolved(route, [5, 39 * 64 + 3]).top_k == 1  # the sinks and the window are read anyway
    wide = RouteConfig(mode="geometric", top_k=4, hints=1)
    assert resolved(wide, runs_on).top_k == 4
    # the pins stay what they were at the asked top-k
    pinned = RouteConfig(mode="geometric", top_k=1, pin=2, keep=0.9, question="dense", hints=1)
    assert resolved(pinned, []).pins == 1 and resolved(pinned, runs_on).pins == 1


def test_a_hint_reads_to_its_sentence_s_end_at_least_follow_and_at_most_a_region_on():
    index = TextIndex.of([b"The", b" Oslo", b" code", b" is", b" 42", b".", b" Next", b" one", b"\n", b"x"] + [b" w"] * 100)
    assert index.ends == (5, 8)
    assert index.follow_of(1, FOLLOW, 64) == 1 + FOLLOW  # the sentence ends sooner: FOLLOW on
    assert index.follow_of(1, 2, 64) == 5  # its end
    assert index.follow_of(6, 1, 64) == 8  # a line break ends it too
    assert index.follow_of(9, FOLLOW, 64) == 9 + 64  # no end after it: a region's length on
    decimal = TextIndex.of([b" pi", b" is", b" 3", b".", b"14", b" here", b".", b" x"])
    assert decimal.ends == (6,)  # a point inside a number ends nothing
    words = filler(64 * 20)
    words[5 * 64 + 10 : 5 * 64 + 16] = ["the", "porto", "code", "is", "cobalt-1234", "."]
    cells = hint_cells(index_of(words), "The Porto code?", n=1, region=64)
    assert cells == [5 * 64 + 11, 5 * 64 + 11 + FOLLOW]


def test_a_possessive_names_the_same_word():
    from kvlocal.hints import normal_word

    assert normal_word("Okafor's") == "okafor" and normal_word("Okafor\u2019s") == "okafor"
    assert normal_word("it's") == "it" and normal_word("'s") == "'s"
    index = TextIndex.of([b" Ms", b" Okafor", "\u2019s".encode(), b" contract"])
    assert index.words["okafor"] == (1,)
    assert "okafor" in question_words("Which clause of Ms Okafor's contract?")
