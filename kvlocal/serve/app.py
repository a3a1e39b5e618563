"""The Starlette application: routes, API keys, request bounds, streaming and disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvlocal.serve.documents import Catalog, KeyRing, request_documents
from kvlocal.serve.scheduler import Job, JobResult, Scheduler
from kvlocal.serve.schemas import ApiError, ChatRequest, Limits, chunk, completion, parse_request, usage_chunk


@dataclass
class ServerState:
    scheduler: Scheduler
    catalog: Catalog
    keys: KeyRing
    limits: Limits
    model_id: str
    created: int = 0


def build_app(state: ServerState) -> Starlette:
    """The application over `state`; its lifespan starts the scheduler's worker and stops it (every
    job cancelled, the worker joined: a cache write under way completes)."""
    state.created = state.created or int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        state.scheduler.start()
        try:
            yield
        finally:
            await run_in_threadpool(state.scheduler.stop)

    app = Starlette(
        routes=[Route("/v1/models", models, methods=["GET"]), Route("/v1/documents", documents, methods=["GET"]),
                Route("/v1/chat/completions", chat_completions, methods=["POST"])],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        lifespan=lifespan,
    )
    app.state.kv = state
    return app


async def models(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.kv
    state.keys.grant(request.headers.get("authorization"))
    return JSONResponse({"object": "list", "data": [
        {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "kvlocal"}]})


async def documents(request: Request) -> JSONResponse:
    """kvlocal's extension: the names a request may give in `documents` (those of the key)."""
    state: ServerState = request.app.state.kv
    allowed = state.keys.grant(request.headers.get("authorization"))
    return JSONResponse({"object": "list", "data": [
        {"id": name, "object": "document", "documents": [d.source for d in state.catalog.names[name]]}
        for name in state.catalog.visible(allowed)]})


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    allowed = state.keys.grant(request.headers.get("authorization"))
    req = parse_request(await _body(request, state.limits.max_request_bytes), state.limits)
    docs = await run_in_threadpool(request_documents, req, state.catalog, allowed, state.limits)
    job = Job(docs, req.question, req.max_tokens, req.temperature, req.seed, loop=asyncio.get_running_loop())
    state.scheduler.submit(job)
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    try:
        first = await job.events.get()  # the first token, or why there is none
        kind, value = first
        if kind == "error":
            raise value
        if kind == "cancelled":
            return Response(status_code=499)  # the client is gone: nobody reads this
        if req.stream:
            watcher.cancel()  # the event stream watches for the disconnect from here on
            return EventSourceResponse(_stream(job, req, first, state.model_id), ping=15)
        return await _whole(job, first, state.model_id)
    finally:
        watcher.cancel()


async def _whole(job: Job, event: tuple, model: str) -> Response:
    pieces = []
    while True:
        kind, value = event
        if kind == "delta":
            pieces.append(value)
        elif kind == "done":
            result: JobResult = value
            return JSONResponse(completion(job.id, model, result.text, result.finish, result.usage, result.reads))
        elif kind == "error":
            raise value
        else:
            return Response(status_code=499)
        event = await job.events.get()


async def _stream(job: Job, req: ChatRequest, event: tuple, model: str):
    """The answer as chat.completion.chunk events; the last one with the finish reason and `kv_reads`,
    then the usage (stream_options.include_usage) and [DONE]. Leaving early (the client went away,
    the server stops) cancels the job."""
    try:
        yield json.dumps(chunk(job.id, model, {"role": "assistant", "content": ""}))
        while True:
            kind, value = event
            if kind == "delta":
                yield json.dumps(chunk(job.id, model, {"content": value}))
            elif kind == "done":
                yield json.dumps(chunk(job.id, model, {}, value.finish, kv_reads=value.reads))
                if req.include_usage:
                    yield json.dumps(usage_chunk(job.id, model, value.usage))
                yield "[DONE]"
                return
            elif kind == "error":
                yield json.dumps(value.body())
                return
            else:
                return
            event = await job.events.get()
    finally:
        job.cancel.set()


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel `job` when the client disconnects (the body has been read: what comes is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel.set()
            return


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) as soon as it passes `limit` bytes."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    chunks, total = [], 0
    async for part in request.stream():
        total += len(part)
        if total > limit:
            raise _too_large(limit)
        chunks.append(part)
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit:,} bytes", code="request_too_large")


async def _api_error(request: Request, err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def _http_error(request: Request, err: HTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
    return JSONResponse(ApiError(err.status_code, f"{request.method} {request.url.path}: {err.detail}",
                                 code=code).body(), status_code=err.status_code)


async def _internal_error(request: Request, err: Exception) -> JSONResponse:
    return JSONResponse(ApiError(500, f"internal error: {type(err).__name__}", code="internal_error").body(),
                        status_code=500)
