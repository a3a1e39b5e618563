"""`kvlocal serve`: its options, checked before anything loads, and the uvicorn server it runs.

Without an API key the server listens on a loopback address only; `--api-key` (repeatable) is
`KEY` (every document) or `KEY=doc1,folder2` (only the documents and folders named, as given at start
or by their last path component). Ctrl-C stops it: the answers under way are cancelled, the worker
finishes what it writes to the cache, then the process exits.
"""

from __future__ import annotations

import contextlib
import socket
import sys
from typing import Annotated, Optional

import typer

from kvlocal.addresses import is_loopback
from kvlocal.cli_options import (
    CtxOpt,
    KvTypeOpt,
    MaxKvOpt,
    ModelOpt,
    RouteOpt,
    RouteOptions,
    RpcOptions,
    ThreadsOpt,
    option_groups,
)
from kvlocal.errors import KvlocalError, UsageError
from kvlocal.route_settings import DEFAULT_CENTROID_BLOCK, DEFAULT_MODE, MAX_ANSWER_TOKENS, MAX_ANSWERS

DEFAULT_PORT = 8080


@option_groups
def serve(
    documents: Annotated[Optional[list[str]], typer.Argument(
        metavar="[DOCUMENT...]", help="Files and folders a request may name in its `documents` field.")] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (a non-loopback one needs --api-key).")
                    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port to listen on.")] = DEFAULT_PORT,
    api_key: Annotated[Optional[list[str]], typer.Option(
        "--api-key", metavar="KEY[=NAME,...]", help="Accept this key (repeatable); KEY=doc1,folder2 binds it to "
        "those documents and folders.")] = None,
    model: ModelOpt = None,
    ctx: CtxOpt = None,
    threads: ThreadsOpt = None,
    kv_type: KvTypeOpt = "f16",
    max_kv: MaxKvOpt = None,
    queue: Annotated[int, typer.Option("--queue", min=0, max=10_000,
                                       help="Requests that may wait for the engine; more are answered 429.")] = 8,
    max_request: Annotated[str, typer.Option("--max-request", metavar="SIZE", help="Largest request body.")] = "64MiB",
    max_document: Annotated[str, typer.Option("--max-document", metavar="SIZE",
                                              help="Largest document in a request (decoded).")] = "32MiB",
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, max=MAX_ANSWER_TOKENS,
                                            help="Most answer tokens a request may ask for.")] = 4096,
    max_documents: Annotated[int, typer.Option("--max-documents", min=1, max=1024,
                                               help="Most documents in one request.")] = 16,
    batch: Annotated[int, typer.Option(
        "--batch", min=1, max=MAX_ANSWERS,
        help="Answers decoded together: requests join the running ones between two tokens, each its own "
             "sequence routed over its own documents with its own selection memory, pins and hints, as "
             "`kvlocal ask` routes it. With two or more DOCUMENTs named, they are held side by side, so "
             "requests about different ones decode together; other requests wait for the batch to drain.")] = 1,
    route: RouteOpt = DEFAULT_MODE,
    routing: RouteOptions = RouteOptions(),
    distributed: RpcOptions = RpcOptions(),
) -> None:
    """Serve an OpenAI-compatible API (/v1/chat/completions, /v1/models) answering from documents.

    A request's documents are `file` content parts, names of the DOCUMENTs given here (in the
    extension field `documents`), or the text of its messages before the question; several are
    answered as one set, as `kvlocal ask A B "q"` answers them.
    """
    from kvlocal.docset import default_max_kv, parse_size
    from kvlocal.serve.schemas import Limits

    keys = api_key or []
    check_host(host, bool(keys))
    route_cfg = routing.config(route)
    limits = Limits(max_request_bytes=_size(max_request, "max_request"),
                    max_document_bytes=_size(max_document, "max_document"), max_tokens=max_tokens,
                    max_documents=max_documents)
    limit = parse_size(max_kv) if max_kv is not None else default_max_kv()
    state = open_state(documents or [], keys, limits, model=model, ctx=ctx, threads=threads, kv_type=kv_type,
                       max_kv=limit, queue=queue, answers=batch, route=route_cfg,
                       centroid_block=routing.centroid_block, centroid_type=routing.centroid_type,
                       placement=distributed.config())
    run(state, host, port)


