"""Text hints for geometric routing: the regions whose text holds the question's rarest words.

A region's key centroid is the mean of its 64 or so keys. Two regions that hold the same sentence
with one word changed (a clause in every contract of a folder, a log line with another host) score
alike, so the route cannot tell the asked fact from its look-alikes, and neither, at long range, can
dense attention (BENCHMARKS.md section 7). The question usually names the word that tells them
apart, and the session knows each cell's text. `hint_cells` ranks the regions that hold one of the
question's rare words by the question words they share (each weighted by how few regions hold it)
and names, for the best `n`, the cell of that rare word and the cell `FOLLOW` tokens after it (a
fact's value follows its key, and may cross into the next region). The engine reads those regions
with every head in place of as many top-k choices (llama_kv_route_set_hints, patch 0012), so a hinted
step reads as many bytes as an unhinted one.

This is a lexical index beside the geometric one, not a replacement: a question that shares no rare
word with the document gets no hint and is routed as before.
"""

from __future__ import annotations

import codecs
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

WORD = re.compile(r"\w+(?:[-']\w+)*")
# words too common in questions to say where an answer is
STOPWORDS = frozenset(
    "a about an and any are as at be been but by can could did do does for from had has have how i if in "
    "into is it its me my no not of on or our she he so than that the their them then there these they "
    "this those to us was we were what when where which while who whom whose why will with would you your".split()
)
FOLLOW = 24  # tokens after a hinted word that are read too: the rest of its sentence
COMMON_SHARE = 0.125  # a word in more than this share of the regions is common: it ranks, it does not hint


@dataclass(frozen=True)
class TextIndex:
    """The words of a context's prefix (lower-cased) and the cells each starts at, ascending."""

    words: dict[str, tuple[int, ...]]
    n_cells: int

    @classmethod
    def of(cls, pieces: Iterable[bytes]) -> TextIndex:
        """Index the prefix from each cell's token bytes (a character split over tokens counts to
        the cell that completes it)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        chunks: list[str] = []
        char_cells: list[int] = []
        n_cells = 0
        for cell, piece in enumerate(pieces):
            text = decoder.decode(piece)
            chunks.append(text)
            char_cells.extend([cell] * len(text))
            n_cells = cell + 1
        words: dict[str, list[int]] = defaultdict(list)
        for match in WORD.finditer("".join(chunks)):
            cells = words[match.group().lower()]
            cell = char_cells[match.start()]
            if not cells or cells[-1] != cell:
                cells.append(cell)
        return cls({word: tuple(cells) for word, cells in words.items()}, n_cells)


def question_words(question: str) -> set[str]:
    return {word.lower() for word in WORD.findall(question)} - STOPWORDS


def hint_cells(index: TextIndex, question: str, n: int, region: int, follow: int = FOLLOW,
               skip_regions: int = 0) -> list[int]:
    """Cells to hint for a question: for each of the `n` best regions holding a rare question word,
    the cell of its rarest such word and the cell `follow` tokens later; [] when no word is rare.
    The first `skip_regions` regions (the sinks, always read, where the prompt's instructions sit)
    are not hinted."""
    if n <= 0 or index.n_cells == 0:
        return []
    n_regions = -(-index.n_cells // region)
    regions_of = {word: sorted({cell // region for cell in index.words[word]})
                  for word in question_words(question) if word in index.words}
    if not regions_of:
        return []
    idf = {word: math.log(1 + (n_regions - len(rs) + 0.5) / (len(rs) + 0.5)) for word, rs in regions_of.items()}
    common = max(1.0, COMMON_SHARE * n_regions)
    score: dict[int, float] = defaultdict(float)
    anchor: dict[int, tuple[float, int]] = {}  # region -> (idf, cell) of its rarest rare word
    for word, regions in regions_of.items():
        for r in regions:
            score[r] += idf[word]
        if len(regions) > common:
            continue
        for cell in index.words[word]:
            r = cell // region
            if r < skip_regions:
                continue
            if r not in anchor or idf[word] > anchor[r][0]:
                anchor[r] = (idf[word], cell)
    best = sorted(anchor, key=lambda r: (-score[r], r))[:n]
    cells: list[int] = []
    for r in best:
        cell = anchor[r][1]
        cells += [cell, cell + follow]
    return cells
