"""`kvlocal eval ruler`: RULER's tasks (kvlocal.evals.ruler) asked of every route on one prefill.

Each sample's document (RULER's instructions and context) is prefilled once; its question is then
answered with full attention, the default route and the window and random controls at the default
route's budget, each from the same prefilled state, the answer prefix opening the model's turn. A
row per (length, task, sample, route) is appended to OUT/results.jsonl as it comes (the needle grid's
row keys: a rerun asks only what no row holds); the table goes to stdout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvlocal.errors import UsageError
from kvlocal.evals import ruler
from kvlocal.evals.runner import GridConfig, _key, answer_fields, append_row, load_rows, loaded_fields, row_key
from kvlocal.route_settings import MODES
from kvlocal.routing import RouteConfig
from kvlocal.session import ANSWER_RESERVE, Session

SUITE = "ruler"
RESULTS = "results.jsonl"


@dataclass
class RulerConfig:
    lengths: list[int]
    tasks: list[str] = field(default_factory=lambda: list(ruler.TASK_NAMES))
    samples: list[int] = field(default_factory=lambda: [0])  # sample indices of RULER's generation (seed 42)
    modes: list[str] = field(default_factory=lambda: ["full", "geometric", "window", "random"])
    route: RouteConfig = field(default_factory=RouteConfig)  # every mode's settings (its mode unused)
    max_tokens: int | None = None  # None: RULER's tokens_to_generate for the task
    also: list[RouteConfig] = field(default_factory=list)  # more geometric routes asked on the same prefills


def prompt_overhead(session: Session) -> int:
    """The tokens kvlocal's prompt adds around RULER's input (the chat template, its system prompt)."""
    parts = session.prompt_parts("x")
    return len(session.tokenize_prompt([s for s in parts.prefix_segments() + parts.question_segments("x")
                                        if s.template], bos=True))


def ruler_budget(session: Session, length: int, tokens_to_generate: int) -> int:
    """The tokens RULER may size a sample to (its input and tokens to generate) so that kvlocal's prompt
    around it fits `length`, and its document leaves the session's answer room in the trained context."""
    overhead = prompt_overhead(session)
    return min(length, session.trained_ctx - ANSWER_RESERVE + tokens_to_generate) - overhead


@contextmanager
def answer_prefix(session: Session, prefix: str) -> Iterator[None]:
    """Answers open the model's turn with `prefix` (RULER's answer prefix, as a chat turn begins: no
    leading space) while in the block."""
    parts = session.parts
    session.parts = replace(parts, answer_prefix=prefix.lstrip())
    try:
        yield
    finally:
        session.parts = parts


def run_ruler(session: Session, config: RulerConfig, out: Path, log: Callable[[str], None] = print) -> list[dict]:
    """Ask every (length, task, sample, route) that no row of `out` holds; returns all rows (old and new)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    grid = GridConfig(modes=config.modes, route=session.route_for(config.route))  # rows record the budget read
    # each route once: --also may resolve to a mode's route, or two of its routes to one (keep=0 pins nothing)
    routes = list(dict.fromkeys([*grid.routes(), *(next(GridConfig(modes=["geometric"],
                                                                    route=session.route_for(r)).routes())
                                                   for r in config.also)]))
    rows = load_rows(out)
    done = {row_key(r) for r in rows}
    configs = ruler.task_configs()
    count = lambda text: len(session.tokenize(text, bos=False))  # noqa: E731
    for length in config.lengths:
        for task in config.tasks:
            max_tokens = config.max_tokens or configs[task]["tokens_to_generate"]
            todo = [(i, route) for i in config.samples for route in routes
                    if _key(length, task, ruler.RULER_SEED, i, route, "", session, max_tokens, "dense") not in done]
            if not todo:
                continue
            budget = ruler_budget(session, length, configs[task]["tokens_to_generate"])
            samples = ruler.generate(task, length, max(config.samples) + 1, count, budget=budget)
            for index in sorted({i for i, _ in todo}):
                sample = samples[index]
                loaded = _prefill(session, sample, length, log)
                for route in [r for i, r in todo if i == index]:
                    row = _ask(session, sample, route, length, max_tokens, loaded, count)
                    append_row(out, row)
                    rows.append(row)
                    done.add(row_key(row))
                    log(f"{length:>6} {task:<16} #{index} {route.mode:<9} k={route.top_k:<3} score={row['score']:.2f} "
                        f"x{row['reduction']:.1f} | {row['answer'][:50]!r}")
    return rows


def _prefill(session: Session, sample: ruler.Sample, length: int, log) -> dict:
    start = time.perf_counter()
    # not saved: a rerun resumes from the rows, and a state per sample would fill the cache
    result = session.load_document(sample.document, label=f"ruler {sample.task} {length} #{sample.index}", use_cache=False)
    log(f"ruler {sample.task} {length} #{sample.index}: {result.n_tokens:,} tokens prefilled "
        f"({time.perf_counter() - start:.1f} s)")
    return loaded_fields(result, "dense")


def _ask(session: Session, sample: ruler.Sample, route: RouteConfig, length: int, max_tokens: int, loaded: dict,
         count: Callable[[str], int]) -> dict:
    with answer_prefix(session, sample.answer_prefix):
        summary = session.answer(sample.question, route=route, max_tokens=max_tokens)
    return {
        "suite": SUITE,
        "length": length,
        "task": sample.task,
        "seed": ruler.RULER_SEED,
        "probe": sample.index,
        "haystack": "",
        **answer_fields(session, route, summary, loaded, max_tokens),
        "ruler_tokens": count(sample.text),  # RULER's input as the model tokenizes it
        "answer_prefix": sample.answer_prefix,
        "score": ruler.score(sample.task, summary.text, sample.outputs),
        "answer": summary.text.strip(),
        "expected": list(sample.outputs),
    }


def parse_tasks(text: str) -> list[str]:
    """--tasks: RULER's task names, or 'all'."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return list(ruler.TASK_NAMES)
    unknown = [t for t in names if t not in ruler.TASK_NAMES]
    if unknown or not names:
        raise UsageError(f"--tasks: {', '.join(unknown) or 'none given'}; RULER's tasks are all or "
                         f"{', '.join(ruler.TASK_NAMES)}")
    return names


