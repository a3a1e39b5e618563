"""The measuring commands: `kvlocal eval` (grid, quick, library, questions), `kvlocal bench` (document, library) and
`kvlocal lab` (decode, prefill, hints). Each is a group whose first command is what the bare command
runs (`kvlocal eval --lengths 8k` is `kvlocal eval grid --lengths 8k`); a mode that makes another
program is a command of its own. Options are checked here before any engine work; the runs, their files
and their tables are the evals and lab packages'.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from kvlocal import cli_common as common
from kvlocal.cli_common import DefaultGroup, err, handles_errors
from kvlocal.cli_options import (
    AloneModesOpt,
    AlsoOpt,
    ChunksOpt,
    ControlsOpt,
    DepthsOpt,
    EstimatesOpt,
    FactsPerDocOpt,
    HaystackOpt,
    HintScopeOpt,
    HintsOpt,
    LabOptions,
    LayerBudgetOpt,
    LayoutOpt,
    LengthsOpt,
    LibrarySizesArg,
    MaxTokensOpt,
    ModelOpt,
    ModesOpt,
    OtherAttentionOpt,
    OutOpt,
    ParaphraseOpt,
    HereOpt,
    PlainLoopOpt,
    PlotsOpt,
    PrefillFromOpt,
    PrefillLengthsOpt,
    PrefillRoutedOpt,
    PrefillOpt,
    PrefillOptions,
    QuestionFileArg,
    ReferencesOpt,
    RegionOpt,
    RouteOptions,
    RpcOptions,
    SeedsOpt,
    SetSeedOpt,
    SetsPerSeedOpt,
    SinksOpt,
    SweepOpt,
    TasksOpt,
    ThreadsOpt,
    TokensOpt,
    TtftOpt,
    UpkeepOpt,
    bounded,
    ints,
    lengths as parse_lengths,
    option_groups,
    seeds as parse_seeds,
)
from kvlocal.errors import UsageError
from kvlocal.evals.serve_bench import BUSY_ASKERS
from kvlocal.route_settings import (
    DEFAULT_MODE,
    DEFAULT_PREFILL,
    DEFAULT_PREFILL_FROM as PREFILL_FROM,
    DEFAULT_REGION as REGION,
    DEFAULT_SINKS as SINKS,
    MAX_TOP_K,
    MODES,
)

QUESTION_ANSWER_TOKENS = 32  # a short real answer: a name, a number, a path or two

eval_app = typer.Typer(cls=DefaultGroup, help="Accuracy and KV reads of every routing mode on planted facts "
                       "(`kvlocal eval` is `kvlocal eval grid`).")
bench_app = typer.Typer(cls=DefaultGroup, help="Decode and prefill speed, memory and time to first token "
                        "(`kvlocal bench` is `kvlocal bench document`).")
lab_app = typer.Typer(cls=DefaultGroup, help="The routing lab: selection rules replayed offline on the dense model's "
                      "real queries (`kvlocal lab` is `kvlocal lab decode`).")


def _modes(text: str, routing: RouteOptions) -> list[str]:
    """--modes, each checked with these settings before any work."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for mode in modes:
        routing.config(mode)
    return modes


def _check_out_folder(out: Path, files: tuple[str, ...] = ()) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder")
    for name in files:
        if (out / name).is_dir():
            raise UsageError(f"--out {out}: {name} there is a folder")


def _routed_session(model, threads, routing: RouteOptions, lengths: list[int]):
    """The session a measurement routes in: the model with the routing options' centroids, checked to
    hold the longest of `lengths`."""
    return common.check_lengths_fit(common.open_session(model, None, threads, "f16", routing.centroid_block,
                                                        routing.centroid_type), lengths)


def _haystack_text(haystack: Path | None) -> str | None:
    from kvlocal.ingest import load_document

    return load_document(haystack).text if haystack else None


