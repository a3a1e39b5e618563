"""The `kvlocal` command line. The answer goes to stdout; progress, summaries and errors to stderr."""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvlocal import __version__
from kvlocal.errors import KvlocalError
from kvlocal.route_settings import (
    CENTROID_BLOCKS,
    DEFAULT_CENTROID_BLOCK as CENTROID_BLOCK,
    DEFAULT_CENTROID_TYPE as CENTROID_TYPE,
    DEFAULT_PIN as PIN,
    DEFAULT_KEEP as KEEP,
    DEFAULT_PREFILL as PREFILL,
    DEFAULT_PREFILL_FROM as PREFILL_FROM,
    DEFAULT_PREFILL_TOP_K as PREFILL_TOP_K,
    DEFAULT_PREFILL_UBATCH as PREFILL_UBATCH,
    DEFAULT_QUESTION as QUESTION,
    DEFAULT_QUESTION_TOP_K as QUESTION_TOP_K,
    DEFAULT_REGION as REGION,
    DEFAULT_SHORTLIST as SHORTLIST,
    DEFAULT_SINKS as SINKS,
    DEFAULT_TOP_K as TOP_K,
    DEFAULT_WINDOW as WINDOW,
    MAX_ANSWER_TOKENS,
    MAX_CTX,
    MAX_REGION,
    MAX_SEED,
    MAX_SHORTLIST,
    MAX_SINKS,
    MAX_THREADS,
    MAX_TOP_K,
    MAX_WINDOW,
    MIN_CTX,
    SHORTLIST_AUTO,
)

app = typer.Typer(
    help="Ask questions about long documents with a local Qwen model that reads only a routed part of its KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
cache_app = typer.Typer(help="Saved KV states of prefilled documents.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


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


# -- shared options -------------------------------------------------------------------------

ModelOpt = Annotated[
    Optional[str], typer.Option("--model", "-m", help="Model alias (see `kvlocal models`) or path to a GGUF file.")
]
CtxOpt = Annotated[
    Optional[int], typer.Option("--ctx", min=MIN_CTX, max=MAX_CTX,
                                help="Context size in tokens (default: fit the document; max: the model's).")
]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", "-t", min=1, max=MAX_THREADS, help="CPU threads (default: all cores).")]
KvTypeOpt = Annotated[str, typer.Option("--kv-type", help="KV cache type: f16 or q8_0.")]
RouteOpt = Annotated[
    str, typer.Option("--route", help="geometric (routed), full (dense), window or random (controls).")
]
# Every number is bounded here (a usage error, exit 2, before any work) by route_settings' limits,
# which RouteConfig enforces too: past them a value would wrap silently in the engine's 32-bit ints.
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, max=MAX_TOP_K, help="Regions routed per layer and KV head.")]
RegionOpt = Annotated[int, typer.Option("--region", min=1, max=MAX_REGION, help="Tokens per region (16, 32, 64, 128 or 256).")]
WindowOpt = Annotated[int, typer.Option("--window", min=0, max=MAX_WINDOW, help="Recent tokens always read (rounded up to regions).")]
SinksOpt = Annotated[int, typer.Option("--sinks", min=0, max=MAX_SINKS, help="First tokens always read (rounded up to regions).")]
CentroidBlockOpt = Annotated[int, typer.Option(
    "--centroid-block", min=0, max=max(CENTROID_BLOCKS),
    help="Tokens per key centroid (4-256); a region is scored from region/block centroids, "
    "so a larger block reads fewer centroid bytes. 0 keeps no centroids: every step is dense.")]
CentroidTypeOpt = Annotated[str, typer.Option(
    "--centroid-type", help="Type the key centroids are kept in: f16, or q8_0 (about half the centroid bytes a "
    "routed step scans).")]


