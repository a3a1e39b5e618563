"""The `kvlocal` command line. The answer goes to stdout; progress, summaries and errors to stderr."""

from __future__ import annotations

import functools
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvlocal import __version__
from kvlocal.cli_options import (
    LIBRARY,
    PREFILL,
    AllowRemoteOpt,
    CtxOpt,
    HaystackOpt,
    HintsOpt,
    KvTypeOpt,
    LengthsOpt,
    LibraryOpt,
    MaxKvOpt,
    MaxTokensOpt,
    ModelOpt,
    NoCacheOpt,
    OutOpt,
    ParaphraseOpt,
    PrefillOpt,
    PrefillOptions,
    RegionOpt,
    RouteOpt,
    RouteOptions,
    RpcHostOpt,
    RpcMemOpt,
    RpcOpt,
    RpcOptions,
    RpcPortOpt,
    SeedOpt,
    SinksOpt,
    TemperatureOpt,
    ThreadsOpt,
    WindowOpt,
    option_groups,
)
from kvlocal.errors import KvlocalError
from kvlocal.rpc import DEFAULT_PORT
from kvlocal.route_settings import (
    DEFAULT_CENTROID_BLOCK,
    DEFAULT_MODE,
    DEFAULT_PREFILL,
    DEFAULT_PREFILL_FROM as PREFILL_FROM,
    DEFAULT_REGION as REGION,
    DEFAULT_SINKS as SINKS,
    DEFAULT_WINDOW as WINDOW,
    MAX_ANSWER_TOKENS,
    MAX_SEED,
    MAX_CTX,
    MAX_TOP_K,
)

