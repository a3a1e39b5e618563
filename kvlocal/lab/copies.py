"""`kvlocal lab copies`: where a routed answer loses a value it is copying (issue #45, item 2).

Each RULER sample is prefilled once and answered by the route with the engine reporting every
answer step's regions, per routed layer and KV head (what the graph gathered). The values the sample
asks for are found in the document's cells. At an answer step whose word so far begins an asked
value, the character the step should write next is known, and so is the region that holds it (the
*target*); the step records which (layer, KV head) pairs read that region, and what the pairs that
did not read it read instead: another part of the same value, another asked value, a look-alike (the
value's shape elsewhere: a number of as many digits, a UUID, a word of as many capitals) or filler.
A step off every asked value (after a wrong character, or text that is no value) has no target.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvlocal.evals.intervals import wilson_interval

NOT_WORD = re.compile(r"[^\w-]*")  # what a token writes before a value character (spaces, punctuation)
WORD = re.compile(r"[\w-]*")
WORD_TAIL = re.compile(r"[\w-]*$")
CATEGORIES = ("same value", "other asked value", "look-alike", "filler")


@dataclass(frozen=True)
class Target:
    """What an answer step should write: character `offset` of asked value `value` onwards."""

    value: str
    offset: int
    right: bool  # the step wrote it (its word so far plus its text still spell the value)


def target_of(written: str, token_text: str, values: Sequence[str]) -> Target | None:
    """The asked value an answer step is copying, given the answer `written` before it and its own text;
    None where the step writes no value character (a separator), starts a word that begins no asked
    value, or continues a word that is no asked value's start (after a wrong character)."""
    lead = NOT_WORD.match(token_text).end()
    if lead == len(token_text):
        return None
    word = "" if lead else WORD_TAIL.search(written).group()
    piece = WORD.match(token_text, lead).group()
    open_values = [v for v in values if v.startswith(word) and len(word) < len(v)]
    if not open_values:
        return None
    if not word:  # a new word: the asked values not written yet come first
        open_values.sort(key=lambda v: v in written)
    for value in open_values:
        rest = value[len(word):]
        if rest.startswith(piece) or piece.startswith(rest):
            return Target(value, len(word), True)
    best = max(open_values, key=lambda v: _common(v[len(word):], piece))
    if not word and not _common(best, piece):
        return None  # a new word that starts no asked value: text around the values
    return Target(best, len(word), False)


def _common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def look_alike(value: str) -> re.Pattern | None:
    """The shape of an asked value that other text may share (None: no shape is kept for it)."""
    if re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", value):
        return re.compile(r"[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}")
    if value.isdigit():
        return re.compile(rf"(?<!\d)\d{{{len(value)}}}(?!\d)")
    if value.isalpha() and value.isupper():
        return re.compile(rf"\b[A-Z]{{{len(value)}}}\b")
    return None


@dataclass
class DocumentCells:
    """Where the asked values and their look-alikes lie in a loaded document's cells (each scan of the
    text is made once and kept: an answer asks at every token)."""

    text: str  # the cells' text
    char_cells: list[int]  # the cell of each character
    region: int  # cells per region
    _scans: dict = field(default_factory=dict, repr=False, compare=False)

    def value_starts(self, value: str) -> list[int]:
        if ("starts", value) not in self._scans:
            self._scans["starts", value] = [m.start() for m in re.finditer(re.escape(value), self.text)]
        return self._scans["starts", value]

    def region_of_char(self, at: int) -> int:
        return self.char_cells[at] // self.region

    def categories(self, values: Sequence[str]) -> dict[int, str]:
        """The category of every region holding an asked value or a look-alike (the rest: filler)."""
        key = ("categories", tuple(values))
        if key in self._scans:
            return self._scans[key]
        found: dict[int, str] = {}
        for value in values:
            pattern = look_alike(value)
            for m in pattern.finditer(self.text) if pattern else ():
                if m.group() not in values:
                    for at in range(m.start(), m.end()):
                        found.setdefault(self.region_of_char(at), "look-alike")
        for value in values:
            for start in self.value_starts(value):
                for at in range(start, start + len(value)):
                    found[self.region_of_char(at)] = value
        self._scans[key] = found
        return found