ALSO_SETTINGS = {"top-k": ("top_k", int), "layer-top-k": ("layer_top_k", str), "keep": ("keep", float),
                 "pin": ("pin", int), "follow": ("follow", int), "hints": ("hints", int), "region": ("region", int), "window": ("window", int),
                 "sinks": ("sinks", int), "shortlist": ("shortlist", int)}


def parse_also(text: str, route: RouteConfig) -> list[RouteConfig]:
    """--also: geometric routes beside the modes, ';' between routes, each the given route with some
    settings changed ('keep=0;top-k=8,layer-top-k=' : the default route without its selection memory,
    and eight regions in every layer)."""
    routes = []
    for spec in filter(None, (part.strip() for part in text.split(";"))):
        changes = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name.strip() not in ALSO_SETTINGS:
                raise UsageError(f"--also: {item!r}; give SETTING=VALUE with a setting of "
                                 f"{', '.join(ALSO_SETTINGS)} (';' between routes, ',' between settings)")
            field_name, kind = ALSO_SETTINGS[name.strip()]
            try:
                changes[field_name] = kind(value.strip())
            except ValueError:
                raise UsageError(f"--also: {item!r} is not a {kind.__name__}") from None
        try:
            routes.append(replace(route, mode="geometric", **changes))
        except (UsageError, ValueError) as e:  # RouteConfig's own checks
            raise UsageError(f"--also: {spec!r}: {e.args[0] if e.args else e}") from None
    return routes


def eval_command(lengths: list[int], tasks: str, samples: list[int], modes: str, route: RouteConfig,
                 max_tokens: int | None, out: Path, open_session: Callable[[], Session],
                 log: Callable[[str], None], also: str = "") -> None:
    """`kvlocal eval ruler`: checks, runs, writes the rows and prints the table (`open_session` checks
    the lengths against the model's trained context)."""
    from kvlocal.evals import report

    config = RulerConfig(lengths, parse_tasks(tasks), samples, [m.strip() for m in modes.split(",") if m.strip()],
                         route, max_tokens, parse_also(also, route))
    unknown = [m for m in config.modes if m not in MODES]
    if unknown or not config.modes:
        raise UsageError(f"--modes: {', '.join(unknown) or 'none given'}; choose from {', '.join(MODES)}")
    if not config.samples or min(config.samples) < 0:
        raise UsageError("--seeds: the RULER sample indices (0, 1, ...) to ask")
    ruler.task_configs()  # the package is installed (a clear error before the model loads)
    session = open_session()
    rows = run_ruler(session, config, out / RESULTS, log)
    print(report.ruler_markdown([r for r in rows if r["length"] in config.lengths and r["task"] in config.tasks]))