def check_host(host: str, has_keys: bool) -> None:
    """UsageError for a non-loopback address without an API key."""
    if has_keys or is_loopback(host):
        return
    raise UsageError(f"refusing to listen on {host} without an API key: anyone who reaches it could read the "
                     "documents; give --api-key KEY, or listen on 127.0.0.1", setting="host")


def _size(text: str, setting: str) -> int:
    from kvlocal.docset import parse_size

    try:
        value = parse_size(text)
    except UsageError as err:
        raise UsageError(str(err), setting=setting) from None
    if value < 1:
        raise UsageError(f"--{setting.replace('_', '-')} must be at least 1 byte", setting=setting)
    return value


def open_state(sources: list[str], keys: list[str], limits, *, model=None, ctx=None, threads=None, kv_type="f16",
               max_kv=None, queue=8, audit=False, answers=1, route=None, centroid_block=DEFAULT_CENTROID_BLOCK,
               centroid_type=None, placement=None):
    """The server's state: the named documents read, the keys checked, the model loaded (its layers split
    with RPC servers by `placement`, kvlocal.rpc); `route` (a RouteConfig; None: kvlocal ask's default)
    decodes every answer."""
    from kvlocal.serve.app import ServerState
    from kvlocal.serve.documents import Catalog, KeyRing
    from kvlocal.serve.scheduler import Scheduler
    from kvlocal.session import Session

    catalog = Catalog(sources)
    for message in catalog.skipped:
        print(f"kvlocal serve: {message}", file=sys.stderr, flush=True)
    ring = KeyRing.parse(keys, catalog)
    session = Session(model, n_ctx=ctx, threads=threads, kv_type=kv_type, answers=answers,
                      centroid_block=centroid_block, centroid_type=centroid_type, placement=placement)
    scheduler = Scheduler(session, queue_size=queue, max_kv=max_kv, audit=audit, route=route,
                          shelf=shelf_documents(session, catalog, max_kv))
    return ServerState(scheduler, catalog, ring, limits, session.model.path.stem)


def shelf_documents(session, catalog, max_kv) -> tuple:
    """The documents named at start that `serve --batch N` keeps side by side (kvlocal.shelf), so that
    requests about different ones decode together: each named single document (a folder is a set,
    loaded on its own), as many as fit the model's context and the KV limit; () with one answer at a
    time, fewer than two such documents, or a model whose memory cannot be laid out so."""
    from kvlocal.library import check_composable
    from kvlocal.shelf import plan_shelf

    if session.answers < 2:
        return ()
    singles: list = []
    for documents in catalog.names.values():
        if len(documents) == 1 and all(documents[0] is not d for d in singles):
            singles.append(documents[0])
    if len(singles) < 2:
        return ()
    try:
        check_composable(session)
    except KvlocalError as err:
        print(f"kvlocal serve: the named documents are loaded one at a time: {err}", file=sys.stderr, flush=True)
        return ()
    chosen, notes = plan_shelf(session, singles, max_kv)
    for note in notes:
        print(f"kvlocal serve: not kept side by side with the others: {note}", file=sys.stderr, flush=True)
    return tuple(chosen) if len(chosen) > 1 else ()


def make_server(state, sock: socket.socket | None = None, host: str = "127.0.0.1", port: int = DEFAULT_PORT):
    """A uvicorn server of the app over `state` (on `sock` where given): logs on stderr, no access log;
    its exit (Ctrl-C) first cancels the answers under way."""
    import uvicorn

    from kvlocal.serve.app import build_app

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            state.scheduler.cancel_running()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(build_app(state), host=host, port=port, access_log=False, log_level="info",
                            timeout_graceful_shutdown=30)
    return Server(config)


def run(state, host: str, port: int) -> None:
    server = make_server(state, host=host, port=port)
    print(f"kvlocal serve: {state.model_id} on http://{host}:{port}/v1 "
          f"({len(state.catalog.names)} named documents and folders)", file=sys.stderr, flush=True)
    server.run()
    if not server.started:
        raise UsageError(f"could not listen on {host}:{port} (in use, or not an address of this machine)",
                         setting="port")


@contextlib.contextmanager
def serving_in_thread(state):
    """The server of `state` in a thread, on a free loopback port whose socket listens before the
    server starts (a client may connect at once); yields the port, and stops the server (and its
    worker) on exit."""
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = make_server(state)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="kvlocal-serve")
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join()
        sock.close()