app = typer.Typer(
    help="Ask questions about long documents with a local Qwen model that reads only a routed part of its KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
cache_app = typer.Typer(help="Saved KV states of prefilled documents.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


DEFAULT_EVAL_LENGTHS = "4k,8k,16k,32k"  # the needle grid's (a --library set's documents default to 8k)
DEFAULT_BENCH_LENGTHS = "8k,16k,32k"  # the single-document bench's (likewise)

def err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def option_hint(setting: str | None) -> str:
    """The option that sets a core setting, as a hint after a core error (RouteConfig and Session
    fields are named as the options are: top_k is --top-k)."""
    return f" (option --{setting.replace('_', '-')})" if setting else ""


def handles_errors(fn):
    """One-line errors with the error's exit code; Ctrl-C exits 130 without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KvlocalError as e:
            err(f"kvlocal: error: {e}{option_hint(e.setting)}")
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err("\nkvlocal: interrupted")
            raise typer.Exit(130) from None
        except OSError as e:  # a file or folder kvlocal had to write or read (cache dir, --out)
            where = f": {e.filename}" if e.filename else ""
            err(f"kvlocal: error: {e.strerror or e}{where}")
            raise typer.Exit(1) from None

    return wrapper


def _text_arg(text: str) -> str:
    """A free-text argument as valid Unicode: bytes that are not UTF-8 (a Latin-1 terminal's é reaches
    argv as a lone surrogate, surrogateescape) become U+FFFD, so they cannot fail later in the
    tokenizer or on output. Paths are not passed through this: they must still open their file."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate that surrogateescape did not make
        return text.encode("utf-8", "replace").decode("utf-8")


def _check_out_file(path: Path) -> None:
    """A file the command writes at its end: refuse a bad path before any work is done."""
    from kvlocal.errors import UsageError

    if path.is_dir():
        raise UsageError(f"--out {path} is a folder; give a file name")
    if not path.parent.is_dir():
        raise UsageError(f"--out {path}: the folder {path.parent} does not exist")


def _check_lengths_fit(session, lengths: list[int]) -> None:
    from kvlocal.errors import UsageError

    too_long = [n for n in lengths if n > session.trained_ctx]
    if too_long:
        raise UsageError(f"context lengths {', '.join(map(str, too_long))} exceed the model's trained context "
                         f"{session.trained_ctx}")


def _open_session(model, ctx, threads, kv_type, centroid_block=DEFAULT_CENTROID_BLOCK, centroid_type=None,
                  placement=None):
    """The session of `model` (it loads a document, or a set through kvlocal.library); centroids of
    `centroid_type`, or (None) the type of the model's route; layers on RPC servers by `placement`."""
    from kvlocal.progress import StatusLine, download_text
    from kvlocal.session import Session

    line = StatusLine()
    session = Session(
        model, n_ctx=ctx, threads=threads, kv_type=kv_type, centroid_block=centroid_block, centroid_type=centroid_type,
        placement=placement, model_progress=lambda d, t, s: line.show(download_text(d, t, s)),
    )
    line.done()
    return session


def _load(session, text: str, label: str, use_cache: bool, prefill=None, pages=()):
    """Load one document (`pages`: where its pages start in `text`, for the reads by page)."""
    from kvlocal.progress import StatusLine, load_summary, prefill_text

    line = StatusLine()
    try:
        progress = lambda p: line.show(prefill_text(p))  # noqa: E731
        result = session.load_document(text, label=label, pages=pages, progress=progress, use_cache=use_cache,
                                       prefill=prefill)
    finally:
        line.done()
    if result.rebuilt_reason:
        err(f"kvlocal: {result.rebuilt_reason}")
    err(f"kvlocal: {load_summary(result)}")
    return result


def _stream_answer(session, question: str, *, tally=None, **kwargs) -> str:
    """Stream the answer to stdout, its summary to stderr; `tally` (a library's SetReads) counts each
    step's reads by document and says where they came from."""
    from kvlocal.progress import answer_summary

    answer = session.ask(question, want_regions=tally is not None, **kwargs)
    for piece in answer:
        if tally is not None:
            tally.add(piece.stats)
        sys.stdout.write(piece.text)
        sys.stdout.flush()
    summary = answer.summary()
    sys.stdout.write("\n")
    sys.stdout.flush()
    err(f"kvlocal: {answer_summary(summary)}".replace("\n", "\nkvlocal: "))
    if tally is not None:
        err(f"kvlocal: {tally.describe()}")
    return summary.text


# `kvlocal ask` answered, but some of the files named or found in a folder were skipped (each named
# on stderr): the answer is from the others
EXIT_SKIPPED = 3


def _document_set(documents: list[str], max_kv: str | None):
    """The documents named (files and folders, expanded) and the KV limit, both checked before any
    engine work; each skipped file named in one line."""
    from kvlocal.docset import DocumentSet, default_max_kv, expand_documents, parse_size
    from kvlocal.ingest import load_document

    limit = parse_size(max_kv) if max_kv is not None else default_max_kv()
    if len(documents) == 1 and not Path(documents[0]).is_dir():  # one file: its own error if unusable, as always
        return DocumentSet([load_document(documents[0])]), limit
    docs = expand_documents(documents)
    for skipped in docs.skipped:
        err(f"kvlocal: {skipped.message}")
    return docs, limit


def _load_set(session, docs, use_cache: bool, prefill=None):
    """Load a set through the library (one document: exactly `_load`), with a line per document."""
    from kvlocal.library import load_set
    from kvlocal.progress import StatusLine, prefill_text, set_summary

    if len(docs) == 1:
        return _load(session, docs[0].text, docs[0].source, use_cache, prefill, pages=docs[0].pages)
    line = StatusLine()
    try:
        result = load_set(session, docs, progress=lambda p: line.show(prefill_text(p)),
                          log=lambda text: (line.done(), err(f"kvlocal: {text}")), use_cache=use_cache, prefill=prefill)
    finally:
        line.done()
    for text in set_summary(result):
        err(f"kvlocal: {text}")
    return result


# -- commands -------------------------------------------------------------------------------


@app.command()
@handles_errors
@option_groups
def ask(
    documents: Annotated[list[str], typer.Argument(
        metavar="DOCUMENT...", help="PDF, .txt, .md, .html or .epub files, folders of them, or - for stdin.")],
    question: Annotated[str, typer.Argument(help="The question to answer from the documents (the last argument).")],
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = 256,
    route: RouteOpt = DEFAULT_MODE,
    no_cache: NoCacheOpt = False,
    ctx: CtxOpt = None,
    threads: ThreadsOpt = None,
    kv_type: KvTypeOpt = "f16",
    temperature: TemperatureOpt = 0.0,
    routing: RouteOptions = RouteOptions(),
    seed: SeedOpt = 0,
    prefill: PrefillOpt = DEFAULT_PREFILL,
    prefilling: PrefillOptions = PrefillOptions(),
    max_kv: MaxKvOpt = None,
    distributed: RpcOptions = RpcOptions(),
) -> None:
    """Answer QUESTION from one or several DOCUMENTs; the answer streams to stdout, progress and KV reads to stderr.

    Several documents (or folders: their supported files, recursively) are asked as one set: each is
    prefilled once and cached on its own, and the set is assembled from the cached states. A file that
    cannot be read is named and skipped; the others are answered and the exit status is 3.
    """
    from kvlocal.library import check_set_fits
    from kvlocal.session import check_ask_settings

    route_cfg = routing.config(route, seed)
    prefill_cfg = prefilling.config(prefill)
    question = _text_arg(question)  # the documents stay as given: paths
    check_ask_settings(question, max_tokens, temperature, seed)
    docs, limit = _document_set(documents, max_kv)
    session = _open_session(model, ctx, threads, kv_type, routing.centroid_block, routing.centroid_type,
                            distributed.config())
    if len(docs.documents) > 1:  # one document: bounded by the trained context, and the single-document path
        check_set_fits(session, docs.documents, limit)
    _load_set(session, docs.documents, not no_cache, prefill_cfg)
    # a set, or one PDF: the reads by document (and page) after the answer
    tally = session.read_tally() if len(docs.documents) > 1 or docs.documents[0].pages else None
    _stream_answer(session, question, tally=tally, route=route_cfg, max_tokens=max_tokens, temperature=temperature,
                   seed=seed)
    if docs.skipped:
        err(f"kvlocal: answered from {len(docs.documents)} of {len(docs.documents) + len(docs.skipped)} files "
            f"({len(docs.skipped)} skipped); exit status {EXIT_SKIPPED}")
        raise typer.Exit(EXIT_SKIPPED)


@app.command()
@handles_errors
def demo(
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    route: RouteOpt = DEFAULT_MODE,
) -> None:
    """Ask the built-in sample document its built-in question (the README's first command)."""
    from kvlocal import paths
    from kvlocal.sample import SAMPLE_QUESTION, write_sample

    route_cfg = RouteOptions().config(route)
    path = write_sample(paths.cache_root() / "sample" / "halvard-ridge-report.txt")
    err(f"kvlocal: sample document {path}")
    err(f"kvlocal: question: {SAMPLE_QUESTION}")
    session = _open_session(model, None, threads, "f16")
    _load(session, path.read_text(), str(path), True)
    _stream_answer(session, SAMPLE_QUESTION, route=route_cfg, max_tokens=64)


@app.command()
@handles_errors
def models() -> None:
    """List the model aliases, their packages and whether they are installed."""
    from kvlocal.models import ALIASES, DEFAULT_ALIAS, model_status
    from kvlocal.route_settings import UNCALIBRATED_ROUTE, model_route
    from kvlocal.units import human_bytes

    for alias, spec in ALIASES.items():
        default = " (default)" if alias == DEFAULT_ALIAS else ""
        print(f"{alias}{default}")
        print(f"  {spec.description}")
        print(f"  {len(spec.packages)} packages {spec.packages[0]} … =={spec.version}, {human_bytes(spec.size)}")
        print(f"  sha256 {spec.sha256}")
        route = model_route(spec.sha256)
        calibrated = "not calibrated, the uniform route" if route is UNCALIBRATED_ROUTE else "calibrated"
        print(f"  route: {route.describe()} ({calibrated})")
        print(f"  status: {model_status(alias)}")


@app.command()
@handles_errors
def doctor(rpc: RpcOpt = None) -> None:
    """Report the engine build, its patch set, backends, the RPC servers it can reach, the default model and the cache."""
    from kvlocal import kvstate, paths
    from kvlocal.engine import ENGINE_VERSION, backend_devices, engine_info
    from kvlocal.models import DEFAULT_ALIAS, model_status
    from kvlocal.rpc import rpc_report
    from kvlocal.units import human_bytes

    info = engine_info()
    print(f"kvlocal {__version__}")
    print(f"engine pin: llama-cpp-python {ENGINE_VERSION} (installed: {info.version})")
    print(f"engine build id: {info.build_id or 'none'}")
    state = "patched" if info.patched else "STOCK (not patched)"
    if info.patched and not info.current:
        state += f", OUT OF DATE (patches/ is {info.repo_patchset})"
    print(f"engine: {state}; patch set {info.patchset or '-'} (repository: {info.repo_patchset or '-'})")
    print(f"GPU offload: {'yes' if info.gpu_offload else 'no'}")
    for dev in backend_devices():
        memory = f", {human_bytes(dev.memory_total)}" if dev.memory_total else ""
        print(f"device {dev.name}: {dev.description} ({dev.kind}{memory})")
    print(f"system: {info.system_info}")
    print("\n".join(rpc_report(rpc)))
    print(f"default model {DEFAULT_ALIAS}: {model_status(DEFAULT_ALIAS)}")
    try:
        entries = kvstate.list_entries()
    except KvlocalError as e:  # e.g. KVLOCAL_CACHE_DIR names a file: report it with the rest
        print(f"cache dir: UNUSABLE: {e}")
    else:
        print(f"cache dir: {paths.cache_root()} ({len(entries)} saved KV states)")


@app.command("rpc-server")
@handles_errors
def rpc_server(
    host: RpcHostOpt = "127.0.0.1",
    port: RpcPortOpt = DEFAULT_PORT,
    threads: ThreadsOpt = None,
    mem: RpcMemOpt = None,
    allow_remote: AllowRemoteOpt = False,
) -> None:
    """Serve this machine's memory and CPU to `kvlocal ask --rpc HOST:PORT` on another: llama.cpp's RPC server,
    built with this engine. It holds the layers a client gives it and their KV cache; Ctrl-C stops it."""
    from kvlocal.rpc import serve

    serve(host, port, threads, mem, allow_remote)


@cache_app.command("list")
@handles_errors
def cache_list() -> None:
    """List saved KV states."""
    from kvlocal import kvstate
    from kvlocal.units import human_bytes

    entries = kvstate.list_entries()
    if not entries:
        print("no saved KV states")
        return
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.created))
        ctx = e.key.get("n_ctx", "?")
        print(f"{e.path.stem[:12]}  {when}  {e.n_tokens:>7,} tokens  ctx {ctx}  {human_bytes(e.size):>10}  {e.label}")


