"""A chat completion request checked into a ChatRequest, the response shapes, and OpenAI's error shape.

Where the documents of a request come from (README "Serve"): `file` content parts (base64, as a data
URL or bare), the names in the extension field `documents` (what the server was started with), and,
when the request has neither, the text of its system messages, of its earlier user messages and of
the last user message's text parts before its last one. The question is the last user message's
last text part. A request that is one text and nothing else (a single user message, as RULER's
client and most chat clients send a pasted document with its question) has the lines before its
last line as the document and its last line as the question. Assistant and tool messages are left
out: each question is answered afresh from the documents.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from kvlocal.errors import ContextOverflowError, DocumentError, KvlocalError, UsageError

MAX_MESSAGES = 256
MAX_TEMPERATURE = 2.0  # OpenAI's range (the session takes more)
DEFAULT_MAX_TOKENS = 256  # kvlocal ask's default
DECLARED_KINDS = {
    "application/pdf": "pdf", "application/epub+zip": "epub", "text/html": "html",
    "application/xhtml+xml": "html", "text/markdown": "md", "text/plain": "txt",
}


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def api_error(err: KvlocalError) -> ApiError:
    """The HTTP error for a kvlocal error met while reading documents or answering."""
    if isinstance(err, ContextOverflowError):
        return ApiError(400, str(err), code="context_length_exceeded")
    if isinstance(err, (DocumentError, UsageError)):
        return ApiError(400, str(err), code="invalid_document" if isinstance(err, DocumentError) else None,
                        param=err.setting)
    return ApiError(500, str(err), code="engine_error")


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (each over its bound is a 4xx in OpenAI's error shape)."""

    max_request_bytes: int = 64 * 1024 * 1024
    max_document_bytes: int = 32 * 1024 * 1024
    max_tokens: int = 4096
    max_documents: int = 16


@dataclass(frozen=True)
class Upload:
    """A document sent in the request: a file part's bytes, or a message's text."""

    name: str
    data: bytes
    declared: str | None  # the kind the client declared (None: told by the content)
    param: str  # where it sat in the request, for an error


@dataclass
class ChatRequest:
    question: str
    uploads: list[Upload] = field(default_factory=list)
    named: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    seed: int = 0


def parse_request(raw: bytes, limits: Limits) -> ChatRequest:
    """The request body checked against `limits`; ApiError (400 or 413) naming the field at fault."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON ({err})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of messages", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(400, f"at most {MAX_MESSAGES} messages (got {len(messages)})", param="messages")
    req = ChatRequest(question="", stream=_bool(body, "stream"), max_tokens=_max_tokens(body, limits),
                      temperature=_number(body, "temperature", 0.0, 0.0, MAX_TEMPERATURE),
                      seed=int(_number(body, "seed", 0, 0, 2**32 - 1, integer=True)))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    req.include_usage = bool(options and options.get("include_usage") is True)
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    req.named = _names(body.get("documents"))
    texts = _read_messages(messages, req, limits)
    if not req.uploads and not req.named:
        # the messages' text is the document only where nothing else is; one text alone, its lines
        req.uploads = texts or _lines_before_the_question(req, f"messages[{len(messages) - 1}].content", limits)
    if not req.uploads and not req.named:
        raise ApiError(400, "no document: attach a file content part, name a document in 'documents', or give "
                       "the document as a message's text (or as lines) before the question", param="messages")
    return req


def _lines_before_the_question(req: ChatRequest, where: str, limits: Limits) -> list[Upload]:
    """A request of one text: its last non-blank line stays the question, the lines before it are the
    document (none where there is one line)."""
    text = req.question.rstrip()
    cut = text.rfind("\n")
    if cut < 0 or not text[:cut].strip():
        return []
    req.question = text[cut + 1:]
    return [_text_document(text[:cut], "message text", where, limits)]


def _read_messages(messages: list, req: ChatRequest, limits: Limits) -> list[Upload]:
    """Fill in the question and the file parts; the texts that are documents where nothing else is."""
    texts: list[Upload] = []
    last = len(messages) - 1
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"{where} must be an object with a 'role'", param=where)
        role = message["role"]
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"{where} has an unknown role {role!r}", param=f"{where}.role")
        parts = _parts(message.get("content"), where, role)
        if i == last and role != "user":
            raise ApiError(400, "the last message must be the user's question", param=where)
        if role in ("assistant", "tool"):
            continue
        message_texts = []
        for j, part in enumerate(parts):
            if part.get("type") == "file":
                req.uploads.append(_file_part(part, f"{where}.content[{j}]", len(req.uploads) + 1, limits))
            else:
                message_texts.append(part["text"])
        if i == last:
            if not message_texts or not message_texts[-1].strip():
                raise ApiError(400, "the last user message holds no question text", param=f"{where}.content")
            req.question = message_texts.pop()
        for text in message_texts:
            if text.strip():
                texts.append(_text_document(text, f"message {i + 1}", f"{where}.content", limits))
    return texts


def _parts(content: Any, where: str, role: str) -> list[dict]:
    """A message's content as parts: {"type": "text", "text"} or {"type": "file", "file"}."""
    if content is None and role in ("assistant", "tool"):
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of content parts", param=f"{where}.content")
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind == "file" and isinstance(part.get("file"), dict):
            continue
        raise ApiError(400, f"{at}: content parts of type 'text' (with 'text') and 'file' (with 'file') are supported "
                       f"(got {kind!r})", param=at)
    return content