def _shortlist_value(text: str) -> int:
    """--shortlist: a number of regions, or auto (SHORTLIST_AUTO)."""
    if isinstance(text, int):  # the default
        return text
    if text.strip().lower() == "auto":
        return SHORTLIST_AUTO
    try:
        value = int(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is neither a number of regions nor auto") from None
    if not 0 <= value <= MAX_SHORTLIST:
        raise typer.BadParameter(f"{value} is not between 0 and {MAX_SHORTLIST:,}")
    return value


ShortlistOpt = Annotated[int, typer.Option(
    "--shortlist", parser=_shortlist_value, metavar="N|auto",
    show_default="auto" if SHORTLIST == SHORTLIST_AUTO else str(SHORTLIST),
    help="Two-level scoring: one coarse centroid per 64 tokens shortlists this many regions, "
    "and only their fine centroids (--centroid-block) are scanned to choose --top-k of them; 0 scans every fine "
    "centroid; auto shortlists an eighth of the document's regions, rounded up to 16. Needs a centroid block under 64.")]
KeepOpt = Annotated[float, typer.Option(
    "--keep", min=0.0, max=0.999, help="Selection memory over the steps of one answer: a region keeps this share of "
    "what it scored on the step before, so a region the question found stays read while the answer is copied from "
    "it. 0 selects afresh at every step.")]
QuestionOpt = Annotated[str, typer.Option(
    "--question-pass", help="How the question's tokens read the document: routed (one batch whose queries choose "
    "--question-top-k regions together, read once), dense (one batch that reads the whole cache once) or steps "
    "(token by token through the route, like the answer).")]
QuestionTopKOpt = Annotated[int, typer.Option(
    "--question-top-k", min=0, max=MAX_TOP_K, help="Regions per layer and KV head that a routed question reads.")]
PinOpt = Annotated[int, typer.Option(
    "--pin", min=0, max=MAX_TOP_K, help="Regions the dense question pass pins for the answer: the ones its "
    "last queries attend to most, read at every answer step (of --top-k; needs --keep above 0).")]
SeedOpt = Annotated[int, typer.Option("--seed", min=0, max=MAX_SEED, help="Seed for random routing and sampling.")]
PrefillOpt = Annotated[str, typer.Option(
    "--prefill", help="How the document is prefilled: dense (every 512-token ubatch reads every earlier token) or "
    "routed (from --prefill-from tokens on, a ubatch reads the first 64 tokens, the 128 before it, itself and the "
    "--prefill-top-k regions its queries choose from the centroids: a 32k document loads about 2x faster; "
    "its saved state is kept apart).")]
PrefillTopKOpt = Annotated[int, typer.Option(
    "--prefill-top-k", min=1, max=MAX_TOP_K, help="Regions of 64 tokens per layer and KV head that a routed prefill's "
    "ubatch reads. Fewer load faster (16: a 32k document over 3x faster than dense) but lose facts that look "
    "alike; about a quarter of the document's regions keeps them.")]
PrefillUbatchOpt = Annotated[int, typer.Option(
    "--prefill-ubatch", min=1, max=MAX_CTX, help="Tokens per routed ubatch (at most 512): the queries of one "
    "ubatch choose one set of regions, so a smaller ubatch chooses for fewer tokens at a time.")]
PrefillFromOpt = Annotated[int, typer.Option(
    "--prefill-from", min=0, max=MAX_CTX, help="Tokens of the document prefilled densely before a routed prefill "
    "starts routing.")]


def _text_arg(text: str) -> str:
    """A free-text argument as valid Unicode: bytes that are not UTF-8 (a Latin-1 terminal's é reaches
    argv as a lone surrogate, surrogateescape) become U+FFFD, so they cannot fail later in the
    tokenizer or on output. Paths are not passed through this: they must still open their file."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate that surrogateescape did not make
        return text.encode("utf-8", "replace").decode("utf-8")


def _route(route: str, top_k: int, region: int, window: int, sinks: int, seed: int, centroid_block: int = 0,
           shortlist: int = SHORTLIST, keep: float = KEEP, question: str = QUESTION,
           question_top_k: int = QUESTION_TOP_K, pin: int = PIN):
    from kvlocal.routing import RouteConfig, check_region_block

    config = RouteConfig(mode=route, region=region, top_k=top_k, window=window, sinks=sinks, seed=seed,
                         shortlist=shortlist, keep=keep, question=question,
                         question_top_k=question_top_k, pin=pin)
    check_region_block(region, centroid_block)
    return config


def _prefill(prefill: str, top_k: int = PREFILL_TOP_K, start: int = PREFILL_FROM, ubatch: int = PREFILL_UBATCH):
    from kvlocal.routing import PrefillConfig

    return PrefillConfig(mode=prefill, top_k=top_k, start=start, ubatch=ubatch)


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


def _centroid_type(value: str) -> None:
    """--centroid-type: a usage error (exit 2) before any work unless the engine keeps centroids so."""
    from kvlocal.routing import check_centroid_type

    check_centroid_type(value)


def _open_session(model, ctx, threads, kv_type, centroid_block=CENTROID_BLOCK, centroid_type=CENTROID_TYPE):
    from kvlocal.progress import StatusLine, download_text
    from kvlocal.session import Session

    line = StatusLine()
    session = Session(
        model, n_ctx=ctx, threads=threads, kv_type=kv_type, centroid_block=centroid_block, centroid_type=centroid_type,
        model_progress=lambda d, t, s: line.show(download_text(d, t, s)),
    )
    line.done()
    return session


def _load(session, text: str, label: str, use_cache: bool, prefill=None):
    from kvlocal.progress import StatusLine, load_summary, prefill_text

    line = StatusLine()
    try:
        result = session.load_document(text, label=label, progress=lambda p: line.show(prefill_text(p)),
                                       use_cache=use_cache, prefill=prefill)
    finally:
        line.done()
    if result.rebuilt_reason:
        err(f"kvlocal: {result.rebuilt_reason}")
    err(f"kvlocal: {load_summary(result)}")
    return result


def _stream_answer(session, question: str, **kwargs) -> str:
    from kvlocal.progress import answer_summary

    answer = session.ask(question, **kwargs)
    for piece in answer:
        sys.stdout.write(piece.text)
        sys.stdout.flush()
    summary = answer.summary()
    sys.stdout.write("\n")
    sys.stdout.flush()
    err(f"kvlocal: {answer_summary(summary)}".replace("\n", "\nkvlocal: "))
    return summary.text


# -- commands -------------------------------------------------------------------------------


@app.command()
@handles_errors
def ask(
    document: Annotated[str, typer.Argument(help="PDF, .txt, .md, .html or .epub file, or - for stdin.")],
    question: Annotated[str, typer.Argument(help="The question to answer from the document.")],
    model: ModelOpt = None,
    ctx: CtxOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", min=1, max=MAX_ANSWER_TOKENS, help="Most answer tokens.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    threads: ThreadsOpt = None,
    kv_type: KvTypeOpt = "f16",
    route: RouteOpt = "geometric",
    top_k: TopKOpt = TOP_K,
    region: RegionOpt = REGION,
    window: WindowOpt = WINDOW,
    sinks: SinksOpt = SINKS,
    seed: SeedOpt = 0,
    centroid_block: CentroidBlockOpt = CENTROID_BLOCK,
    centroid_type: CentroidTypeOpt = CENTROID_TYPE,
    shortlist: ShortlistOpt = SHORTLIST,
    keep: KeepOpt = KEEP,
    question_pass: QuestionOpt = QUESTION,
    question_top_k: QuestionTopKOpt = QUESTION_TOP_K,
    pin: PinOpt = PIN,
    prefill: PrefillOpt = PREFILL,
    prefill_top_k: PrefillTopKOpt = PREFILL_TOP_K,
    prefill_from: PrefillFromOpt = PREFILL_FROM,
    prefill_ubatch: PrefillUbatchOpt = PREFILL_UBATCH,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Neither load nor save the KV state.")] = False,
) -> None:
    """Answer QUESTION from DOCUMENT; the answer streams to stdout, progress and KV reads to stderr."""
    from kvlocal.ingest import load_document
    from kvlocal.session import check_ask_settings

    route_cfg = _route(route, top_k, region, window, sinks, seed, centroid_block, shortlist, keep, question_pass,
                       question_top_k, pin)
    _centroid_type(centroid_type)
    prefill_cfg = _prefill(prefill, prefill_top_k, prefill_from, prefill_ubatch)
    question = _text_arg(question)  # the document stays as given: a path
    check_ask_settings(question, max_tokens, temperature, seed)
    doc = load_document(document)
    session = _open_session(model, ctx, threads, kv_type, centroid_block, centroid_type)
    _load(session, doc.text, doc.source, not no_cache, prefill_cfg)
    _stream_answer(session, question, route=route_cfg, max_tokens=max_tokens, temperature=temperature, seed=seed)


@app.command()
@handles_errors
def demo(
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    route: RouteOpt = "geometric",
) -> None:
    """Ask the built-in sample document its built-in question (the README's first command)."""
    from kvlocal import paths
    from kvlocal.sample import SAMPLE_QUESTION, write_sample

    route_cfg = _route(route, TOP_K, REGION, WINDOW, SINKS, 0)
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
    from kvlocal.units import human_bytes

    for alias, spec in ALIASES.items():
        default = " (default)" if alias == DEFAULT_ALIAS else ""
        print(f"{alias}{default}")
        print(f"  {spec.description}")
        print(f"  {len(spec.packages)} packages {spec.packages[0]} … =={spec.version}, {human_bytes(spec.size)}")
        print(f"  sha256 {spec.sha256}")
        print(f"  status: {model_status(alias)}")


@app.command()
@handles_errors
def doctor() -> None:
    """Report the engine build, its patch set, backends, the default model and the cache."""
    from kvlocal import kvstate, paths
    from kvlocal.engine import ENGINE_VERSION, engine_info
    from kvlocal.models import DEFAULT_ALIAS, model_status

    info = engine_info()
    print(f"kvlocal {__version__}")
    print(f"engine pin: llama-cpp-python {ENGINE_VERSION} (installed: {info.version})")
    print(f"engine build id: {info.build_id or 'none'}")
    state = "patched" if info.patched else "STOCK (not patched)"
    if info.patched and not info.current:
        state += f", OUT OF DATE (patches/ is {info.repo_patchset})"
    print(f"engine: {state}; patch set {info.patchset or '-'} (repository: {info.repo_patchset or '-'})")
    print(f"GPU offload: {'yes' if info.gpu_offload else 'no'}")
    print(f"system: {info.system_info}")
    print(f"default model {DEFAULT_ALIAS}: {model_status(DEFAULT_ALIAS)}")
    try:
        entries = kvstate.list_entries()
    except KvlocalError as e:  # e.g. KVLOCAL_CACHE_DIR names a file: report it with the rest
        print(f"cache dir: UNUSABLE: {e}")
    else:
        print(f"cache dir: {paths.cache_root()} ({len(entries)} saved KV states)")


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
def tui(
    document: Annotated[Optional[Path], typer.Argument(help="Document to open (or pick one in the app).")] = None,
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    prefill: PrefillOpt = PREFILL,
    prefill_top_k: PrefillTopKOpt = PREFILL_TOP_K,
    prefill_from: PrefillFromOpt = PREFILL_FROM,
    prefill_ubatch: PrefillUbatchOpt = PREFILL_UBATCH,
) -> None:
    """The interactive app: load, ask, and watch which KV regions each step reads."""
    prefill_cfg = _prefill(prefill, prefill_top_k, prefill_from, prefill_ubatch)
    _check_terminal()  # before textual is imported
    from kvlocal.tui.app import run_app

    code = run_app(document=document, model=model, threads=threads, prefill=prefill_cfg)
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
def eval_(
    quick: Annotated[bool, typer.Option("--quick", help="2k, two depths, passkey, top-4 (in place of --lengths, --depths, --tasks, --top-k): a few minutes; checks the ordering.")] = False,
    lengths: Annotated[str, typer.Option("--lengths", help="Context lengths, e.g. 4k,8k,16k,32k.")] = "4k,8k,16k,32k",
    depths: Annotated[int, typer.Option("--depths", min=2, max=MAX_DEPTHS, help="Needle depths from 0% to 100%.")] = 11,
    tasks: Annotated[str, typer.Option("--tasks", help="passkey,multikey,lookalike,multivalue,multiquery,vartrack,cwe")] = "passkey",
    modes: Annotated[str, typer.Option("--modes", help="Routing modes to compare.")] = "full,geometric,window,random",
    sweep: Annotated[str, typer.Option("--sweep", help="Extra geometric top-k budgets, e.g. 2,4,16.")] = "",
    seeds: Annotated[str, typer.Option("--seeds", help="Haystack seeds.")] = "0",
    haystack: Annotated[Optional[Path], typer.Option("--haystack", help="Plant the needles into this document instead of generated prose.")] = None,
    out: Annotated[Path, typer.Option("--out", help="Folder for results.jsonl, summary.json and plots.")] = Path("kvlocal-eval"),
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Write PNG plots (needs matplotlib).")] = True,
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    top_k: TopKOpt = TOP_K,
    region: RegionOpt = REGION,
    window: WindowOpt = WINDOW,
    sinks: SinksOpt = SINKS,
    centroid_block: CentroidBlockOpt = CENTROID_BLOCK,
    centroid_type: CentroidTypeOpt = CENTROID_TYPE,
    shortlist: ShortlistOpt = SHORTLIST,
    keep: KeepOpt = KEEP,
    question_pass: QuestionOpt = QUESTION,
    question_top_k: QuestionTopKOpt = QUESTION_TOP_K,
    pin: PinOpt = PIN,
    prefill: PrefillOpt = PREFILL,
    prefill_top_k: PrefillTopKOpt = PREFILL_TOP_K,
    prefill_from: PrefillFromOpt = PREFILL_FROM,
    prefill_ubatch: PrefillUbatchOpt = PREFILL_UBATCH,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", min=1, max=MAX_ANSWER_TOKENS, help="Most answer tokens per probe (default: by task).")] = None,
) -> None:
    """Needle grid and RULER-style tasks: accuracy and KV reads of every routing mode, on the same prefilled haystacks.

    Results are appended to OUT/results.jsonl as they come (a rerun resumes); the markdown table goes to stdout.
    """
    from kvlocal.errors import UsageError
    from kvlocal.evals import report
    from kvlocal.evals.runner import GridConfig, run_grid
    from kvlocal.evals.tasks import TASKS
    from kvlocal.ingest import load_document

    if quick:
        # a 2k context holds about 18 regions: with 4 routed ones geometric matches dense there and
        # the controls at the same budget miss needles outside the window (at 4k, top-4 does not
        # match dense yet: see BENCHMARKS.md)
        lengths, depths, tasks, top_k = "2k", 2, "passkey", 4
    n = max(depths, 2)
    config = GridConfig(
        lengths=_lengths(lengths), depths=[round(i / (n - 1), 3) for i in range(n)] if not quick else [0.25, 0.5],
        tasks=[t.strip() for t in tasks.split(",") if t.strip()], modes=[m.strip() for m in modes.split(",")],
        seeds=_ints(seeds), top_k=top_k, region=region, window=window, sinks=sinks,
        sweep=_bounded("--sweep", _ints(sweep), 0, MAX_TOP_K),
        shortlist=shortlist, keep=keep, question=question_pass, question_top_k=question_top_k,
        pin=pin, max_tokens=max_tokens, prefill=_prefill(prefill, prefill_top_k, prefill_from, prefill_ubatch),
    )
    for mode in config.modes:
        _route(mode, top_k, region, window, sinks, 0, centroid_block, shortlist, keep, question_pass,
               question_top_k, pin)  # validates
    _centroid_type(centroid_type)
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
    session = _open_session(model, None, threads, "f16", centroid_block, centroid_type)
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


def _lab_captures(out: Path, lengths: list[int], tasks: list[str], seeds: list[int], depth_list: list[float],
                  model, threads, *, name_of, load, capture):
    """(name, capture) of every haystack: loaded from OUT when it is there, else captured on the engine
    (one session for all, opened at the first capture) and saved beside the others."""
    from kvlocal.evals.runner import make_case

    session = None
    for length in lengths:
        for task in tasks:
            for seed in seeds:
                name = name_of(task, length, seed)
                path = out / f"{name}.npz"
                if path.exists():
                    cap = load(path)
                    err(f"kvlocal: {name}: capture loaded from {path}")
                else:
                    if session is None:
                        session = _open_session(model, None, threads, "f16")
                        _check_lengths_fit(session, lengths)
                    case = make_case(session, task, length, depth_list, seed)
                    cap = capture(session, case, task, name, lambda line: err(f"kvlocal: {line}"))
                    cap.save(path)
                yield name, cap


def _lab_prefill(out: Path, lengths: list[int], tasks: list[str], seeds: list[int], depth_list: list[float],
                 names: list[str], chunks: list[int], ks: list[int], prefill_from: int, geo, model, threads,
                 estimates: bool) -> None:
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
                                                                                   log=log))
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
) -> None:
    """Routing lab: capture the dense model's real queries and keys once per haystack, then replay selection rules offline.

    Per rule and budget: the attention-mass recall of the heads that reach beyond the sinks and window, whether the asked fact's region is read by the heads that attend to it, and the KV bytes the rule would read (metadata included). Captures stay in OUT: a second run replays without the engine.

    With --prefill: the queries of the document's own ubatches that hold facts (a routed prefill's choice), and per rule, chunk and budget the attention-output error of those rows against dense prefill.
    """
    import json

    from kvlocal.atomic import write_text_atomic
    from kvlocal.errors import UsageError
    from kvlocal.evals.runner import task_answer_tokens
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
    _route("geometric", max(ks), region, window, sinks, 0)  # validates the region geometry as the engine would
    geo = Geometry(region=region, sinks=sinks, window=window)
    depth_list = [round(i / (depths - 1), 3) for i in range(depths)]  # as `kvlocal eval` plants them
    if prefill:
        chunk_list = _ints(chunks)
        if not chunk_list or min(chunk_list) < 1:
            raise UsageError("--chunks: give positive token counts, e.g. 512,128")
        out.mkdir(parents=True, exist_ok=True)
        _lab_prefill(out, _lengths(lengths), task_list, _ints(seeds), depth_list, names, chunk_list, ks,
                     prefill_from, geo, model, threads, estimates)
        return
    out.mkdir(parents=True, exist_ok=True)
    totals: dict = {}
    captures = _lab_captures(
        out, _lengths(lengths), task_list, _ints(seeds), depth_list, model, threads,
        name_of=lambda task, length, seed: f"{task}-{length}-s{seed}-d{depths}", load=lab_mod.CaseCapture.load,
        capture=lambda session, case, task, name, log: lab_mod.capture_case(session, case, name, task_answer_tokens(task),
                                                                           log=log))
    for name, cap in captures:
        started = time.perf_counter()
        try:
            scale = lab_mod.layer_scale(layer_budget, cap.doc_keys.shape[0]) if layer_budget else None
        except ValueError as e:
            raise UsageError(f"--layer-budget: {e}") from None
        lab_mod.replay_case(cap, names, ks, geo, totals, scale=scale)
        err(f"kvlocal: {name}: replayed {len(names)} rules x {len(ks)} budgets in {time.perf_counter() - started:.0f} s")
    rows = [dict(r, layer_budget=layer_budget) for r in lab_mod.summarize(totals)]
    write_text_atomic(out / "lab.json", json.dumps(rows, indent=1))
    print(lab_mod.markdown(rows))
    print()
    print(lab_mod.layer_markdown(rows, names))
    errors = lab_mod.layer_error_markdown(rows)
    if errors:
        print()
        print(errors)