@cache_app.command("clear")
@handles_errors
def cache_clear() -> None:
    """Delete every saved KV state."""
    from kvlocal import kvstate

    n = kvstate.clear_entries()
    err(f"kvlocal: removed {n} saved KV state{'s' if n != 1 else ''}")


@app.command()
@handles_errors
@option_groups
def tui(
    documents: Annotated[Optional[list[Path]], typer.Argument(
        metavar="[DOCUMENT]...", help="Documents or folders to open as one set (or pick one in the app).")] = None,
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = 256,
    route: RouteOpt = DEFAULT_MODE,
    ctx: CtxOpt = None,
    threads: ThreadsOpt = None,
    kv_type: KvTypeOpt = "f16",
    routing: RouteOptions = RouteOptions(),
    seed: SeedOpt = 0,
    prefill: PrefillOpt = DEFAULT_PREFILL,
    prefilling: PrefillOptions = PrefillOptions(),
    max_kv: MaxKvOpt = None,
    distributed: RpcOptions = RpcOptions(),
) -> None:
    """The interactive app: load a document or a set, ask, and watch which KV regions each step reads."""
    from kvlocal.docset import parse_size

    route_cfg = routing.config(route, seed)
    prefill_cfg = prefilling.config(prefill)
    limit = parse_size(max_kv) if max_kv is not None else None  # None: the app's default (half the memory)
    _check_terminal()  # before textual is imported
    from kvlocal.tui.app import run_app

    session_settings = {"n_ctx": ctx, "threads": threads, "kv_type": kv_type,
                        "centroid_block": routing.centroid_block, "centroid_type": routing.centroid_type,
                        "placement": distributed.config()}
    code = run_app(documents=documents or [], model=model, route=route_cfg, prefill=prefill_cfg,
                   max_tokens=max_tokens, session_settings=session_settings, max_kv=limit)
    if code:  # 130: interrupted (SIGINT or ctrl+c)
        if code == 130:
            err("kvlocal: interrupted")
        raise typer.Exit(code)


TUI_NEEDS_TERMINAL = ("kvlocal tui needs an interactive terminal (stdin and stdout must be a TTY, TERM not 'dumb'); "
                      "use `kvlocal ask` for scripts")


def _check_terminal() -> None:
    """Refuse to start the app where no one can drive it (a pipe, a file, TERM=dumb): it would run until
    killed and write its escapes into the pipe."""
    import os

    from kvlocal.errors import UsageError

    def is_tty(stream) -> bool:
        try:
            return stream is not None and stream.isatty()
        except (AttributeError, ValueError, OSError):  # closed or replaced stream
            return False

    if not (is_tty(sys.stdin) and is_tty(sys.stdout)) or os.environ.get("TERM", "") == "dumb":
        raise UsageError(TUI_NEEDS_TERMINAL)


def _ints(text: str) -> list[int]:
    from kvlocal.errors import UsageError

    try:
        return [int(x.replace("k", "")) * (1024 if x.endswith("k") else 1) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"expected a comma-separated list of numbers, got {text!r}") from None