def _file_part(part: dict, where: str, n: int, limits: Limits) -> Upload:
    """A file part's bytes: `file_data` as a data URL (data:<type>;base64,...) or bare base64."""
    file = part["file"]
    data = file.get("file_data")
    if not isinstance(data, str):
        what = "file ids are not supported (send 'file_data')" if "file_id" in file else "'file_data' is missing"
        raise ApiError(400, f"{where}.file: {what}", param=f"{where}.file.file_data")
    declared = None
    if data.startswith("data:"):
        header, _, data = data.partition(",")
        mime = header[5:].split(";")[0].strip().lower()
        declared = DECLARED_KINDS.get(mime)
        if not header.endswith(";base64"):
            raise ApiError(400, f"{where}.file.file_data: a data URL must be base64", param=f"{where}.file.file_data")
    if len(data) * 3 // 4 > limits.max_document_bytes:
        raise _too_large(where, limits)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}.file.file_data is not valid base64", param=f"{where}.file.file_data") from None
    if len(raw) > limits.max_document_bytes:
        raise _too_large(where, limits)
    name = file.get("filename") if isinstance(file.get("filename"), str) and file.get("filename") else f"upload {n}"
    return Upload(name, raw, declared, where)


def _text_document(text: str, name: str, where: str, limits: Limits) -> Upload:
    data = text.encode("utf-8", "replace")
    if len(data) > limits.max_document_bytes:
        raise _too_large(where, limits)
    return Upload(name, data, "txt", where)


def _too_large(where: str, limits: Limits | None = None) -> ApiError:
    bound = f" (at most {limits.max_document_bytes:,} bytes)" if limits else ""
    return ApiError(413, f"{where}: the document is too large{bound}", code="document_too_large", param=where)


def _names(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ApiError(400, "'documents' must be a list of document or folder names", param="documents")
    return list(value)


def _bool(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be true or false", param=key)
    return value


def _number(body: dict, key: str, default: float, low: float, high: float, *, integer: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not math.isfinite(value) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise ApiError(400, f"'{key}' must be {kind} between {low:g} and {high:g} (got {value!r})", param=key)
    return value


def _max_tokens(body: dict, limits: Limits) -> int:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    default = min(DEFAULT_MAX_TOKENS, limits.max_tokens)
    return int(_number(body, key, default, 1, limits.max_tokens, integer=True))


# -- responses ----------------------------------------------------------------------------------


def completion(request_id: str, model: str, text: str, finish: str, usage: dict, reads: dict) -> dict:
    """A whole chat completion; `kv_reads` is kvlocal's extension (what the answer read of the cache)."""
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                         "logprobs": None}],
            "usage": usage, "kv_reads": reads}


def chunk(request_id: str, model: str, delta: dict, finish: str | None = None, **extra) -> dict:
    """One streamed chunk (`extra`: `kv_reads` on the last one)."""
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}


def usage_chunk(request_id: str, model: str, usage: dict) -> dict:
    """The chunk after the last that carries the usage (stream_options.include_usage)."""
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