def _grid(config, haystack: Path | None, out: Path, plots: bool, model, threads, routing: RouteOptions) -> dict:
    """Run the needle grid into OUT, print its table and write its summary (and plots); the summary."""
    from kvlocal.evals import report
    from kvlocal.evals.runner import run_grid
    from kvlocal.evals.tasks import TASKS

    unknown = [t for t in config.tasks if t not in TASKS]
    if unknown or not config.tasks:
        raise UsageError(f"--tasks: {', '.join(unknown) or 'none given'}; choose from {', '.join(TASKS)}")
    _check_out_folder(out, ("results.jsonl", "summary.json"))
    filler = _haystack_text(haystack)
    session = _routed_session(model, threads, routing, config.lengths)
    rows = run_grid(session, config, out / "results.jsonl", filler=filler,
                    haystack_name=str(haystack or ""), log=lambda line: err(f"kvlocal: {line}"))
    prefill_tag = session.prefill_tag(config.prefill)
    summary = report.summarize([r for r in rows if r["length"] in config.lengths and r["task"] in config.tasks
                                and r.get("prefill", "dense") == prefill_tag])
    report.write_json(summary, out / "summary.json")
    print(report.markdown(summary))
    if plots:
        try:
            for path in report.plot(rows, summary, out):
                err(f"kvlocal: wrote {path}")
        except ImportError as e:
            err(f"kvlocal: no plots: {e}")
    return summary


@eval_app.command("grid")
@handles_errors
@option_groups
def eval_grid(
    lengths: LengthsOpt = "4k,8k,16k,32k",
    depths: DepthsOpt = 11,
    tasks: TasksOpt = "passkey",
    modes: ModesOpt = ",".join(MODES),
    sweep: SweepOpt = "",
    seeds: SeedsOpt = "0",
    haystack: HaystackOpt = None,
    out: OutOpt = Path("kvlocal-eval"),
    plots: PlotsOpt = True,
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = None,
    threads: ThreadsOpt = None,
    routing: RouteOptions = RouteOptions(),
    prefill: PrefillOpt = DEFAULT_PREFILL,
    prefilling: PrefillOptions = PrefillOptions(),
) -> None:
    """Needle grid and RULER-style tasks: accuracy and KV reads of every routing mode, on the same prefilled haystacks.

    Results are appended to OUT/results.jsonl as they come (a rerun resumes); the markdown table goes to stdout.
    """
    from kvlocal.evals.runner import GridConfig, depth_grid

    config = GridConfig(
        lengths=parse_lengths(lengths), depths=depth_grid(depths), tasks=[t.strip() for t in tasks.split(",") if t.strip()],
        modes=_modes(modes, routing), seeds=parse_seeds(seeds),
        route=routing.config(DEFAULT_MODE),  # each mode's route: these settings in that mode
        sweep=bounded("--sweep", ints(sweep), 0, MAX_TOP_K), max_tokens=max_tokens, prefill=prefilling.config(prefill),
    )
    _grid(config, haystack, out, plots, model, threads, routing)


# `kvlocal eval quick`: a 2k context holds about 18 regions; with 4 routed ones geometric matches dense
# there and the controls at the same budget miss needles outside the window (at 4k, top-4 does not match
# dense yet: see BENCHMARKS.md)
QUICK_TOP_K = 4


