"""Questions written by hand about real documents, for `kvlocal eval questions FILE`.

A question file (JSON) names its documents by path and sha256 (the answers hold for that text only) and
lists each question with the words its answer must hold:

    {"documents": [{"path": "/usr/share/doc/nodejs/api/os.md", "sha256": "e9dd…"}, …],
     "questions": [{"document": 0, "question": "…?", "answers": ["USERPROFILE"]}, …]}

A relative path is read from the file's folder. Every answer word must appear in the answer, as a whole
token, case- and whitespace-insensitive (`tasks.score`). The documents become one set case: asked of the
set, and of each document alone, by the library runner.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvlocal.errors import UsageError
from kvlocal.evals.library_cases import SetCase
from kvlocal.evals.tasks import Probe
from kvlocal.ingest import load_document

TASK = "questions"


def load_question_set(path: Path) -> SetCase:
    """The set case of the question file at `path`; UsageError (one line, naming the file) for a file
    that is missing, not JSON, not of the shape above, or whose documents are missing or another text."""
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise UsageError(f"{path}: cannot read the question file ({err.strerror or err})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"{path}: not a JSON question file ({err})") from None
    documents_spec = spec.get("documents") if isinstance(spec, dict) else None
    questions_spec = spec.get("questions") if isinstance(spec, dict) else None
    if not isinstance(documents_spec, list) or not documents_spec or not isinstance(questions_spec, list) \
            or not questions_spec:
        raise UsageError(f"{path}: a question file holds a non-empty 'documents' list and a non-empty 'questions' list")
    documents = []
    for i, entry in enumerate(documents_spec):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) \
                or not isinstance(entry.get("sha256"), str):
            raise UsageError(f"{path}: document {i} needs a 'path' and a 'sha256' (strings)")
        source = path.parent / entry["path"]
        try:
            data = source.read_bytes()
        except OSError as err:
            raise UsageError(f"{path}: document {i}, {source}: {err.strerror or err}") from None
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry["sha256"].lower():
            raise UsageError(f"{path}: document {i}, {source}, is another text (sha256 {digest[:12]}…, the questions "
                             f"were written for {entry['sha256'][:12]}…): its answers may differ")
        documents.append(load_document(source))
    probes, probe_document = [], []
    for i, entry in enumerate(questions_spec):
        document, question, answers = (entry.get(k) for k in ("document", "question", "answers")) \
            if isinstance(entry, dict) else (None, None, None)
        if not isinstance(document, int) or isinstance(document, bool) or not 0 <= document < len(documents) \
                or not isinstance(question, str) or not question.strip() or not isinstance(answers, list) \
                or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
            raise UsageError(f"{path}: question {i} needs 'document' (0 to {len(documents) - 1}), a 'question' and "
                             "'answers' (a non-empty list of words its answer must hold)")
        probes.append(Probe(TASK, question.strip(), tuple(a.strip() for a in answers),
                            _depth(documents[document].text, answers[0])))
        probe_document.append(document)
    return SetCase(seed=0, documents=tuple(documents), probes=tuple(probes), probe_document=tuple(probe_document),
                   n_tokens=tuple(0 for _ in documents))


def _depth(text: str, answer: str) -> float:
    """Where the answer's first occurrence sits in its document (0 to 1), -1 where the text does not hold it
    verbatim."""
    at = text.lower().find(answer.strip().lower())
    return -1.0 if at < 0 or not text else at / len(text)