def step_record(doc: DocumentCells, values: Sequence[str], target: Target | None, token_text: str,
                regions: np.ndarray, layers: np.ndarray, n_kv: int, sinks: int, window: int,
                before: np.ndarray | None = None) -> dict | None:
    """One answer token: its target, the share of each routed layer's KV heads that read the target's
    region at the step whose logits chose it, the share that had read it at the step before (`before`:
    that step's regions) and no longer did, and what the pairs that did not read it read instead
    (regions: [layer, head, n_sel])."""
    if target is None:
        return None
    starts = doc.value_starts(target.value)
    if not starts:
        return None
    chars = [s + min(target.offset, len(target.value) - 1) for s in starts]
    wanted = {doc.region_of_char(c) for c in chars}
    first_regions = {doc.region_of_char(s) for s in starts}
    always = any(doc.char_cells[c] < sinks or doc.char_cells[c] >= n_kv - window for c in chars)
    category = doc.categories(values)
    read = np.isin(regions, list(wanted)).any(axis=2) | always  # [layer, head]
    had = (np.isin(before, list(wanted)).any(axis=2) | always) if before is not None else read
    instead: Counter = Counter()
    for il, h in zip(*np.nonzero(~read)):
        for r in regions[il, h]:
            if r < 0:
                continue
            c = category.get(int(r), "filler")
            instead["same value" if c == target.value else "other asked value" if c in values else c] += 1
    return {"token": token_text, "value": target.value, "offset": target.offset, "right": target.right,
            "next_region": not (wanted & first_regions), "read_by_layer": read.mean(axis=1).round(3).tolist(),
            "layers": [int(x) for x in layers], "read": float(read.mean()),
            "dropped": float((had & ~read).mean()), "instead": dict(instead)}


def first_wrong(steps: Sequence[dict]) -> int | None:
    """The index of the first step that wrote a wrong character of a value (None: none did)."""
    return next((i for i, s in enumerate(steps) if not s["right"]), None)


def summarize(rows: Sequence[dict]) -> list[dict]:
    """Per task: copy steps before the first wrong character against the first wrong steps."""
    by_task: dict[str, list[dict]] = {}
    for row in rows:
        by_task.setdefault(row["task"], []).append(row)
    out = []
    for task, task_rows in sorted(by_task.items()):
        right, wrong = [], []
        for row in task_rows:
            steps = row["steps"]
            stop = first_wrong(steps)
            right += steps[:stop]
            if stop is not None:
                wrong.append(steps[stop])
        instead: Counter = Counter()
        for s in wrong:
            instead.update(s["instead"])
        out.append({"task": task, "answers": len(task_rows), "right_steps": len(right), "wrong_steps": len(wrong),
                    "read_right": _mean([s["read"] for s in right]), "read_wrong": _mean([s["read"] for s in wrong]),
                    "dropped_right": _mean([s.get("dropped", 0.0) for s in right]),
                    "dropped_wrong": _mean([s.get("dropped", 0.0) for s in wrong]),
                    "next_region_right": sum(s["next_region"] for s in right),
                    "next_region_wrong": sum(s["next_region"] for s in wrong),
                    "lost_layers": _lost_layers(right, wrong), "instead": dict(instead)})
    return out


