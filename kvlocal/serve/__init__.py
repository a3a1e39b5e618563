"""`kvlocal serve`: an OpenAI-compatible HTTP server over one kvlocal session.

- `command`: the CLI command's options, checked before anything loads, and the uvicorn server.
- `app`: the Starlette routes (`GET /v1/models`, `GET /v1/documents`, `POST /v1/chat/completions`,
  streamed as server-sent events or not), the API keys and the request bounds.
- `schemas`: the request's validation, the response shapes and OpenAI's error shape (`ApiError`).
- `documents`: the documents the server was started with (named per request), uploads and message
  text read into documents through kvlocal.ingest, and what each API key may name.
- `scheduler`: admission (the bounded queue, cancellation) and the worker that owns the session and
  answers a request's documents as `kvlocal ask A B "q"` does (kvlocal.library, kvlocal.session).

Starlette, uvicorn and sse-starlette are imported only when the server starts.
"""