@app.command()
@handles_errors
def bench(
    lengths: Annotated[str, typer.Option("--lengths", help="Context lengths, e.g. 8k,16k,32k.")] = "8k,16k,32k",
    tokens: Annotated[int, typer.Option("--tokens", min=1, max=MAX_ANSWER_TOKENS, help="Answer tokens timed per run.")] = 48,
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    top_k: TopKOpt = TOP_K,
    region: RegionOpt = REGION,
    window: WindowOpt = WINDOW,
    sinks: SinksOpt = SINKS,
    centroid_block: CentroidBlockOpt = CENTROID_BLOCK,
    centroid_type: CentroidTypeOpt = CENTROID_TYPE,
    shortlist: ShortlistOpt = SHORTLIST,
    keep: KeepOpt = KEEP,
    question_pass: QuestionOpt = QUESTION,
    question_top_k: QuestionTopKOpt = QUESTION_TOP_K,
    upkeep: Annotated[bool, typer.Option("--upkeep/--no-upkeep", help="Also time prefill with and without centroid upkeep (4k).")] = True,
    prefill_lengths: Annotated[str, typer.Option("--prefill-lengths", help="Context lengths whose haystack is prefilled twice, dense then routed (--prefill-top-k, --prefill-from), neither from the cache; 'none' skips this (a 32k dense prefill takes about half an hour on 2 cores).")] = "8k,16k,32k",
    prefill_top_k: PrefillTopKOpt = PREFILL_TOP_K,
    prefill_from: PrefillFromOpt = PREFILL_FROM,
    prefill_ubatch: PrefillUbatchOpt = PREFILL_UBATCH,
    out: Annotated[Optional[Path], typer.Option("--out", help="Write the results as JSON here.")] = None,
) -> None:
    """Decode speed of geometric vs full on the same prefilled state, dense vs routed prefill, memory, and time to first token."""
    import json

    from kvlocal.atomic import write_text_atomic
    from kvlocal.evals import bench as b
    from kvlocal.evals.runner import make_case
    from kvlocal.units import human_bytes

    route = _route("geometric", top_k, region, window, sinks, 0, centroid_block, shortlist, keep,
                   question_pass, question_top_k)
    _centroid_type(centroid_type)
    context_lengths = _lengths(lengths)
    prefill_context = [] if prefill_lengths.strip().lower() == "none" else _lengths(prefill_lengths)
    prefill_cfg = _prefill("routed", prefill_top_k, prefill_from, prefill_ubatch)
    if out:
        _check_out_file(out)
    session = _open_session(model, None, threads, "f16", centroid_block, centroid_type)
    _check_lengths_fit(session, context_lengths + prefill_context)
    log = lambda line: err(f"kvlocal: {line}")  # noqa: E731
    results = b.bench_lengths(session, context_lengths, route, n_tokens=tokens, log=log)
    prefills = b.bench_prefill(session, prefill_context, prefill_cfg, log=log)
    small = make_case(session, "passkey", 4096, [0.5], 1)
    ttft = b.time_to_first_token(session, small.text, route, small.probes[0].question)
    report = {
        "model": session.model.alias or str(session.model.path), "threads": session.threads, "route": route.describe(),
        "lengths": [{"length": r.length, "n_tokens": r.n_tokens, "kv_bytes": r.kv_bytes,
                     "full_tps": r.runs["full"].rate, "geometric_tps": r.runs["geometric"].rate,
                     "speedup": r.speedup,
                     "bytes_reduction": r.runs["geometric"].bytes_dense / max(1, r.runs["geometric"].bytes_read)}
                    for r in results],
        "prefill": prefill_cfg.describe(),
        "prefill_lengths": [{"length": p.length, "n_tokens": p.n_tokens, "dense_s": p.dense_s, "routed_s": p.routed_s,
                             "speedup": p.speedup, "bytes_reduction": p.bytes_reduction} for p in prefills],
        "ttft_fresh_s": ttft["fresh"], "ttft_cached_s": ttft["cached"],
        "peak_rss_bytes": b.peak_rss_bytes(),
    }
    session.close()
    if upkeep:
        report["centroid_upkeep"] = b.centroid_upkeep_share(model, small.text, threads, centroid_block)
    print(f"model {report['model']}, {report['threads']} threads, route {report['route']}")
    print("| context | KV bytes | full tok/s | geometric tok/s | speedup | KV bytes read, reduction |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in report["lengths"]:
        print(f"| {r['n_tokens']:,} | {human_bytes(r['kv_bytes'])} | {r['full_tps']:.2f} | {r['geometric_tps']:.2f} "
              f"| {r['speedup']:.2f}x | {r['bytes_reduction']:.1f}x |")
    if prefills:
        print()
        print(f"prefill, dense vs {report['prefill']}:")
        print("| context | dense s | routed s | speedup | attention bytes read, reduction |")
        print("|---:|---:|---:|---:|---:|")
        for p in report["prefill_lengths"]:
            print(f"| {p['n_tokens']:,} | {p['dense_s']:.1f} | {p['routed_s']:.1f} | {p['speedup']:.2f}x "
                  f"| {p['bytes_reduction']:.1f}x |")
    print(f"time to first token (4k document): fresh {report['ttft_fresh_s']:.1f} s, cached {report['ttft_cached_s']:.2f} s "
          f"({report['ttft_fresh_s'] / report['ttft_cached_s']:.0f}x)")
    print(f"peak RSS: {human_bytes(report['peak_rss_bytes'])}")
    if upkeep:
        u = report["centroid_upkeep"]
        print(f"centroid upkeep: prefill {u['with_s']:.1f} s with vs {u['without_s']:.1f} s without = {u['share']:.1%} of prefill")
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
