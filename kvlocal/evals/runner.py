"""The evaluation grid: lengths x tasks x depths x routing modes, on real prefilled haystacks.

Each haystack is prefilled once (its KV state is saved, so a rerun loads it) and every probe
and mode is asked of the same state. Results are appended to a JSONL file as they come, so an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvlocal.errors import UsageError
from kvlocal.evals.tasks import Case, build_case, score
from kvlocal.hints import RULE as HINT_RULE
from kvlocal.route_settings import MODES
from kvlocal.routing import PrefillConfig, Route, RouteConfig
from kvlocal.session import ANSWER_RESERVE, Session


# answer room per task: Qwen writes numbers digit by digit, and some tasks ask for several
ANSWER_TOKENS = {"passkey": 24, "multikey": 24, "lookalike": 24, "onekey": 24, "manifest": 24, "tray": 24,
                 "multiquery": 40, "vartrack": 48, "multivalue": 64, "cwe": 80}
DEFAULT_DEPTHS = tuple(round(i / 10, 1) for i in range(11))


@dataclass
class GridConfig:
    lengths: list[int] = field(default_factory=lambda: [4096, 8192, 16384, 32768])
    depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    tasks: list[str] = field(default_factory=lambda: ["passkey"])
    modes: list[str] = field(default_factory=lambda: list(MODES))
    seeds: list[int] = field(default_factory=lambda: [0])
    # the settings of every mode's route (its mode unused); run_grid resolves them for the model
    route: RouteConfig | Route = field(default_factory=RouteConfig)
    sweep: list[int] = field(default_factory=list)  # extra geometric budgets (top-k values)
    max_tokens: int | None = None  # None: ANSWER_TOKENS[task]
    prefill: PrefillConfig = field(default_factory=PrefillConfig)  # how the haystacks are prefilled

    def routes(self) -> Iterator[Route]:
        for mode in self.modes:
            yield self.route_of(mode, self.route.top_k)
        if "geometric" in self.modes:
            for k in self.sweep:
                if k != self.route.top_k:
                    yield self.route_of("geometric", k)

    def route_of(self, mode: str, top_k: int) -> Route:
        route = replace(self.route, mode=mode, top_k=top_k)
        # rows record the pins and hints that acted (0 for the controls)
        return replace(route, pin=route.pins, follow=route.follows, hints=route.hinted)


TEMPLATE_RESERVE = 256  # context tokens kept for the prompt template around a haystack


def haystack_tokens(length: int) -> int:
    """A haystack's tokens for a context of `length`: room left for the template, question and answer."""
    return length - ANSWER_RESERVE - TEMPLATE_RESERVE


def depth_grid(n: int) -> list[float]:
    """`n` fact depths from 0 to 1, evenly spaced (n >= 2): where `kvlocal eval --depths n` plants them."""
    return [round(i / (n - 1), 3) for i in range(n)]


def make_case(session: Session, task: str, length: int, depths, seed: int, filler: str | None = None) -> Case:
    """The haystack for a context of `length` tokens (room left for the template, question and answer)."""
    count = lambda text: len(session.tokenize(text, bos=False))  # noqa: E731
    target = haystack_tokens(length)
    try:
        for _ in range(3):
            case = build_case(task, target, depths, seed=seed, count_tokens=count, filler=filler)
            # a haystack may overshoot its target a little; at the model's own context that can
            # leave no room for the answer, so shrink the target by the overshoot (cases that fit
            # are never rebuilt, so recorded haystacks stay what they were)
            over = count(case.text) + ANSWER_RESERVE + TEMPLATE_RESERVE - session.trained_ctx
            if over <= 0:
                break
            target -= over
        return case
    except ValueError as err:  # the needles do not fit
        raise UsageError(f"cannot build a {length}-token {task} haystack with {len(depths)} depths: {err}") from None


def task_answer_tokens(task: str) -> int:
    """The answer budget a task's probes get unless --max-tokens sets one."""
    return ANSWER_TOKENS.get(task, 48)


def answer_tokens(config: GridConfig, task: str) -> int:
    return config.max_tokens or task_answer_tokens(task)


# rows written before the centroid block was recorded ran with one centroid per 16 tokens
BLOCK_BEFORE_RECORDED = 16


def route_fields(route: Route) -> dict:
    """A resolved route's settings as a result row holds them (not its seed, nor the question's hinted
    cells: a row holds those apart)."""
    return {k: v for k, v in asdict(route).items() if k not in ("seed", "hint_cells")}


