"""Look-alike facts spread over a set of documents, for `kvlocal eval library`.

A set case is N documents, each its own haystack, holding the same fact sentence with one key word
changed (a depot's city, a contract party, a host, a year: the onekey shapes, shape = seed mod 4), as
the same clause recurs across a set of contracts. The codes share their word and often their first
digits. Every fact is asked once.

Document i of seed s is the same text whatever the set's size (its keys and codes are drawn from one
pool per seed), so the first four documents of a 16-document set are the 4-document set and their
cached states serve both.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from kvlocal.evals.haystack import build_haystack
from kvlocal.evals.tasks import ONEKEY_PARAPHRASES, ONEKEY_SHAPES, Probe, _codes
from kvlocal.ingest import Document

TASK = "library"
POOL = 40  # keys and codes drawn per seed: at most POOL // facts_per_doc documents
MAX_FACTS_PER_DOC = 8
ROTATIONS = 20  # places a supplied filler is started at


@dataclass(frozen=True)
class SetCase:
    seed: int
    documents: tuple[Document, ...]
    probes: tuple[Probe, ...]
    probe_document: tuple[int, ...]  # the document each probe's fact is in
    n_tokens: tuple[int, ...]  # each document's tokens as counted when it was built

    def probes_of(self, document: int) -> list[int]:
        return [i for i, d in enumerate(self.probe_document) if d == document]


def max_documents(facts_per_doc: int) -> int:
    return POOL // facts_per_doc


def document_label(seed: int, index: int) -> str:
    return f"library-s{seed}-doc{index + 1:02d}"


def build_set_case(
    n_documents: int,
    doc_tokens: int,
    *,
    seed: int,
    count_tokens: Callable[[str], int],
    facts_per_doc: int = 2,
    filler: str | None = None,
    first: int = 0,
    paraphrase: bool = False,
) -> SetCase:
    """`n_documents` haystacks of about `doc_tokens` tokens each, with `facts_per_doc` facts each at
    depths between 10 % and 90 % of the document (never in the set's sinks or window): the seed's
    documents `first` to `first + n_documents - 1` (disjoint sets of one seed share no document).
    `filler` (a document's text) replaces the generated prose; each document starts it at another place.
    `paraphrase` asks each fact in other words (ONEKEY_PARAPHRASES, in turn): the documents stay the same."""
    if not 1 <= facts_per_doc <= MAX_FACTS_PER_DOC:
        raise ValueError(f"facts per document must be 1 to {MAX_FACTS_PER_DOC} (got {facts_per_doc})")
    if n_documents < 1 or first < 0 or first + n_documents > max_documents(facts_per_doc):
        raise ValueError(f"at most {max_documents(facts_per_doc)} documents with {facts_per_doc} facts each "
                         f"(got documents {first + 1} to {first + n_documents})")
    fact, question, all_keys = ONEKEY_SHAPES[seed % len(ONEKEY_SHAPES)]
    paraphrases = ONEKEY_PARAPHRASES[seed % len(ONEKEY_SHAPES)]
    pool = random.Random(f"kvlocal-library-{seed}")
    keys = pool.sample(all_keys, POOL)
    codes, numbers = _codes(pool, POOL)
    forbid = sorted(numbers) + keys  # no filler sentence repeats a code or names a key
    documents, probes, probe_document, counts = [], [], [], []
    for i in range(first, first + n_documents):
        rng = random.Random(f"kvlocal-library-{seed}-{i}")
        depths = [0.1 + 0.8 * (j + rng.random()) / facts_per_doc for j in range(facts_per_doc)]
        mine = range(i * facts_per_doc, (i + 1) * facts_per_doc)
        needles = [(d, fact.format(key=keys[j], code=codes[j])) for d, j in zip(depths, mine)]
        text_filler = _rotated(filler, i) if filler is not None else None
        text, _, got = build_haystack(doc_tokens, needles, seed=seed * 1000 + i, count_tokens=count_tokens,
                                      filler=text_filler, forbid=forbid)
        documents.append(Document(text=text, source=document_label(seed, i), kind="text"))
        counts.append(got)
        for d, j in zip(depths, mine):
            asked = paraphrases[j % len(paraphrases)] if paraphrase else question
            probes.append(Probe(TASK, asked.format(key=keys[j]) + " Answer with the code only.", (codes[j],), d))
            probe_document.append(i - first)
    return SetCase(seed, tuple(documents), tuple(probes), tuple(probe_document), tuple(counts))


def _rotated(filler: str, index: int) -> str:
    """The filler's paragraphs started at another place for each document (the same place whatever
    the set's size), so the documents of a set do not begin with the same text."""
    paragraphs = [p for p in filler.split("\n\n") if p.strip()]
    if len(paragraphs) < 2:
        return filler
    cut = len(paragraphs) * ((index * 7) % ROTATIONS) // ROTATIONS
    return "\n\n".join(paragraphs[cut:] + paragraphs[:cut])