def _bounded(option: str, values: list[int], low: int, high: int) -> list[int]:
    """A list option's values, each checked before any work (UsageError naming the option)."""
    from kvlocal.errors import UsageError

    bad = [v for v in values if not low <= v <= high]
    if bad:
        raise UsageError(f"{option}: {', '.join(map(str, bad))} not between {low} and {high:,}")
    return values


MIN_EVAL_LENGTH = 2048  # room for the needles of 11 depths, the question and the answer
MAX_DEPTHS = 101  # needle depths (facts per haystack): one per percent


def _lengths(text: str) -> list[int]:
    from kvlocal.errors import UsageError

    lengths = _ints(text)
    if not lengths:
        raise UsageError("--lengths names no context length")
    short = [n for n in lengths if n < MIN_EVAL_LENGTH]
    if short:
        raise UsageError(f"context lengths must be at least 2k (the haystack needs room for its needles, "
                         f"the question and the answer), got {', '.join(map(str, short))}")
    return _bounded("--lengths", lengths, MIN_EVAL_LENGTH, MAX_CTX)  # the model's context is checked later


@app.command("eval")
@handles_errors
@option_groups
def eval_(
    quick: Annotated[bool, typer.Option("--quick", help="A few minutes' check at 2k (passkey, two depths, top-4): geometric matches full, the controls fall below.")] = False,
    lengths: LengthsOpt = DEFAULT_EVAL_LENGTHS,
    depths: Annotated[int, typer.Option("--depths", min=2, max=MAX_DEPTHS, help="Needle depths from 0% to 100%.")] = 11,
    tasks: Annotated[str, typer.Option("--tasks", help="passkey,multikey,lookalike,onekey,multivalue,multiquery,vartrack,cwe")] = "passkey",
    modes: Annotated[str, typer.Option("--modes", help="Routing modes to compare.")] = "full,geometric,window,random",
    sweep: Annotated[str, typer.Option("--sweep", help="Extra geometric top-k budgets, e.g. 2,4,16.")] = "",
    seeds: Annotated[str, typer.Option("--seeds", help="Haystack seeds.")] = "0",
    haystack: HaystackOpt = None,
    out: OutOpt = Path("kvlocal-eval"),
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Write PNG plots (needs matplotlib).")] = True,
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = None,
    threads: ThreadsOpt = None,
    routing: RouteOptions = RouteOptions(),
    prefill: PrefillOpt = DEFAULT_PREFILL,
    prefilling: PrefillOptions = PrefillOptions(),
    library: LibraryOpt = "",
    sets_per_seed: Annotated[int, typer.Option("--sets-per-seed", rich_help_panel=LIBRARY, min=1, max=40, help="Disjoint --library sets drawn from each seed's documents (the same fact sentence; more facts per seed without more seeds' shapes).")] = 1,
    facts_per_doc: Annotated[int, typer.Option("--facts-per-doc", rich_help_panel=LIBRARY, min=1, max=8, help="Facts planted in each document of a --library set.")] = 2,
    references: Annotated[str, typer.Option("--references", rich_help_panel=LIBRARY, help="What else the --library facts are asked of: alone (each fact of its own document, from its cached state), concat (the set prefilled as one document, where it fits the trained context; 32k: ~30 min on 2 cores), none.")] = "alone",
    layout: Annotated[str, typer.Option("--layout", rich_help_panel=LIBRARY, help="A --library set's positions: auto (consecutive while the set fits the trained context, else parallel), consecutive or parallel.")] = "auto",
    paraphrase: ParaphraseOpt = False,
) -> None:
    """Needle grid and RULER-style tasks: accuracy and KV reads of every routing mode, on the same prefilled haystacks.

    Results are appended to OUT/results.jsonl as they come (a rerun resumes); the markdown table goes to stdout.
    With --library N: look-alike facts (one sentence, one key word changed) spread over N documents, asked of
    the set in every mode and of the references.
    """
    from kvlocal.errors import UsageError
    from kvlocal.evals import report
    from kvlocal.evals.runner import GridConfig, depth_grid, run_grid
    from kvlocal.evals.tasks import TASKS
    from kvlocal.ingest import load_document

    if library.strip():
        if quick:
            raise UsageError("--quick is the needle grid's check; leave out --library")
        _eval_library(library, lengths, facts_per_doc, sets_per_seed, references, layout, modes, seeds, haystack, out,
                      model, max_tokens, threads, routing, paraphrase)
        return
    if quick:
        # a 2k context holds about 18 regions: with 4 routed ones geometric matches dense there and
        # the controls at the same budget miss needles outside the window (at 4k, top-4 does not
        # match dense yet: see BENCHMARKS.md)
        lengths, depths, tasks = "2k", 2, "passkey"
        routing = replace(routing, top_k=4)
    n = max(depths, 2)
    mode_list = [m.strip() for m in modes.split(",")]
    for mode in mode_list:
        routing.config(mode)  # every mode checked with these settings before any work
    config = GridConfig(
        lengths=_lengths(lengths), depths=depth_grid(n) if not quick else [0.25, 0.5],
        tasks=[t.strip() for t in tasks.split(",") if t.strip()], modes=mode_list, seeds=_ints(seeds),
        route=routing.config(DEFAULT_MODE),  # each mode's route: these settings in that mode
        sweep=_bounded("--sweep", _ints(sweep), 0, MAX_TOP_K), max_tokens=max_tokens, prefill=prefilling.config(prefill),
    )
    unknown = [t for t in config.tasks if t not in TASKS]
    if unknown or not config.tasks:
        raise UsageError(f"--tasks: {', '.join(unknown) or 'none given'}; choose from {', '.join(TASKS)}")
    if not config.seeds:
        raise UsageError("--seeds names no seed")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder")
    for name in ("results.jsonl", "summary.json"):
        if (out / name).is_dir():
            raise UsageError(f"--out {out}: {name} there is a folder")
    filler = load_document(haystack).text if haystack else None
    session = _open_session(model, None, threads, "f16", routing.centroid_block, routing.centroid_type)
    _check_lengths_fit(session, config.lengths)
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
    if quick:
        problems = report.check_ordering(summary)
        for p in problems:
            err(f"kvlocal: check failed: {p}")
        if problems:
            raise typer.Exit(1)
        err("kvlocal: check passed: geometric matches full; window and random fall below on needles outside the window")