def block(row: dict) -> int:
    """The row's centroid block."""
    return row.get("centroid_block", BLOCK_BEFORE_RECORDED)


def question_pass(row: dict) -> str:
    """How the row's question read the document: 'steps' (token by token through the route, as every
    row before the routed ubatch), 'dense' (one dense batch) or 'q<k>' (one batch routed to k regions)."""
    question = row.get("question", "steps")
    return f"q{row.get('question_top_k', 0)}" if question == "routed" else question


# The route settings a row's key holds, each with the value rows written before it was recorded ran
# (None: every row has it). Full attention reads every cell whatever they are: its key holds none.
ROUTE_KEY = (
    ("top_k", None), ("region", None), ("window", None), ("sinks", None),
    ("shortlist", 0),  # rows before two-level scoring scanned every centroid
    ("keep", 0.0),  # ... and selected afresh at every step
    ("centroid_type", "f16"),  # ... and kept the centroids in F16 (the session's, recorded in the row)
    ("pin", 0),  # ... and pinned nothing by the question
    ("follow", 0),  # ... and read no region for following a choice
    ("estimate", False),  # a row that ran the retired estimate of unread regions: another cell
    ("hints", 0),  # rows before text hints read none
    ("layer_top_k", ""),  # ... and gave every layer the same top-k
    ("shortlist_floor", 0),  # ... and had no floor under an automatic shortlist
)
# the route fields a row records that its key holds elsewhere or not at all: the mode and the question
# pass (question, question_top_k: `question_pass`) are in the case part; the attention path is how the
# chosen cells are read, not which; the focus is a set's (the library's key holds it in its case part,
# library_runner.answer_key; one document reads itself whatever it is)
NOT_IN_ROUTE_KEY = ("mode", "question", "question_top_k", "attention", "focus")


def route_key(row: dict) -> tuple:
    """The route part of a row's key (the grid's `row_key`, the library's `answer_key`): () for full
    attention, else its centroid block, hint rule and the ROUTE_KEY settings."""
    if row["mode"] == "full":
        return ()
    return (block(row), hint_rule(row), *(row[k] if old is None else row.get(k, old) for k, old in ROUTE_KEY))


def row_key(row: dict) -> tuple:
    """The cell a row fills: a rerun asks only the probes whose key no row has."""
    return (row["length"], row["task"], row["seed"], row["probe"], row["mode"], row.get("haystack", ""),
            row.get("max_tokens", task_answer_tokens(row["task"])),  # older rows ran at the task's default
            question_pass(row),  # ... and decoded the question token by token
            row.get("prefill", "dense"),  # ... and prefilled the haystack densely
            *route_key(row))


def hint_rule(row: dict) -> str:
    """The text-hint rule a row ran ("" without hints; rows before the rule was recorded: "region")."""
    return row.get("hint_rule", "region") if row.get("hints") else ""


