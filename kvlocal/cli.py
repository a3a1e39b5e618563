"""The `kvlocal` command line. The answer goes to stdout; progress, summaries and errors to stderr.

The everyday commands are here; the measuring ones (eval, bench, lab: kvlocal.cli_measure) are groups
whose first command is what the bare command runs. Options are declared once (kvlocal.cli_options);
what every command shares (errors, the session, checks before any work) is kvlocal.cli_common.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvlocal import __version__
from kvlocal import cli_common as common
from kvlocal.cli_common import err, handles_errors
from kvlocal.cli_measure import bench_app, eval_app, lab_app
from kvlocal.cli_options import (
    AllowRemoteOpt,
    CtxOpt,
    KvTypeOpt,
    MaxKvOpt,
    MaxTokensOpt,
    ModelOpt,
    NoCacheOpt,
    PrefillOpt,
    PrefillOptions,
    RouteOpt,
    RouteOptions,
    RpcHostOpt,
    RpcMemOpt,
    RpcOpt,
    RpcOptions,
    RpcPortOpt,
    SeedOpt,
    TemperatureOpt,
    ThreadsOpt,
    option_groups,
)
from kvlocal.errors import KvlocalError, UsageError
from kvlocal.rpc import DEFAULT_PORT
from kvlocal.route_settings import DEFAULT_MODE, DEFAULT_PREFILL
from kvlocal.serve.command import serve as serve_command

app = typer.Typer(
    help="Ask questions about long documents with a local Qwen model that reads only a routed part of its KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
cache_app = typer.Typer(help="Saved KV states of prefilled documents.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")
app.add_typer(eval_app, name="eval")
app.add_typer(bench_app, name="bench")
app.add_typer(lab_app, name="lab")


def _text_arg(text: str) -> str:
    """A free-text argument as valid Unicode: bytes that are not UTF-8 (a Latin-1 terminal's é reaches
    argv as a lone surrogate, surrogateescape) become U+FFFD, so they cannot fail later in the
    tokenizer or on output. Paths are not passed through this: they must still open their file."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate that surrogateescape did not make
        return text.encode("utf-8", "replace").decode("utf-8")


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
    session = common.open_session(model, ctx, threads, kv_type, routing.centroid_block, routing.centroid_type,
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
    session = common.open_session(model, None, threads, "f16")
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

    def is_tty(stream) -> bool:
        try:
            return stream is not None and stream.isatty()
        except (AttributeError, ValueError, OSError):  # closed or replaced stream
            return False

    if not (is_tty(sys.stdin) and is_tty(sys.stdout)) or os.environ.get("TERM", "") == "dumb":
        raise UsageError(TUI_NEEDS_TERMINAL)


# -- eval ---------------------------------------------------------------------------------------


app.command("serve")(handles_errors(serve_command))


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