@eval_app.command("quick")
@handles_errors
def eval_quick(
    out: OutOpt = Path("kvlocal-eval"),
    plots: PlotsOpt = True,
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """A few minutes' check: passkey at 2k, two depths, every mode at top-4; exit status 1 unless geometric matches full and window and random fall below it."""
    from kvlocal.evals.report import check_ordering
    from kvlocal.evals.runner import GridConfig

    routing = replace(RouteOptions(), top_k=QUICK_TOP_K)
    config = GridConfig(lengths=[2048], depths=[0.25, 0.5], tasks=["passkey"], modes=_modes(",".join(MODES), routing),
                        seeds=[0], route=routing.config(DEFAULT_MODE))
    problems = check_ordering(_grid(config, None, out, plots, model, threads, routing))
    for p in problems:
        err(f"kvlocal: check failed: {p}")
    if problems:
        raise typer.Exit(1)
    err("kvlocal: check passed: geometric matches full; window and random fall below on needles outside the window")


@eval_app.command("ruler")
@handles_errors
@option_groups
def eval_ruler(
    lengths: LengthsOpt = "4k",
    tasks: TasksOpt = "all",
    modes: ModesOpt = ",".join(MODES),
    seeds: SeedsOpt = "0",
    out: OutOpt = Path("kvlocal-eval"),
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = None,
    threads: ThreadsOpt = None,
    also: AlsoOpt = "",
    routing: RouteOptions = RouteOptions(),
) -> None:
    """RULER's 13 tasks (--tasks all or names; --seeds: sample indices), generated offline: per-task and average scores of every mode on the same prefilled samples (docs/experiments/ruler.md)."""
    from kvlocal.evals.ruler_runner import RESULTS, eval_command

    _check_out_folder(out, (RESULTS,))
    lengths_list = parse_lengths(lengths)
    eval_command(lengths_list, tasks, parse_seeds(seeds), modes, routing.config(DEFAULT_MODE), max_tokens, out,
                 lambda: _routed_session(model, threads, routing, lengths_list), _log, also)


def _library_sizes(sizes: str, facts_per_doc: int) -> list[int]:
    from kvlocal.evals.library_cases import max_documents

    return bounded("the set size N", ints(sizes), 1, max_documents(facts_per_doc))


def _references(text: str) -> list[str]:
    """--references of the library and question evals, each checked."""
    from kvlocal.evals.library_runner import REFERENCES

    refs = [r.strip() for r in text.split(",") if r.strip() and r.strip() != "none"]
    unknown = [r for r in refs if r not in REFERENCES]
    if unknown:
        raise UsageError(f"--references: {', '.join(unknown)}; choose from {', '.join(REFERENCES)} or none")
    return refs


@eval_app.command("library")
@handles_errors
@option_groups
def eval_library(
    sizes: LibrarySizesArg,
    lengths: LengthsOpt = "8k",
    facts_per_doc: FactsPerDocOpt = 2,
    sets_per_seed: SetsPerSeedOpt = 1,
    references: ReferencesOpt = "alone",
    alone_modes: AloneModesOpt = "full",
    layout: LayoutOpt = "auto",
    paraphrase: ParaphraseOpt = False,
    modes: ModesOpt = ",".join(MODES),
    seeds: SeedsOpt = "0",
    haystack: HaystackOpt = None,
    out: OutOpt = Path("kvlocal-eval"),
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = None,
    threads: ThreadsOpt = None,
    routing: RouteOptions = RouteOptions(),
) -> None:
    """Look-alike facts (one sentence, one key word changed) spread over sets of N documents, asked of each set in every mode and of the references (kvlocal/evals/library_runner.py).

    Results are appended to OUT/results.jsonl as they come (a rerun resumes); the markdown table goes to stdout.
    """
    from kvlocal.evals import library_report
    from kvlocal.evals.library_cases import max_documents
    from kvlocal.evals.library_runner import LibraryConfig, run_library
    from kvlocal.library import check_composable

    size_list = _library_sizes(sizes, 1)
    for n in size_list:
        if n * sets_per_seed > max_documents(facts_per_doc):
            raise UsageError(f"N={n} with --sets-per-seed {sets_per_seed}: a seed has {max_documents(facts_per_doc)} "
                             f"documents with {facts_per_doc} facts each")
    refs = _references(references)
    if layout not in ("auto", "consecutive", "parallel"):
        raise UsageError(f"--layout: {layout}; choose auto, consecutive or parallel")
    mode_list, length_list = _modes(modes, routing), parse_lengths(lengths)
    alone_list = tuple(_modes(alone_modes, routing))
    configs = [LibraryConfig(n, length_list, parse_seeds(seeds), mode_list, route=routing.config(DEFAULT_MODE),
                             references=refs, alone_modes=alone_list, facts_per_doc=facts_per_doc,
                             layout=None if layout == "auto" else layout,
                             max_tokens=max_tokens, sets_per_seed=sets_per_seed, paraphrase=paraphrase) for n in size_list]
    _check_out_folder(out)
    filler = _haystack_text(haystack)
    session = common.open_session(model, None, threads, "f16", routing.centroid_block, routing.centroid_type)
    check_composable(session)
    common.check_lengths_fit(session, length_list)
    for config in configs:
        rows = run_library(session, config, out / "results.jsonl", filler=filler, haystack_name=str(haystack or ""),
                           log=lambda line: err(f"kvlocal: {line}"))
    rows = [r for r in rows if r.get("n_documents") in (None, *size_list) and r.get("length") in (None, *length_list)]
    print(library_report.markdown(library_report.summarize(rows)))



@eval_app.command("questions")
@handles_errors
@option_groups
def eval_questions(
    question_file: QuestionFileArg,
    references: ReferencesOpt = "alone",
    modes: ModesOpt = "full,geometric",
    out: OutOpt = Path("kvlocal-eval"),
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = None,
    threads: ThreadsOpt = None,
    routing: RouteOptions = RouteOptions(),
) -> None:
    """Questions written by hand about real documents (FILE), asked of the documents as one set in every mode and of each document alone in full attention and the default route (kvlocal/evals/question_sets.py).

    Results are appended to OUT/results.jsonl as they come (a rerun resumes); the markdown table goes to stdout.
    """
    from kvlocal.evals import library_report
    from kvlocal.evals.library_runner import LibraryConfig, run_questions
    from kvlocal.evals.question_sets import load_question_set
    from kvlocal.library import check_composable

    refs = _references(references)
    mode_list = _modes(modes, routing)
    _check_out_folder(out)
    case = load_question_set(question_file)
    config = LibraryConfig(len(case.documents), [], [case.seed], mode_list, route=routing.config(DEFAULT_MODE),
                           references=refs, max_tokens=max_tokens or QUESTION_ANSWER_TOKENS,
                           alone_modes=("full", DEFAULT_MODE))
    session = common.open_session(model, None, threads, "f16", routing.centroid_block, routing.centroid_type)
    check_composable(session)
    rows = run_questions(session, config, case, question_file.stem, out / "results.jsonl",
                         log=lambda line: err(f"kvlocal: {line}"))
    print(library_report.markdown(library_report.summarize(rows)))


# -- bench --------------------------------------------------------------------------------------


def _here_first(placement, here: bool, label: str, log, measure, open_local):
    """With --rpc (and --here): `measure` run on a session of `open_local()` with every layer on this
    machine, before the servers' run, so that one report holds what the servers cost (the documents are
    prefilled here, where it is faster, and cached for the servers' run); None otherwise."""
    if placement is None or not here:
        return None
    from kvlocal.rpc import check_servers

    check_servers(placement)  # an unreachable server: one line before any work
    log(f"{label}: every layer on this machine first")
    local = open_local()
    try:
        measured = measure(local)
    finally:
        local.close()
    log(f"{label}: layers split with {', '.join(map(str, placement.servers))}")
    return measured


@bench_app.command("document")
@handles_errors
@option_groups
def bench_document(
    lengths: LengthsOpt = "8k,16k,32k",
    tokens: TokensOpt = 48,
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    out: OutOpt = None,
    routing: RouteOptions = RouteOptions(),
    upkeep: UpkeepOpt = True,
    ttft: TtftOpt = True,
    controls: ControlsOpt = False,
    plain_loop: PlainLoopOpt = False,
    other_attention: OtherAttentionOpt = False,
    prefill_lengths: PrefillLengthsOpt = "8k,16k,32k",
    prefill_routed: PrefillRoutedOpt = True,
    prefilling: PrefillOptions = PrefillOptions(),
    distributed: RpcOptions = RpcOptions(),
    here: HereOpt = True,
) -> None:
    """Decode speed of geometric vs full on the same prefilled state, dense vs routed prefill, memory, and time to first token.

    With --rpc the same answers are first decoded with every layer on this machine (unless --no-here; the
    documents are prefilled and cached there), so one run reports what the servers cost: tok/s here and
    over RPC, and the bytes each answer step sent and received over the servers' connections."""
    import json

    from kvlocal.atomic import write_text_atomic
    from kvlocal.evals import bench as b
    from kvlocal.evals.report import bench_text
    from kvlocal.evals.runner import make_case

    route = routing.config("geometric")
    context_lengths = parse_lengths(lengths)
    prefill_context = [] if prefill_lengths.strip().lower() == "none" else parse_lengths(prefill_lengths)
    prefill_cfg = prefilling.config("routed")
    if out:
        common.check_out_file(out)
    placement = distributed.config()
    log = lambda line: err(f"kvlocal: {line}")  # noqa: E731

    def measure_here(local):
        common.check_lengths_fit(local, context_lengths)
        return b.bench_lengths(local, context_lengths, route, n_tokens=tokens, log=log)

    here_runs = _here_first(placement, here, "bench", log, measure_here,
                            lambda: common.open_session(model, None, threads, "f16", routing.centroid_block,
                                                        routing.centroid_type))
    session = common.open_session(model, None, threads, "f16", routing.centroid_block, routing.centroid_type,
                                  placement)
    common.check_lengths_fit(session, context_lengths + prefill_context)
    results = b.bench_lengths(session, context_lengths, route, n_tokens=tokens, log=log, controls=controls,
                              plain_loop=plain_loop, other_attention=other_attention)
    prefills = b.bench_prefill(session, prefill_context, prefill_cfg, log=log, routed=prefill_routed)
    small = make_case(session, "passkey", 4096, [0.5], 1) if ttft or upkeep else None  # the 4k document
    first_token = b.time_to_first_token(session, small.text, route, small.probes[0].question) if ttft else {}
    report = b.document_report(session, results, route, prefill_cfg, prefills, first_token, here_runs)
    session.close()
    if upkeep:
        report["centroid_upkeep"] = b.centroid_upkeep_share(model, small.text, threads, routing.centroid_block)
    print(bench_text(report))
    if out:
        write_text_atomic(out, json.dumps(report, indent=2))


@bench_app.command("library")
@handles_errors
@option_groups
def bench_library(
    sizes: LibrarySizesArg,
    lengths: LengthsOpt = "8k",
    tokens: TokensOpt = 48,
    set_seed: SetSeedOpt = 0,
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    out: OutOpt = None,
    routing: RouteOptions = RouteOptions(),
    distributed: RpcOptions = RpcOptions(),
    here: HereOpt = True,
) -> None:
    """Sets of N documents readied from their cached states, then decoded full and geometric back to back.

    With --rpc each set is first decoded with every layer on this machine (unless --no-here), then with
    the layers split over the servers: tok/s here and over RPC, and the bytes each answer step put on the
    wire."""
    import json

    from kvlocal.atomic import write_text_atomic
    from kvlocal.evals import bench as b
    from kvlocal.evals.library_report import bench_text
    from kvlocal.library import check_composable

    route = routing.config("geometric")
    size_list, length_list = _library_sizes(sizes, 1), parse_lengths(lengths)
    if len(length_list) != 1:
        raise UsageError("bench library benches one document length at a time; give one --lengths")
    if out:
        common.check_out_file(out)
    placement = distributed.config()
    log = lambda line: err(f"kvlocal: {line}")  # noqa: E731

    def measure_here(local):
        check_composable(local)
        common.check_lengths_fit(local, length_list)
        return b.bench_library(local, size_list, length_list[0], route, n_tokens=tokens, seed=set_seed, log=log)

    here_runs = _here_first(placement, here, "bench library", log, measure_here,
                            lambda: common.open_session(model, None, threads, "f16", routing.centroid_block,
                                                        routing.centroid_type))
    session = common.open_session(model, None, threads, "f16", routing.centroid_block, routing.centroid_type,
                                  placement)
    check_composable(session)
    common.check_lengths_fit(session, length_list)
    results = b.bench_library(session, size_list, length_list[0], route, n_tokens=tokens, seed=set_seed, log=log)
    report = b.library_report(session, results, route, set_seed, here_runs)
    session.close()
    print(bench_text(report))
    if out:
        write_text_atomic(out, json.dumps(report, indent=2))


@bench_app.command("serve")
@handles_errors
@option_groups
def bench_serve(
    lengths: LengthsOpt = "8k",
    askers: Annotated[str, typer.Option(
        "--askers", help="Askers at once, e.g. 1,2,4,8: each count's requests decode together in one batch.")] = "1,2,4,8",
    tokens: TokensOpt = 48,
    probes: Annotated[int, typer.Option(
        "--probes", min=BUSY_ASKERS, max=32, help="Planted facts asked alone and 4 at a time (same answers?).")] = 8,
    modes: ModesOpt = "geometric,full",
    documents: Annotated[str, typer.Option(
        "--documents", help="one: every asker asks one document (sent as a file); each: every asker its own "
        "document of the length, all named at the server's start and held side by side.")] = "one",
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    out: OutOpt = None,
    routing: RouteOptions = RouteOptions(),
) -> None:
    """Many askers through the real server (kvlocal serve --batch), of one document or each of its own:
    aggregate decode tok/s per route with 1, 2, 4, 8 askers, the same answers alone and 4 at a time, and
    time to first token idle and beside 4 decoding answers."""
    import json

    from kvlocal.atomic import write_text_atomic
    from kvlocal.evals.serve_bench import bench_serve as run, serve_text
    from kvlocal.route_settings import MAX_ANSWERS
    from kvlocal.serve.schemas import Limits

    mode_list = _modes(modes, routing)
    routes = {mode: routing.config(mode) for mode in mode_list}
    length_list = parse_lengths(lengths)
    asker_counts = bounded("--askers", ints(askers), 1, MAX_ANSWERS)
    if not mode_list or not asker_counts:
        raise UsageError("give at least one of --modes and of --askers")
    if documents not in ("one", "each"):
        raise UsageError(f"--documents is one or each (got {documents!r})", setting="documents")
    if 3 * tokens > Limits().max_tokens:  # the answers decoding while a probe is timed are 3x as long
        raise UsageError(f"--tokens: at most {Limits().max_tokens // 3} (got {tokens})", setting="tokens")
    if out:
        common.check_out_file(out)
    report = run(model, threads, length_list, mode_list, routes, sorted(set(asker_counts)), tokens, probes,
                 routing.centroid_block, routing.centroid_type, log=lambda line: err(f"kvlocal: {line}"),
                 documents=documents)
    print(serve_text([report]))
    if out:
        write_text_atomic(out, json.dumps(report, indent=2))


# -- lab ----------------------------------------------------------------------------------------


def _lab_captures(lab: LabOptions, table: dict, model, threads, *, name_of, load, capture):
    """The lab's options checked before any work, then OUT made and the haystacks' captures (found there, or
    captured on the engine at first use): (rules, budgets, geometry, captures)."""
    from kvlocal.evals.runner import depth_grid
    from kvlocal.evals.tasks import TASKS
    from kvlocal.lab import runs
    from kvlocal.lab.rules import Geometry

    names = list(table) if lab.rules.strip() == "all" else [r.strip() for r in lab.rules.split(",") if r.strip()]
    unknown = [r for r in names if r not in table]
    if unknown or not names:
        raise UsageError(f"--rules: {', '.join(unknown) or 'none given'}; choose from {', '.join(table)}")
    tasks = [t.strip() for t in lab.tasks.split(",") if t.strip()]
    if not tasks or any(t not in TASKS or t == "cwe" for t in tasks):
        raise UsageError(f"--tasks: choose from {', '.join(t for t in TASKS if t != 'cwe')}")
    ks = ints(lab.budgets)
    if not ks or min(ks) < 1:
        raise UsageError("--budgets: give positive region counts, e.g. 4,8")
    bounded("--budgets", ks, 1, MAX_TOP_K)
    lengths = parse_lengths(lab.lengths)
    # the region geometry checked as the engine would (the lab keeps no centroid block)
    RouteOptions(top_k=max(ks), region=lab.region, window=lab.window, sinks=lab.sinks, centroid_block=0).config("geometric")
    lab.out.mkdir(parents=True, exist_ok=True)
    # the session opened at the first capture (through cli_common, which tests replace)
    open_session = lambda: common.check_lengths_fit(common.open_session(model, None, threads, "f16"), lengths)  # noqa: E731
    found = runs.captures(lab.out, lengths, tasks, ints(lab.seeds), depth_grid(lab.depths), open_session,
                          name_of=name_of, load=load, capture=capture, haystack=lab.haystack, log=_log)
    return names, ks, Geometry(region=lab.region, sinks=lab.sinks, window=lab.window), found


def _log(line: str) -> None:
    err(f"kvlocal: {line}")


@lab_app.command("decode")
@handles_errors
@option_groups
def lab_decode(
    lab: LabOptions = LabOptions(),
    layer_budget: LayerBudgetOpt = "",
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """Capture the dense model's real queries and keys once per haystack, then replay selection rules offline.

    Per rule and budget: the attention-mass recall of the heads that reach beyond the sinks and window, whether the asked fact's region is read by the heads that attend to it, and the KV bytes the rule would read (metadata included); per probe (probes.jsonl), the answer step that first lost the fact and the layers and heads that lost it. Captures stay in OUT: a second run replays without the engine. With --haystack the facts are planted in that document, as `kvlocal eval --haystack` plants them.
    """
    from kvlocal.evals.runner import task_answer_tokens
    from kvlocal.lab import decode, runs
    from kvlocal.lab.rules import RULES

    names, ks, geo, found = _lab_captures(
        lab, RULES, model, threads, name_of=lambda task, length, seed: f"{task}-{length}-s{seed}-d{lab.depths}",
        load=decode.CaseCapture.load,
        capture=lambda session, case, task, name, log: decode.capture_case(session, case, name,
                                                                           task_answer_tokens(task), log=log))
    print(runs.decode_lab(lab.out, found, names, ks, geo, layer_budget, _log))


@lab_app.command("prefill")
@handles_errors
@option_groups
def lab_prefill(
    lab: LabOptions = LabOptions(),
    chunks: ChunksOpt = "512,128",
    prefill_from: PrefillFromOpt = PREFILL_FROM,
    estimates: EstimatesOpt = False,
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """Routed-prefill rules replayed offline: the queries of the document's ubatches that hold facts (from --prefill-from on), each chunk of --chunks tokens choosing --budgets regions; per rule, chunk and budget the attention-output error of those rows against dense prefill."""
    from kvlocal.lab import prefill, runs

    chunk_list = ints(chunks)
    if not chunk_list or min(chunk_list) < 1:
        raise UsageError("--chunks: give positive token counts, e.g. 512,128")
    names, ks, geo, found = _lab_captures(
        lab, prefill.PREFILL_RULES, model, threads,
        name_of=lambda task, length, seed: f"prefill-{task}-{length}-s{seed}-d{lab.depths}-from{prefill_from}",
        load=prefill.PrefillCapture.load,
        capture=lambda session, case, task, name, log: prefill.capture_prefill(session, case, name, prefill_from, log=log))
    print(runs.prefill_lab(lab.out, found, names, chunk_list, ks, geo, estimates, _log))


@lab_app.command("hints")
@handles_errors
def lab_hints(
    sizes: LibrarySizesArg,
    lengths: LengthsOpt = "8k",
    seeds: SeedsOpt = "0",
    hints: HintsOpt = 1,
    hint_scope: HintScopeOpt = "sentence",
    paraphrase: ParaphraseOpt = False,
    haystack: HaystackOpt = None,
    out: OutOpt = Path("kvlocal-lab"),
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    region: RegionOpt = REGION,
    sinks: SinksOpt = SINKS,
) -> None:
    """The text hints on library sets of N documents, from their tokens alone (seconds a set): where each fact's hint points and whether the regions it reads hold the asked code (kvlocal/lab/hints.py)."""
    from kvlocal.hints import SCOPES
    from kvlocal.lab import runs

    scopes = list(SCOPES) if hint_scope == "both" else [hint_scope]
    if any(s not in SCOPES for s in scopes):
        raise UsageError(f"--hint-scope: {hint_scope}; choose sentence, region or both")
    size_list, length_list, seed_list = _library_sizes(sizes, 2), parse_lengths(lengths), parse_seeds(seeds)
    RouteOptions(region=region, sinks=sinks, centroid_block=0).config("geometric")  # checked as the engine would
    filler = _haystack_text(haystack)
    session = common.check_lengths_fit(common.open_session(model, None, threads, "f16"), length_list)
    print(runs.hints_lab(session, out, size_list, length_list, seed_list, hints=hints, scopes=scopes, region=region,
                         sinks=sinks, filler=filler, haystack_name=str(haystack or ""), paraphrase=paraphrase,
                         log=lambda line: err(f"kvlocal: {line}")))


@lab_app.command("copies")
@handles_errors
@option_groups
def lab_copies(
    lengths: LengthsOpt = "4k",
    tasks: TasksOpt = "vt,niah_multivalue,niah_multikey_3,niah_multiquery",
    seeds: SeedsOpt = "0",
    out: OutOpt = Path("kvlocal-lab"),
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    routing: RouteOptions = RouteOptions(),
) -> None:
    """Where a routed answer loses a value it copies, on RULER's samples (--tasks: RULER's names; --seeds: sample indices): at each answer step, the share of routed layers' KV heads that read the region holding the character to write next, and what the others read instead, before and at the first wrong character (kvlocal/lab/copies.py). Rows in OUT/copies.jsonl; a rerun answers only what no row holds for this route."""
    from kvlocal.evals.ruler_runner import parse_tasks
    from kvlocal.lab import copies

    _check_out_folder(out, (copies.COPIES,))
    task_list, length_list, seed_list = parse_tasks(tasks), parse_lengths(lengths), parse_seeds(seeds)
    route = routing.config("geometric")
    session = _routed_session(model, threads, routing, length_list)
    rows = copies.run_copies(session, out, length_list, task_list, seed_list, route, _log)
    print(copies.markdown(copies.summarize(rows)))