def load_rows(path: Path, accepts: Callable[[dict], object] = row_key) -> list[dict]:
    """The rows of a results file (JSON lines) that `accepts` takes: the grid's by default, a row whose
    key can be made. A line cut short by an interrupt, or not one of these rows, is left out."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not accepts(row):
                continue
        except (ValueError, KeyError, TypeError):
            continue
        rows.append(row)
    return rows


def append_row(path: Path, row: dict) -> None:
    with open(path, "a+") as fh:
        if fh.tell() > 0:  # a line an interrupt cut short ends here: the new row starts on its own line
            fh.seek(fh.tell() - 1)
            last = fh.read(1)
            if last != "\n":
                fh.write("\n")
        fh.write(json.dumps(row) + "\n")
        fh.flush()


def run_grid(
    session: Session,
    config: GridConfig,
    out: Path,
    *,
    filler: str | None = None,
    haystack_name: str = "",
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Run every cell not yet in `out`; returns all rows (old and new)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    config = replace(config, route=session.route_for(config.route))  # rows record the budget read
    rows = load_rows(out)
    done = {row_key(r) for r in rows}
    prefill_tag = session.prefill_tag(config.prefill)
    for length in config.lengths:
        for task in config.tasks:
            for seed in config.seeds:
                case = make_case(session, task, length, config.depths, seed, filler)
                todo = [
                    (i, probe, route)
                    for i, probe in enumerate(case.probes)
                    for route in config.routes()
                    if _key(length, task, seed, i, route, haystack_name, session,
                            answer_tokens(config, task), prefill_tag) not in done
                ]
                if not todo:
                    continue
                loaded = _load(session, case, length, seed, config.prefill, prefill_tag, log)
                for i, probe, route in todo:
                    row = _ask(session, case, i, probe, route, config, length, seed, haystack_name, loaded)
                    append_row(out, row)
                    rows.append(row)
                    done.add(row_key(row))
                    log(
                        f"{length:>6} {task:<10} d={probe.depth:4.2f} {route.mode:<9} k={route.top_k:<3} "
                        f"score={row['score']:.2f} x{row['reduction']:.1f} {row['decode_tps']:.1f} tok/s "
                        f"| {row['answer'][:40]!r}"
                    )
    return rows


def _key(length, task, seed, probe_index, route, haystack_name, session, max_tokens, prefill_tag) -> tuple:
    """row_key of the row that asking this probe would write."""
    return row_key({"length": length, "task": task, "seed": seed, "probe": probe_index, "mode": route.mode,
                    "top_k": route.top_k, "region": route.region, "window": route.window, "sinks": route.sinks,
                    "haystack": haystack_name, "centroid_block": session.centroid_block,
                    "centroid_type": session.centroid_type, "max_tokens": max_tokens,
                    "shortlist": route.shortlist, "keep": route.keep,
                    "question": route.question, "question_top_k": route.question_top_k, "prefill": prefill_tag,
                    "pin": route.pin, "follow": route.follow, "hints": route.hints, "hint_rule": HINT_RULE, "layer_top_k": route.layer_top_k,
                    "shortlist_floor": route.shortlist_floor})


def _load(session: Session, case: Case, length: int, seed: int, prefill: PrefillConfig, prefill_tag: str, log) -> dict:
    start = time.perf_counter()
    result = session.load_document(case.text, label=f"eval {case.task} {length} seed {seed}", prefill=prefill)
    how = "cache hit" if result.cache_hit else f"{prefill.mode} prefill {result.rate:,.0f} tok/s"
    if result.reads and prefill.routed:
        how += f", {result.reads.reduction:.1f}x fewer attention bytes"
    log(f"haystack {case.task} {length} seed {seed}: {result.n_tokens:,} tokens, {how} ({time.perf_counter() - start:.1f} s)")
    return loaded_fields(result, prefill_tag)


def loaded_fields(result, prefill_tag: str) -> dict:
    """What the rows answered on a loaded document record of its load (a LoadResult)."""
    return {"n_tokens": result.n_tokens, "cache_hit": result.cache_hit,
            "prefill_tps": None if result.cache_hit else result.rate,
            "prefill_reduction": result.reads.reduction if result.reads else None,
            "prefill": prefill_tag}


def _ask(session, case, index, probe, route, config, length, seed, haystack_name, loaded) -> dict:
    max_tokens = answer_tokens(config, case.task)
    summary = session.answer(probe.question, route=route, max_tokens=max_tokens)
    return {
        "length": length,
        "task": case.task,
        "seed": seed,
        "probe": index,
        "depth": probe.depth,
        "haystack": haystack_name,
        **answer_fields(session, route, summary, loaded, max_tokens),
        "score": score(probe, summary.text),
        "answer": summary.text.strip(),
        "expected": list(probe.answers),
    }


def answer_fields(session: Session, route: RouteConfig, summary, loaded: dict, max_tokens: int) -> dict:
    """What a result row records of one answer: the route it took, what its steps read, the prefill it
    answered on (`loaded`: see _load) and the model."""
    return {
        **route_fields(route),
        "hint_rule": HINT_RULE if route.hints else "",
        "hint_cells": list(summary.hint_cells),
        "top_k_read": summary.route.top_k,  # top_k, raised to the hinted regions where they are more
        "centroid_block": session.centroid_block,
        "centroid_type": session.centroid_type,
        "shortlist_used": summary.route.shortlist,  # an automatic shortlist as resolved for this document
        "max_tokens": max_tokens,
        "n_tokens": loaded["n_tokens"],
        "prefill": loaded["prefill"],
        "prefill_tps": loaded["prefill_tps"],
        "prefill_reduction": loaded["prefill_reduction"],
        "decode_tps": summary.decode_rate,
        "steps": summary.steps,
        "rows_read": summary.rows_read,
        "rows_dense": summary.rows_dense,
        "bytes_read": summary.bytes_read,
        "bytes_meta": summary.bytes_meta,
        "bytes_dense": summary.bytes_dense,
        "reduction": summary.reduction,
        "question_bytes_read": summary.question_bytes_read,
        "question_bytes_dense": summary.question_bytes_dense,
        "fallback": summary.fallback,
        "model": session.model.alias or session.model.path.name,
    }