def _eval_library(sizes: str, lengths: str, facts_per_doc: int, sets_per_seed: int, references: str, layout: str,
                  modes: str, seeds: str, haystack: Path | None, out: Path, model, max_tokens, threads, routing,
                  paraphrase: bool = False) -> None:
    """`kvlocal eval --library N`: see kvlocal/evals/library_runner.py."""
    from kvlocal.errors import UsageError
    from kvlocal.evals import library_report
    from kvlocal.evals.library_cases import max_documents
    from kvlocal.evals.library_runner import REFERENCES, LibraryConfig, run_library
    from kvlocal.library import check_composable
    from kvlocal.ingest import load_document

    size_list = _bounded("--library", _ints(sizes), 1, max_documents(1))
    for n in size_list:
        if n * sets_per_seed > max_documents(facts_per_doc):
            raise UsageError(f"--library {n} --sets-per-seed {sets_per_seed}: a seed has {max_documents(facts_per_doc)} "
                             f"documents with {facts_per_doc} facts each")
    refs = [r.strip() for r in references.split(",") if r.strip() and r.strip() != "none"]
    unknown = [r for r in refs if r not in REFERENCES]
    if unknown:
        raise UsageError(f"--references: {', '.join(unknown)}; choose from {', '.join(REFERENCES)} or none")
    if layout not in ("auto", "consecutive", "parallel"):
        raise UsageError(f"--layout: {layout}; choose auto, consecutive or parallel")
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    for mode in mode_list:
        routing.config(mode)
    length_list = [8192] if lengths == DEFAULT_EVAL_LENGTHS else _lengths(lengths)
    configs = [LibraryConfig(n, length_list, _ints(seeds), mode_list, route=routing.config(DEFAULT_MODE),
                             references=refs, facts_per_doc=facts_per_doc, layout=None if layout == "auto" else layout,
                             max_tokens=max_tokens, sets_per_seed=sets_per_seed, paraphrase=paraphrase) for n in size_list]
    if not configs[0].seeds:
        raise UsageError("--seeds names no seed")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder")
    filler = load_document(haystack).text if haystack else None
    session = _open_session(model, None, threads, "f16", routing.centroid_block, routing.centroid_type, placement)
    check_composable(session)
    _check_lengths_fit(session, length_list)
    for config in configs:
        rows = run_library(session, config, out / "results.jsonl", filler=filler, haystack_name=str(haystack or ""),
                           log=lambda line: err(f"kvlocal: {line}"))
    rows = [r for r in rows if r.get("n_documents") in (None, *size_list) and r.get("length") in (None, *length_list)]
    print(library_report.markdown(library_report.summarize(rows)))


def _lab_hints(sizes: str, lengths: str, seeds: str, hints: int, haystack: Path | None, hint_scope: str,
               paraphrase: bool, out: Path, model, threads, region: int, sinks: int) -> None:
    """`kvlocal lab --library N`: see kvlocal/lab/hints.py."""
    import json

    from kvlocal.atomic import write_text_atomic
    from kvlocal.errors import UsageError
    from kvlocal.evals.library_cases import max_documents
    from kvlocal.evals.library_runner import LibraryConfig, make_set_case
    from kvlocal.hints import SCOPES
    from kvlocal.ingest import load_document
    from kvlocal.library import set_cells
    from kvlocal.lab import hints as lab_hints

    scopes = list(SCOPES) if hint_scope == "both" else [hint_scope]
    if any(s not in SCOPES for s in scopes):
        raise UsageError(f"--hint-scope: {hint_scope}; choose sentence, region or both")
    size_list = _bounded("--library", _ints(sizes), 1, max_documents(2))
    length_list = _lengths(lengths)
    seed_list = _ints(seeds)
    if not seed_list:
        raise UsageError("--seeds names no seed")
    RouteOptions(region=region, sinks=sinks, centroid_block=0).config("geometric")  # checked as the engine would
    filler = load_document(haystack).text if haystack else None
    session = _open_session(model, None, threads, "f16")
    _check_lengths_fit(session, length_list)
    rows = []
    for n in size_list:
        config = LibraryConfig(n, length_list, seed_list, ["geometric"], paraphrase=paraphrase)
        for length in length_list:
            for seed in seed_list:
                case = make_set_case(session, config, length, seed, filler)
                planned = set_cells(session, case.documents)
                pieces = session.token_pieces(planned.tokens)
                for scope in scopes:
                    found = lab_hints.hint_coverage(pieces, planned.starts, planned.n_body, case, hints=hints,
                                                    region=region, sinks=sinks, scope=scope)
                    rows += [dict(r, n_documents=n, length=length, haystack=str(haystack or ""),
                                  questions="paraphrased" if paraphrase else "template") for r in found]
                    err(f"kvlocal: {n} x {length:,} seed {seed}, {scope} scope: {sum(r['code_read'] for r in found)} "
                        f"of {len(found)} hints read their fact's code")
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "hints.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    print(lab_hints.markdown(lab_hints.summarize(rows)))


def _lab_captures(out: Path, lengths: list[int], tasks: list[str], seeds: list[int], depth_list: list[float],
                  model, threads, *, name_of, load, capture, haystack: Path | None = None):
    """(name, capture) of every haystack: loaded from OUT when it is there, else captured on the engine
    (one session for all, opened at the first capture) and saved beside the others. With `haystack`
    the facts are planted in that document's text (as `kvlocal eval --haystack` plants them) and the
    capture's name carries its file name."""
    from kvlocal.evals.runner import make_case
    from kvlocal.ingest import load_document

    filler = load_document(haystack).text if haystack else None
    tag = f"-{_file_tag(haystack)}" if haystack else ""

    session = None
    for length in lengths:
        for task in tasks:
            for seed in seeds:
                name = name_of(task, length, seed) + tag
                path = out / f"{name}.npz"
                if path.exists():
                    cap = load(path)
                    err(f"kvlocal: {name}: capture loaded from {path}")
                else:
                    if session is None:
                        session = _open_session(model, None, threads, "f16")
                        _check_lengths_fit(session, lengths)
                    case = make_case(session, task, length, depth_list, seed, filler)
                    cap = capture(session, case, task, name, lambda line: err(f"kvlocal: {line}"))
                    cap.save(path)
                yield name, cap


