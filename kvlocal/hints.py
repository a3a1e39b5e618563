"""Text hints for geometric routing: the regions whose text holds the question's rarest words.

A region's key centroid is the mean of its 64 or so keys. Two regions that hold the same sentence
with one word changed (a clause in every contract of a folder, a log line with another host) score
alike, so the route cannot tell the asked fact from its look-alikes, and neither, at long range, can
dense attention (BENCHMARKS.md §6, "Several documents"). The question usually names the word that tells them
apart, and the session knows each cell's text. `hint_cells` scores each place of one of the
question's rare words by the question words within a sentence's reach of it (each weighted by how
few regions hold it) and names, for the best `n` places, the cell of that rare word and the cell its
sentence ends at (`FOLLOW` tokens to a region's length on: a fact's value follows its key, and may
cross into the next region). The engine reads the regions of those cells with every head in place
of as many top-k choices (llama_kv_route_set_hints, patch 0012); the route raises top-k to the
number of hinted regions where it is smaller (kvlocal.routing.resolve_route), so a value cut by a region
boundary is read whole, and counts what that costs like any other read.

This is a lexical index beside the geometric one, not a replacement: a question that shares no rare
word with the document gets no hint and is routed as before.
"""

from __future__ import annotations

import bisect
import codecs
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

WORD = re.compile(r"\w+(?:[-'\u2019]\w+)*")
# words too common in questions to say where an answer is
STOPWORDS = frozenset(
    "a about an and any are as at be been but by can could did do does for from had has have how i if in "
    "into is it its me my no not of on or our she he so than that the their them then there these they "
    "this those to us was we were what when where which while who whom whose why will with would you your".split()
)
FOLLOW = 24  # tokens after a hinted word that are read too, at least: the rest of its sentence
SENTENCE_END = re.compile(r"[.!?;](?=\s|$)|\n")
COMMON_SHARE = 0.125  # a word in more than this share of the regions is common: it ranks, it does not hint


@dataclass(frozen=True)
class TextIndex:
    """The words of a context's prefix (lower-cased) and the cells each starts at, ascending, and the
    cells where a sentence ends (a full stop, question or exclamation mark or semicolon before a space,
    or a line break)."""

    words: dict[str, tuple[int, ...]]
    n_cells: int
    ends: tuple[int, ...] = ()

    @classmethod
    def of(cls, pieces: Iterable[bytes]) -> TextIndex:
        """Index the prefix from each cell's token bytes (a character split over tokens counts to
        the cell that completes it)."""
        pieces = list(pieces)
        n_cells = len(pieces)
        text, char_cells = cell_text(pieces)
        words: dict[str, list[int]] = defaultdict(list)
        for match in WORD.finditer(text):
            cells = words[normal_word(match.group())]
            cell = char_cells[match.start()]
            if not cells or cells[-1] != cell:
                cells.append(cell)
        ends = sorted({char_cells[m.start()] for m in SENTENCE_END.finditer(text)})
        return cls({word: tuple(cells) for word, cells in words.items()}, n_cells, tuple(ends))

    def follow_of(self, cell: int, follow: int, most: int) -> int:
        """The cell a hint reads to from a word at `cell`: its sentence's end, at least `follow` and at
        most `most` cells on."""
        i = bisect.bisect_right(self.ends, cell)
        end = self.ends[i] if i < len(self.ends) else cell + most
        return cell + max(follow, min(most, end - cell))


def cell_text(pieces: Iterable[bytes], first: int = 0) -> tuple[str, list[int]]:
    """The text of cells' token bytes, and for each of its characters the cell it comes from
    (`first` for the first piece; a character split over tokens counts to the cell that completes it)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    chunks: list[str] = []
    char_cells: list[int] = []
    for cell, piece in enumerate(pieces, first):
        text = decoder.decode(piece)
        chunks.append(text)
        char_cells.extend([cell] * len(text))
    return "".join(chunks), char_cells


def normal_word(word: str) -> str:
    """A word as the index keeps it: lower-cased, a possessive's 's left off ("Belfast's": belfast)."""
    word = word.lower().replace("\u2019", "'")
    return word[:-2] if word.endswith("'s") and len(word) > 2 else word


def question_words(question: str) -> set[str]:
    return {normal_word(word) for word in WORD.findall(question)} - STOPWORDS


RULE = "sentence"  # the rule hint_cells applies (eval rows record it: rows before it was recorded ran "region")
SCOPES = ("sentence", "region")  # what a place's score counts: words within `follow` tokens, or in its region


def hint_cells(index: TextIndex, question: str, n: int, region: int, follow: int = FOLLOW,
               skip_regions: int = 0, scope: str = "sentence") -> list[int]:
    """Cells to hint for a question: for each of the `n` best places of a rare question word (in
    distinct regions), the cell of that word and the cell its sentence ends at, at least `follow` and
    at most a region's length later (TextIndex.follow_of); [] when no word is rare. A place is scored
    by the question words found within `follow` tokens of it, each weighted by how few regions hold it: the sentence around the word, wherever a region boundary cuts it (a
    score by whole regions let a look-alike that fills one region beat the asked fact cut in two).
    The first `skip_regions` regions (the sinks, always read, where the prompt's instructions sit)
    are not hinted. `scope` "region" scores a place by the words of its whole region instead (the
    rule before the sentence's reach; `kvlocal lab hints --hint-scope` compares them)."""
    if scope not in SCOPES:
        raise ValueError(f"unknown hint scope {scope!r}")
    if n <= 0 or index.n_cells == 0:
        return []
    n_regions = -(-index.n_cells // region)
    cells_of = {word: index.words[word] for word in question_words(question) if word in index.words}
    if not cells_of:
        return []
    regions_of = {word: len({cell // region for cell in cells}) for word, cells in cells_of.items()}
    idf = {word: math.log(1 + (n_regions - k + 0.5) / (k + 0.5)) for word, k in regions_of.items()}
    common = max(1.0, COMMON_SHARE * n_regions)

    def near(cells: tuple[int, ...], cell: int) -> bool:
        lo, hi = (cell - follow, cell + follow) if scope == "sentence" else (cell // region * region,
                                                                              cell // region * region + region - 1)
        i = bisect.bisect_left(cells, lo)
        return i < len(cells) and cells[i] <= hi

    places: list[tuple[float, float, int]] = []  # (score, the word's idf, cell)
    for word, cells in cells_of.items():
        if regions_of[word] > common:
            continue  # a common word ranks places; it does not make one
        for cell in cells:
            if cell // region < skip_regions:
                continue
            score = sum(idf[w] for w, ws in cells_of.items() if near(ws, cell))
            places.append((score, idf[word], cell))
    places.sort(key=lambda p: (-p[0], -p[1], p[2]))
    hinted: list[int] = []
    taken: set[int] = set()
    for _, _, cell in places:
        if len(taken) == n:
            break
        if cell // region in taken:
            continue
        taken.add(cell // region)
        hinted += [cell, index.follow_of(cell, follow, max(follow, region))]
    return hinted