def _mean(xs: Sequence[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


def _lost_layers(right: Sequence[dict], wrong: Sequence[dict], drop: float = 0.25) -> list[int]:
    """The routed layers whose share of pairs reading the target falls by `drop` or more from the steps
    copied right to the first wrong steps."""
    if not right or not wrong:
        return []
    layers = right[0]["layers"]
    before = np.mean([s["read_by_layer"] for s in right], axis=0)
    after = np.mean([s["read_by_layer"] for s in wrong], axis=0)
    return [layers[i] for i in np.nonzero(before - after >= drop)[0]]


def markdown(summary: Sequence[dict]) -> str:
    def share(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f}"

    def count(k: int, n: int) -> str:
        if not n:
            return "–"
        lo, hi = wilson_interval(k / n, n)
        return f"{k}/{n} [{lo:.0%}–{hi:.0%}]"

    lines = ["| task | answers | steps copied right: target read (dropped since the step before) | "
             "first wrong steps: target read (dropped) | "
             "target in the value's next region, right / first wrong | layers that lost it | "
             "the others read instead, first wrong steps |",
             "|---|---:|---:|---:|---|---|---|"]
    for s in summary:
        total = sum(s["instead"].values())
        instead = ", ".join(f"{c} {s['instead'].get(c, 0) / total:.0%}" for c in CATEGORIES) if total else "–"
        lines.append(f"| {s['task']} | {s['answers']} | {share(s['read_right'])} ({share(s['dropped_right'])}; "
                     f"n={s['right_steps']}) | {share(s['read_wrong'])} ({share(s['dropped_wrong'])}; "
                     f"n={s['wrong_steps']}) | "
                     f"{count(s['next_region_right'], s['right_steps'])} / "
                     f"{count(s['next_region_wrong'], s['wrong_steps'])} | "
                     f"{', '.join(map(str, s['lost_layers'])) or '–'} | {instead} |")
    return "\n".join(lines)


COPIES = "copies.jsonl"


def run_copies(session, out: Path, lengths: Sequence[int], tasks: Sequence[str], seeds: Sequence[int], route_config,
               log: Callable[[str], None] = print) -> list[dict]:
    """Answer every (length, task, sample) that no row of OUT/copies.jsonl holds for this route, recording
    each answer step's target and reads; returns all rows of the route."""
    from kvlocal.evals import ruler
    from kvlocal.evals.report import route_label
    from kvlocal.evals.ruler_runner import ruler_budget
    from kvlocal.evals.runner import append_row, load_rows, route_fields

    path = out / COPIES
    out.mkdir(parents=True, exist_ok=True)
    label = route_label(route_fields(session.route_for(route_config)))
    rows = [r for r in load_rows(path, accepts=lambda r: (r["length"], r["task"], r["seed"], r["route"]))
            if r["route"] == label]
    done = {(r["length"], r["task"], r["seed"]) for r in rows}
    count = lambda text: len(session.tokenize(text, bos=False))  # noqa: E731
    configs = ruler.task_configs()
    for length in lengths:
        for task in tasks:
            todo = [i for i in seeds if (length, task, i) not in done]
            if not todo:
                continue
            max_tokens = configs[task]["tokens_to_generate"]
            samples = ruler.generate(task, length, max(todo) + 1, count, budget=ruler_budget(session, length, max_tokens))
            for i in todo:
                row = {"length": length, "task": task, "seed": i, "route": label, **copy_row(session, samples[i], route_config, max_tokens)}
                append_row(path, row)
                rows.append(row)
                stop = first_wrong(row["steps"])
                log(f"{length:>6} {task:<16} #{i} score={row['score']:.2f} first wrong step: "
                    f"{'none' if stop is None else stop} | {row['answer'][:50]!r}")
    return rows


def copy_row(session, sample, route_config, max_tokens: int) -> dict:
    """Prefill `sample`, answer it with the route reporting each step's regions, and record the steps."""
    from kvlocal.evals import ruler
    from kvlocal.evals.ruler_runner import answer_prefix
    from kvlocal.evals.runner import route_fields
    from kvlocal.hints import cell_text

    session.load_document(sample.document, label=f"ruler {sample.task} #{sample.index}", use_cache=False)
    route = session.route_for(route_config)
    text, char_cells = cell_text(session.token_pieces(session.prefix_cell_tokens()))
    doc = DocumentCells(text, char_cells, route.region)
    values = list(sample.outputs)
    steps, written, tokens = [], "", 0
    deciding = earlier = None  # a token's logits come from the step before it; and the step before that
    with answer_prefix(session, sample.answer_prefix):
        answer = session.ask(sample.question, route=route_config, max_tokens=max_tokens, want_regions=True)

        def record(token_text: str, target: Target | None) -> None:
            if deciding is not None and deciding.regions.size:
                found = step_record(doc, values, target, token_text, deciding.regions, deciding.layers,
                                    deciding.n_kv, route.sinks, route.window,
                                    earlier.regions if earlier is not None and earlier.regions.size else None)
                if found is not None:
                    steps.append({"step": tokens, **found})

        for piece in answer:
            record(piece.text, target_of(written, piece.text, values))
            written, tokens, deciding, earlier = written + piece.text, tokens + 1, piece.stats, deciding
        summary = answer.summary()
        missing = [v for v in values if v not in written]
        if missing and summary.n_answer_tokens < max_tokens:  # the model ended it with a value unwritten
            record("<end>", Target(missing[0], 0, False))
    return {"route_fields": route_fields(summary.route), "answer": summary.text.strip(), "expected": values,
            "score": ruler.score(sample.task, summary.text, sample.outputs), "steps": steps}