def _file_tag(path: Path) -> str:
    """A file name reduced to what a capture's name may hold: `GPL-3` -> `gpl-3`, `My Notes.pdf` -> `my-notes`."""
    return re.sub(r"[^a-z0-9]+", "-", path.stem.lower()).strip("-") or "haystack"


def _lab_prefill(out: Path, lengths: list[int], tasks: list[str], seeds: list[int], depth_list: list[float],
                 names: list[str], chunks: list[int], ks: list[int], prefill_from: int, geo, model, threads,
                 estimates: bool, haystack: Path | None = None) -> None:
    """`kvlocal lab --prefill`: capture the fact ubatches' queries once per haystack, replay prefill rules."""
    import json

    from kvlocal.atomic import write_text_atomic
    from kvlocal.lab import prefill as lab_prefill

    totals: dict = {}
    captures = _lab_captures(
        out, lengths, tasks, seeds, depth_list, model, threads,
        name_of=lambda task, length, seed: f"prefill-{task}-{length}-s{seed}-d{len(depth_list)}-from{prefill_from}",
        load=lab_prefill.PrefillCapture.load,
        capture=lambda session, case, task, name, log: lab_prefill.capture_prefill(session, case, name, prefill_from,
                                                                                   log=log),
        haystack=haystack)
    for name, cap in captures:
        started = time.perf_counter()
        lab_prefill.replay_prefill(cap, names, chunks, ks, geo, totals,
                                   estimates=list(lab_prefill.ESTIMATES) if estimates else ())
        err(f"kvlocal: {name}: {len(cap.starts)} ubatches replayed in {time.perf_counter() - started:.0f} s")
    rows = lab_prefill.summarize_prefill(totals)
    write_text_atomic(out / "lab-prefill.json", json.dumps(rows, indent=1))
    print(lab_prefill.markdown_prefill(rows))


@app.command()
@handles_errors
def lab(
    lengths: Annotated[str, typer.Option("--lengths", help="Context lengths, e.g. 8k,16k.")] = "8k",
    tasks: Annotated[str, typer.Option("--tasks", help="Eval tasks whose haystacks are captured.")] = "lookalike",
    depths: Annotated[int, typer.Option("--depths", min=2, max=MAX_DEPTHS, help="Facts per haystack, from 0% to 100% depth (the haystacks of `kvlocal eval`; facts in the sinks or the window are not counted).")] = 10,
    seeds: Annotated[str, typer.Option("--seeds", help="Haystack seeds.")] = "0",
    rules: Annotated[str, typer.Option("--rules", help="Selection rules to replay (comma-separated), or 'all'.")] = "all",
    budgets: Annotated[str, typer.Option("--budgets", help="Regions selected per layer and KV head.")] = "8",
    out: Annotated[Path, typer.Option("--out", help="Folder for the captures (.npz) and lab.json.")] = Path("kvlocal-lab"),
    layer_budget: Annotated[str, typer.Option("--layer-budget", help="Scale the budget per layer, e.g. 2-11:2,14-27:0.5 (layers 2-11 read twice the regions, 14-27 half); the reduction counts what each layer reads.")] = "",
    prefill: Annotated[bool, typer.Option("--prefill", help="Replay routed-prefill rules instead: the queries of the ubatches that hold facts (from --prefill-from on), each chunk of --chunks tokens choosing --budgets regions; reports the attention-output error against dense prefill.")] = False,
    chunks: Annotated[str, typer.Option("--chunks", help="With --prefill: tokens per selection (the routed ubatch size), e.g. 512,128.")] = "512,128",
    prefill_from: Annotated[int, typer.Option("--prefill-from", min=0, help="With --prefill: the first document token of a routed ubatch (as in `kvlocal ask --prefill-from`).")] = PREFILL_FROM,
    estimates: Annotated[bool, typer.Option("--estimates", help="With --prefill: also score every rule with the unread regions joining the attention as their mean keys and values (per region, per centroid block, and per block with the keys' variance).")] = False,
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    region: RegionOpt = REGION,
    window: WindowOpt = WINDOW,
    sinks: SinksOpt = SINKS,
    library: LibraryOpt = "",
    hints: HintsOpt = 1,
    haystack: HaystackOpt = None,
    paraphrase: ParaphraseOpt = False,
    hint_scope: Annotated[str, typer.Option("--hint-scope", rich_help_panel=LIBRARY, help="With --library: what scores a hinted place: sentence (the question words within reach of it, what `kvlocal ask` uses), region (the words of its whole region, the earlier rule), or both.")] = "sentence",
) -> None:
    """Routing lab: capture the dense model's real queries and keys once per haystack, then replay selection rules offline.

    Per rule and budget: the attention-mass recall of the heads that reach beyond the sinks and window, whether the asked fact's region is read by the heads that attend to it, and the KV bytes the rule would read (metadata included); per probe (probes.jsonl), the answer step that first lost the fact and the layers and heads that lost it. Captures stay in OUT: a second run replays without the engine. With --haystack the facts are planted in that document, as `kvlocal eval --haystack` plants them.

    With --prefill: the queries of the document's own ubatches that hold facts (a routed prefill's choice), and per rule, chunk and budget the attention-output error of those rows against dense prefill.

    With --library N: the text hints on library sets, from their tokens alone (seconds a set): where each fact's hint points and whether the regions it reads hold the asked code.
    """
    if library.strip():
        _lab_hints(library, lengths, seeds, hints, haystack, hint_scope, paraphrase, out, model, threads, region, sinks)
        return
    import json

    from kvlocal.atomic import write_text_atomic
    from kvlocal.errors import UsageError
    from kvlocal.evals.runner import depth_grid, task_answer_tokens
    from kvlocal.evals.tasks import TASKS
    from kvlocal.lab import decode as lab_mod
    from kvlocal.lab.prefill import PREFILL_RULES
    from kvlocal.lab.rules import RULES, Geometry


    table = PREFILL_RULES if prefill else RULES  # the rules this run chooses from
    names = list(table) if rules.strip() == "all" else [r.strip() for r in rules.split(",") if r.strip()]
    unknown = [r for r in names if r not in table]
    if unknown or not names:
        raise UsageError(f"--rules: {', '.join(unknown) or 'none given'}; choose from {', '.join(table)}")
    task_list = [t.strip() for t in tasks.split(",") if t.strip()]
    if not task_list or any(t not in TASKS or t == "cwe" for t in task_list):
        raise UsageError(f"--tasks: choose from {', '.join(t for t in TASKS if t != 'cwe')}")
    ks = _ints(budgets)
    if not ks or min(ks) < 1:
        raise UsageError("--budgets: give positive region counts, e.g. 4,8")
    _bounded("--budgets", ks, 1, MAX_TOP_K)
    _lengths(lengths)  # before the output folder is made
    # the region geometry checked as the engine would (the lab keeps no centroid block)
    RouteOptions(top_k=max(ks), region=region, window=window, sinks=sinks, centroid_block=0).config("geometric")
    geo = Geometry(region=region, sinks=sinks, window=window)
    depth_list = depth_grid(depths)  # as `kvlocal eval` plants them
    if prefill:
        chunk_list = _ints(chunks)
        if not chunk_list or min(chunk_list) < 1:
            raise UsageError("--chunks: give positive token counts, e.g. 512,128")
        out.mkdir(parents=True, exist_ok=True)
        _lab_prefill(out, _lengths(lengths), task_list, _ints(seeds), depth_list, names, chunk_list, ks,
                     prefill_from, geo, model, threads, estimates, haystack)
        return
    out.mkdir(parents=True, exist_ok=True)
    totals: dict = {}
    probe_rows: list[dict] = []  # where each probe's answer steps lose the fact (probes.jsonl)
    captures = _lab_captures(
        out, _lengths(lengths), task_list, _ints(seeds), depth_list, model, threads,
        name_of=lambda task, length, seed: f"{task}-{length}-s{seed}-d{depths}", load=lab_mod.CaseCapture.load,
        capture=lambda session, case, task, name, log: lab_mod.capture_case(session, case, name, task_answer_tokens(task),
                                                                           log=log),
        haystack=haystack)
    for name, cap in captures:
        started = time.perf_counter()
        try:
            scale = lab_mod.layer_scale(layer_budget, cap.doc_keys.shape[0]) if layer_budget else None
        except ValueError as e:
            raise UsageError(f"--layer-budget: {e}") from None
        lab_mod.replay_case(cap, names, ks, geo, totals, scale=scale, probe_log=probe_rows)
        err(f"kvlocal: {name}: replayed {len(names)} rules x {len(ks)} budgets in {time.perf_counter() - started:.0f} s")
    rows = [dict(r, layer_budget=layer_budget) for r in lab_mod.summarize(totals)]
    write_text_atomic(out / "lab.json", json.dumps(rows, indent=1))
    write_text_atomic(out / "probes.jsonl", "".join(json.dumps(r) + "\n" for r in probe_rows))
    print(lab_mod.markdown(rows))
    print()
    print(lab_mod.layer_markdown(rows, names))
    errors = lab_mod.layer_error_markdown(rows)
    if errors:
        print()
        print(errors)
    if probe_rows:
        print()
        print(lab_mod.probe_markdown(probe_rows))


@app.command()
@handles_errors
@option_groups
def bench(
    lengths: LengthsOpt = DEFAULT_BENCH_LENGTHS,
    tokens: Annotated[int, typer.Option("--tokens", min=1, max=MAX_ANSWER_TOKENS, help="Answer tokens timed per run.")] = 48,
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    out: OutOpt = None,
    routing: RouteOptions = RouteOptions(),
    upkeep: Annotated[bool, typer.Option("--upkeep/--no-upkeep", help="Also time prefill with and without centroid upkeep (4k).")] = True,
    ttft: Annotated[bool, typer.Option("--ttft/--no-ttft", help="Also time the first answer token of a 4k document, prefilled and from the cache.")] = True,
    controls: Annotated[bool, typer.Option("--controls", help="Also time the window and random routes at the geometric route's budget.")] = False,
    plain_loop: Annotated[bool, typer.Option("--plain-loop", help="Also time llama.cpp's own dense decoding loop on the same state (the reference for kvlocal's loop).")] = False,
    other_attention: Annotated[bool, typer.Option("--other-attention", help="Also time the geometric route read by the other attention path than --attention's (in place, or gathered).")] = False,
    prefill_lengths: Annotated[str, typer.Option("--prefill-lengths", rich_help_panel=PREFILL, help="Lengths prefilled twice, dense then routed, neither from the cache; none: skip (32k dense: ~30 min on 2 cores).")] = "8k,16k,32k",
    prefilling: PrefillOptions = PrefillOptions(),
    library: LibraryOpt = "",
    library_seed: Annotated[int, typer.Option("--library-seed", min=0, max=MAX_SEED, rich_help_panel=LIBRARY, help="With --library: the seed of the sets' documents (`kvlocal eval --library --seeds`: a set evaluated there opens from the cache).")] = 0,
    distributed: RpcOptions = RpcOptions(),
) -> None:
    """Decode speed of geometric vs full on the same prefilled state, dense vs routed prefill, memory, and time to first token."""
    import json

    from kvlocal.atomic import write_text_atomic
    from kvlocal.evals import bench as b
    from kvlocal.evals.report import decode_table
    from kvlocal.evals.runner import make_case
    from kvlocal.units import human_bytes

    route = routing.config("geometric")
    if library.strip():
        _bench_library(library, lengths, tokens, model, threads, out, routing, route, library_seed, distributed.config())
        return
    context_lengths = _lengths(lengths)
    prefill_context = [] if prefill_lengths.strip().lower() == "none" else _lengths(prefill_lengths)
    prefill_cfg = prefilling.config("routed")
    if out:
        _check_out_file(out)
    session = _open_session(model, None, threads, "f16", routing.centroid_block, routing.centroid_type,
                            distributed.config())
    _check_lengths_fit(session, context_lengths + prefill_context)
    log = lambda line: err(f"kvlocal: {line}")  # noqa: E731
    results = b.bench_lengths(session, context_lengths, route, n_tokens=tokens, log=log, controls=controls,
                              plain_loop=plain_loop, other_attention=other_attention)
    prefills = b.bench_prefill(session, prefill_context, prefill_cfg, log=log)
    small = make_case(session, "passkey", 4096, [0.5], 1) if ttft or upkeep else None  # the 4k document
    first_token = (b.time_to_first_token(session, small.text, route, small.probes[0].question) if ttft
                   else {"fresh": None, "cached": None})
    report = {
        "model": session.model.alias or str(session.model.path), "threads": session.threads,
        **b.machine_fields(session),
        "route": session.route_for(route).describe(),
        "lengths": [b.length_fields(r, session.model.info.file_size) for r in results],
        "prefill": prefill_cfg.describe(),
        "prefill_lengths": [{"length": p.length, "n_tokens": p.n_tokens, "dense_s": p.dense_s, "routed_s": p.routed_s,
                             "speedup": p.speedup, "bytes_reduction": p.bytes_reduction} for p in prefills],
        "ttft_fresh_s": first_token["fresh"], "ttft_cached_s": first_token["cached"],
        "peak_rss_bytes": b.peak_rss_bytes(),
    }
    session.close()
    if upkeep:
        report["centroid_upkeep"] = b.centroid_upkeep_share(model, small.text, threads, routing.centroid_block)
    print(decode_table(report))
    if prefills:
        print()
        print(f"prefill, dense vs {report['prefill']}:")
        print("| context | dense s | routed s | speedup | attention bytes read, reduction |")
        print("|---:|---:|---:|---:|---:|")
        for p in report["prefill_lengths"]:
            print(f"| {p['n_tokens']:,} | {p['dense_s']:.1f} | {p['routed_s']:.1f} | {p['speedup']:.2f}x "
                  f"| {p['bytes_reduction']:.1f}x |")
    if ttft:
        print(f"time to first token (4k document): fresh {report['ttft_fresh_s']:.1f} s, cached {report['ttft_cached_s']:.2f} s "
              f"({report['ttft_fresh_s'] / report['ttft_cached_s']:.0f}x)")
    print(f"peak RSS: {human_bytes(report['peak_rss_bytes'])}")
    if upkeep:
        u = report["centroid_upkeep"]
        print(f"centroid upkeep: prefill {u['with_s']:.1f} s with vs {u['without_s']:.1f} s without = {u['share']:.1%} of prefill")
    if out:
        write_text_atomic(out, json.dumps(report, indent=2))


def _bench_library(sizes: str, lengths: str, tokens: int, model, threads, out: Path | None, routing, route,
                   seed: int = 0, placement=None) -> None:
    import json

    from kvlocal.atomic import write_text_atomic
    from kvlocal.errors import UsageError
    from kvlocal.evals import bench as b
    from kvlocal.evals.library_cases import max_documents
    from kvlocal.library import check_composable
    from kvlocal.units import human_bytes

    size_list = _bounded("--library", _ints(sizes), 1, max_documents(1))
    length_list = [8192] if lengths == DEFAULT_BENCH_LENGTHS else _lengths(lengths)
    if len(length_list) != 1:
        raise UsageError("--library benches one document length at a time; give one --lengths")
    if out:
        _check_out_file(out)
    session = _open_session(model, None, threads, "f16", routing.centroid_block, routing.centroid_type, placement)
    check_composable(session)
    _check_lengths_fit(session, length_list)
    log = lambda line: err(f"kvlocal: {line}")  # noqa: E731
    results = b.bench_library(session, size_list, length_list[0], route, n_tokens=tokens, seed=seed, log=log)
    report = {
        "model": session.model.alias or str(session.model.path), "threads": session.threads,
        "route": session.route_for(route).describe(),
        "seed": seed,
        "library": [{"n_documents": r.n_documents, "length": r.length, "n_cells": r.n_cells, "layout": r.layout,
                     "ready_s": r.ready_s, "kv_bytes": r.kv_bytes, "full_tps": r.runs["full"].rate,
                     "geometric_tps": r.runs["geometric"].rate, "speedup": r.speedup,
                     "bytes_reduction": r.runs["geometric"].bytes_dense / max(1, r.runs["geometric"].bytes_read),
                     "geometric_route": r.runs["geometric"].route}
                    for r in results],
        "peak_rss_bytes": b.peak_rss_bytes(),
    }
    session.close()
    print(f"model {report['model']}, {report['threads']} threads, route {report['route']}")
    print("| set | cells | layout | KV bytes | ready from the cache | full tok/s | geometric tok/s | speedup "
          "| KV bytes read, reduction |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in report["library"]:
        print(f"| {r['n_documents']} x {r['length'] // 1024}k | {r['n_cells']:,} | {r['layout']} | {human_bytes(r['kv_bytes'])} "
              f"| {r['ready_s']:.1f} s | {r['full_tps']:.2f} | {r['geometric_tps']:.2f} | {r['speedup']:.2f}x "
              f"| {r['bytes_reduction']:.1f}x |")
    for r in report["library"]:
        if r["geometric_route"] != report["route"]:
            print(f"geometric over {r['n_documents']} documents took the route {r['geometric_route']}")
    print(f"peak RSS: {human_bytes(report['peak_rss_bytes'])}")
    if out:
        write_text_atomic(out, json.dumps(report, indent=2))


def version_callback(value: bool) -> None:
    if value:
        print(f"kvlocal {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=version_callback, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    """kvlocal: routed KV-cache attention for questions about long documents."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
