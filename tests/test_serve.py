"""kvlocal serve on the tiny model, with real clients (the `openai` package, httpx) against a server on a
free loopback port: the OpenAI shapes, streamed and whole; documents uploaded, named, or given as message
text, answered exactly as the session layer answers them; isolation (every cell an answer read, as the
engine reported it, holds its own documents' text); API keys; the bounded queue; disconnects; every
bad input answered in OpenAI's error shape while the server keeps serving; Ctrl-C on the command."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.engine

from kvlocal import kvstate  # noqa: E402
from kvlocal.cli_options import RouteOptions  # noqa: E402
from kvlocal.ingest import Document, read_bytes  # noqa: E402
from kvlocal.library import load_set  # noqa: E402
from kvlocal.route_settings import DEFAULT_MODE  # noqa: E402
from kvlocal.serve.command import check_host, open_state, serving_in_thread  # noqa: E402
from kvlocal.serve.schemas import Limits  # noqa: E402
from kvlocal.errors import UsageError  # noqa: E402
from kvlocal.sample import SAMPLE_ANSWER, SAMPLE_QUESTION, sample_document  # noqa: E402
from kvlocal.session import Session  # noqa: E402
from test_ingest import make_pdf  # noqa: E402


def words(tag: str, n: int = 60) -> str:
    """A document whose every sentence carries `tag` (no two documents share a sentence)."""
    return " ".join(f"{tag}{i} holds {i * 7 % 101} {tag}." for i in range(n))


DOCS = {name: words(name) for name in ("alpha", "bravo", "charlie", "delta")}
QUESTION = "what does alpha3 hold?"


class Running:
    def __init__(self, state, port: int) -> None:
        self.state = state
        self.scheduler = state.scheduler
        self.url = f"http://127.0.0.1:{port}/v1"

    def client(self, key: str = "none", timeout: float = 120) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=timeout)

    def post(self, body, key: str | None = None, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if isinstance(body, (bytes, str)):
            return httpx.post(f"{self.url}/chat/completions", content=body, headers=headers, timeout=120, **kwargs)
        return httpx.post(f"{self.url}/chat/completions", json=body, headers=headers, timeout=120, **kwargs)

    def record(self, job_id: str):
        """The worker's record of a job, once it is written."""
        record = self.scheduler.record(job_id, 120)
        assert record is not None
        return record


@contextlib.contextmanager
def serving(model: Path | None, sources=(), keys=(), limits: Limits = Limits(), **options):
    """A server in a thread on a socket bound (and listening) before it starts: a client can connect at
    once, and its request is served as soon as the app has started."""
    state = open_state([str(s) for s in sources], list(keys), limits, model=model and str(model), threads=2, audit=True,
                       **options)
    with serving_in_thread(state) as port:
        yield Running(state, port)
    assert not state.scheduler._thread.is_alive()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """One server for the tests that need no special settings, with the documents' folder named."""
    folder = tmp_path_factory.mktemp("named") / "library"
    folder.mkdir()
    for name, text in DOCS.items():
        (folder / f"{name}.txt").write_text(text)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLOCAL_CACHE_DIR", str(tmp_path_factory.mktemp("serve-cache")))
        with serving(tiny_model, [folder, folder / "alpha.txt", folder / "bravo.txt"]) as running:
            running.folder = folder
            yield running


def file_part(name: str, data: bytes, mime: str | None = "text/plain") -> dict:
    encoded = base64.b64encode(data).decode()
    return {"type": "file", "file": {"filename": name, "file_data": f"data:{mime};base64,{encoded}" if mime else encoded}}


def ask_body(*parts: dict, question: str = QUESTION, max_tokens: int = 6, **extra) -> dict:
    return {"model": "kvlocal", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}], **extra}


def session_answer(model: Path, docs: list[Document], question: str = QUESTION, max_tokens: int = 6,
                   mode: str = DEFAULT_MODE) -> str:
    """The answer the session layer gives (kvlocal ask's path: load_set, the default route or `mode`'s)."""
    session = Session(str(model), threads=2)
    try:
        load_set(session, docs)
        route = RouteOptions().config(mode, 0)
        return session.answer(question, route=route, max_tokens=max_tokens).text
    finally:
        session.close()


# -- shapes and answers ------------------------------------------------------------------------------


def test_models_and_a_whole_answer_with_the_openai_client(server, tiny_model):
    client = server.client()
    [model] = client.models.list().data
    assert (model.id, model.owned_by) == ("tiny-qwen2", "kvlocal")
    reply = client.chat.completions.create(model=model.id, max_tokens=6, messages=[
        {"role": "user", "content": [file_part("alpha.txt", DOCS["alpha"].encode()), {"type": "text", "text": QUESTION}]}])
    record = server.record(reply.id)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == session_answer(tiny_model, [Document(DOCS["alpha"], "alpha.txt", "txt")])
    assert reply.usage.completion_tokens == record.answer_tokens == 6 and reply.choices[0].finish_reason == "length"
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6 and reply.usage.prompt_tokens > 100
    reads = reply.model_extra["kv_reads"]
    assert [d["document"] for d in reads["documents"]] == ["alpha.txt"]
    assert 0 < reads["bytes_read"] < reads["bytes_dense"]
    # the parts the answer's reads are attributed to add up to the engine's own count of rows read
    assert sum(d["rows_read"] for d in reads["documents"]) + reads["template_rows"] + reads["question_answer_rows"] \
        == reads["answer_rows_read"] < reads["rows_read"]


def test_the_route_serve_is_started_with_decodes_every_answer(tiny_model, cache_dir):
    """`serve --route full` (here its state): every answer reads every cell, and is the answer `kvlocal ask
    --route full` gives."""
    alpha = Document(DOCS["alpha"], "alpha.txt", "txt")
    with serving(tiny_model, route=RouteOptions().config("full")) as running:
        reply = running.post(ask_body(file_part("alpha.txt", DOCS["alpha"].encode()))).json()
    reads = reply["kv_reads"]
    assert reads["bytes_read"] == reads["bytes_dense"] > 0
    assert reply["choices"][0]["message"]["content"] == session_answer(tiny_model, [alpha], mode="full")


def test_a_streamed_answer_is_the_whole_answer_in_chunks(server):
    client = server.client()
    messages = [{"role": "user", "content": [file_part("bravo.txt", DOCS["bravo"].encode()),
                                             {"type": "text", "text": "what does bravo2 hold?"}]}]
    whole = client.chat.completions.create(model="m", max_tokens=8, messages=messages)
    chunks = list(client.chat.completions.create(model="m", max_tokens=8, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    last, usage = chunks[-2], chunks[-1]
    assert last.choices[0].finish_reason == "length" and usage.choices == []
    assert (usage.usage.completion_tokens, usage.usage.prompt_tokens) == (8, whole.usage.prompt_tokens)
    assert last.model_extra["kv_reads"]["documents"][0]["document"] == "bravo.txt"


def test_named_documents_and_a_folder_are_a_set_answered_as_ask_answers_it(server, tiny_model):
    # the start arguments, by their last component
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": QUESTION}], "documents": ["bravo.txt", "alpha.txt"]}
    reply = server.post(body).json()
    folder = server.folder
    want = session_answer(tiny_model, [Document(DOCS[n], str(folder / f"{n}.txt"), "txt") for n in ("bravo", "alpha")],
                          max_tokens=5)
    assert reply["choices"][0]["message"]["content"] == want
    assert [d["document"] for d in reply["kv_reads"]["documents"]] == [str(folder / "bravo.txt"), str(folder / "alpha.txt")]
    whole = server.post(body | {"documents": ["library"]}).json()  # the folder: its four files
    assert [Path(d["document"]).name for d in whole["kv_reads"]["documents"]] == sorted(f"{n}.txt" for n in DOCS)
    listed = httpx.get(f"{server.url}/documents").json()["data"]
    assert {d["id"] for d in listed} == {"library", str(folder), "alpha.txt", "bravo.txt", str(folder / "alpha.txt"),
                                         str(folder / "bravo.txt")}


def test_message_text_is_the_document_when_nothing_else_is(server, tiny_model):
    body = {"max_tokens": 5, "messages": [{"role": "system", "content": DOCS["charlie"]},
                                          {"role": "user", "content": "what does charlie4 hold?"}]}
    reply = server.post(body).json()
    assert [d["document"] for d in reply["kv_reads"]["documents"]] == ["message 1"]
    assert reply["choices"][0]["message"]["content"] == session_answer(
        tiny_model, [Document(DOCS["charlie"], "message 1", "txt")], "what does charlie4 hold?", 5)


def test_one_message_of_lines_is_a_document_then_its_question(server, tiny_model):
    """RULER's client (and a chat box with a pasted document) sends one user message: the lines before its
    last are the document, the last line is the question, answered as the two are answered apart."""
    body = {"max_tokens": 5, "messages": [{"role": "user",
                                           "content": DOCS["charlie"] + "\n\nwhat does charlie4 hold?\n \n"}]}
    reply = server.post(body).json()
    assert [d["document"] for d in reply["kv_reads"]["documents"]] == ["message text"]
    assert reply["choices"][0]["message"]["content"] == session_answer(
        tiny_model, [read_bytes(DOCS["charlie"].encode() + b"\n", "message text", "txt")], "what does charlie4 hold?", 5)
    blank_before = server.post({"messages": [{"role": "user", "content": "  \n\nwhat does charlie4 hold?"}]})
    assert blank_before.status_code == 400 and "no document" in blank_before.json()["error"]["message"]


# -- isolation -----------------------------------------------------------------------------------------


def test_concurrent_requests_each_read_only_their_own_documents(server):
    """Four askers at once, each on its own document: every region the engine reported an answer read
    lies in that answer's own document (its cells' text is the document's), never in another's."""
    def ask(name: str):
        question = f"what does {name}5 hold?"
        reply = server.post(ask_body(file_part(f"{name}.txt", DOCS[name].encode()), question=question,
                                     max_tokens=12)).json()
        return name, reply

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, DOCS))
    for name, reply in replies:
        assert [d["document"] for d in reply["kv_reads"]["documents"]] == [f"{name}.txt"]
        record = server.record(reply["id"])
        assert record.outcome == "done" and record.documents == (f"{name}.txt",)
        assert record.read_texts, "the route read no region of the document: the check would be empty"
        for label, text in record.read_texts:
            assert label == f"{name}.txt"
            piece = text.strip("\n")
            assert piece in DOCS[name]
            assert not any(piece in DOCS[other] for other in DOCS if other != name)


# -- keys, queue, disconnects ----------------------------------------------------------------------------


def test_api_keys_bound_to_documents(tiny_model, cache_dir, tmp_path):
    for name in ("alpha", "bravo"):
        (tmp_path / f"{name}.txt").write_text(DOCS[name])
    sources = [tmp_path / "alpha.txt", tmp_path / "bravo.txt"]
    with serving(tiny_model, sources, keys=["open-key", "alpha-key=alpha.txt"]) as running:
        named = ask_body(max_tokens=2) | {"messages": [{"role": "user", "content": QUESTION}]}
        for key, status in [(None, 401), ("wrong", 401)]:
            reply = running.post(named | {"documents": ["alpha.txt"]}, key)
            assert reply.status_code == status and reply.json()["error"]["code"] == "invalid_api_key"
        denied = running.post(named | {"documents": ["bravo.txt"]}, "alpha-key")
        assert denied.status_code == 404 and denied.json()["error"]["param"] == "documents[0]"
        assert running.post(named | {"documents": ["alpha.txt"]}, "alpha-key").status_code == 200
        assert running.post(named | {"documents": ["bravo.txt"]}, "open-key").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            running.client("wrong").models.list()
        seen = httpx.get(f"{running.url}/documents", headers={"Authorization": "Bearer alpha-key"}).json()["data"]
        assert {d["id"] for d in seen} == {"alpha.txt", str(tmp_path / "alpha.txt")}


def test_a_full_queue_answers_429_and_the_held_request_is_answered(tiny_model, cache_dir):
    with serving(tiny_model, queue=1) as running, ThreadPoolExecutor(1) as pool:
        body = ask_body(file_part("delta.txt", DOCS["delta"].encode()), max_tokens=2)
        running.scheduler.hold()
        waiting = pool.submit(running.post, body)
        assert running.scheduler.wait_for(lambda s: s.waiting == 1, 60)
        busy = running.post(body)
        assert busy.status_code == 429
        assert busy.json()["error"] | {"message": ""} == {"message": "", "type": "rate_limit_error", "param": None,
                                                           "code": "rate_limit_exceeded"}
        with pytest.raises(openai.RateLimitError):
            running.client().chat.completions.create(**body)
        running.scheduler.release()
        assert waiting.result().status_code == 200


def test_a_client_that_disconnects_cancels_its_answer_and_frees_the_worker(server):
    body = ask_body(file_part("alpha.txt", DOCS["alpha"].encode()), max_tokens=2000, stream=True)
    with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=120) as response:
        chunks = (json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:"))
        first = next(c for c in chunks if c["choices"][0]["delta"].get("content"))  # a token was decoded
    record = server.record(first["id"])  # the connection is closed: the worker stops the answer
    assert record.outcome == "cancelled" and 0 < record.answer_tokens < 2000
    assert server.post(ask_body(file_part("alpha.txt", DOCS["alpha"].encode()), max_tokens=2)).status_code == 200


# -- bad input -------------------------------------------------------------------------------------------


def _bad_cases() -> list[tuple[str, object, int, str | None]]:
    text = file_part("alpha.txt", DOCS["alpha"].encode())
    user = lambda content: {"messages": [{"role": "user", "content": content}]}  # noqa: E731
    return [
        ("not json", b"{not json", 400, "invalid_json"),
        ("not an object", b"[1, 2]", 400, None),
        ("no messages", {"model": "m"}, 400, None),
        ("last message not the user's", {"messages": [{"role": "user", "content": "q"},
                                                     {"role": "assistant", "content": "a"}]}, 400, None),
        ("unknown role", {"messages": [{"role": "robot", "content": "q"}]}, 400, None),
        ("image part", user([{"type": "image_url", "image_url": {"url": "http://x"}}, {"type": "text", "text": "q"}]),
         400, None),
        ("bad base64", user([{"type": "file", "file": {"file_data": "data:text/plain;base64,@@@"}},
                             {"type": "text", "text": "q"}]), 400, None),
        ("file id", user([{"type": "file", "file": {"file_id": "file-1"}}, {"type": "text", "text": "q"}]), 400, None),
        ("binary upload", ask_body(file_part("blob.bin", bytes(range(256)) * 64, "application/octet-stream")),
         400, None),
        ("empty upload", ask_body(file_part("empty.txt", b"   ")), 400, "invalid_document"),
        ("no question", user([text]), 400, None),
        ("no document", user("just a question"), 400, None),
        ("max_tokens over the bound", ask_body(text, max_tokens=10_000), 400, None),
        ("max_tokens zero", ask_body(text, max_tokens=0), 400, None),
        ("temperature a string", ask_body(text, temperature="hot"), 400, None),
        ("stream not a bool", ask_body(text, stream="yes"), 400, None),
        ("n of 2", ask_body(text, n=2), 400, None),
        ("too many documents", ask_body(*[file_part(f"{i}.txt", f"doc {i}".encode()) for i in range(4)]),
         400, "too_many_documents"),
        ("document too large", ask_body(file_part("big.txt", b"word " * 20_000)), 413, "document_too_large"),
        ("request too large", ask_body(file_part("x.txt", b"a"), question="q" * 300_000), 413, "request_too_large"),
        ("unknown name", ask_body(documents=["nowhere.pdf"]), 404, "document_not_found"),
        ("documents not a list", ask_body(text, documents="alpha.txt"), 400, None),
        ("duplicate document", ask_body(text, file_part("again.txt", DOCS["alpha"].encode())), 400,
         "duplicate_document"),
        ("document over the context", ask_body(file_part("long.txt", words("echo", 2000).encode())), 400,
         "context_length_exceeded"),
    ]


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(tiny_model, cache_dir):
    limits = Limits(max_request_bytes=256 * 1024, max_document_bytes=64 * 1024, max_tokens=512, max_documents=3)
    with serving(tiny_model, limits=limits) as running:
        for name, body, status, code in _bad_cases():
            reply = running.post(body)
            assert reply.status_code == status, (name, reply.text)
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], name
            assert "\n" not in error["message"] and error["type"] == "invalid_request_error", name
            if code:
                assert error["code"] == code, name
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            running.client().chat.completions.create(model="m", max_tokens=513, messages=[{"role": "user",
                                                                                          "content": "q"}])
        assert httpx.get(f"{running.url}/nothing").json()["error"]["code"] == "not_found"
        assert httpx.get(f"{running.url}/chat/completions").status_code == 405
        binary = running.post(_bad_cases()[8][1]).json()["error"]["message"]
        assert binary.startswith("unsupported document type '.bin' (blob.bin)")
        good = running.post(ask_body(file_part("alpha.txt", DOCS["alpha"].encode()), max_tokens=2))
        assert good.status_code == 200


# -- the command ------------------------------------------------------------------------------------------


def test_a_non_loopback_address_needs_a_key():
    check_host("127.0.0.1", False)
    check_host("::1", False)
    check_host("localhost", False)
    check_host("0.0.0.0", True)
    with pytest.raises(UsageError, match="refusing to listen on 0.0.0.0 without an API key"):
        check_host("0.0.0.0", False)
    result = subprocess.run([sys.executable, "-m", "kvlocal.cli", "serve", "--host", "192.168.1.5"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("kvlocal: error: refusing to listen on 192.168.1.5 without an API key")


def test_ctrl_c_stops_the_command_cleanly_with_the_cache_written(tiny_model, cache_dir, tmp_path):
    """`kvlocal serve` in a process: ready when it says so on stderr; a request prefills a document
    (its state saved); SIGINT during a long streamed answer ends the stream, the worker stops, and the
    process exits 130 as every kvlocal command does when interrupted."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    # SIGINT at its default in the server, as a terminal's Ctrl-C finds it, even where this test runs as a
    # background job of a shell without job control (which starts it, and so the server, ignoring SIGINT)
    proc = subprocess.Popen([sys.executable, "-m", "kvlocal.cli", "serve", "--port", str(port), "--model",
                             str(tiny_model), "--threads", "2"], stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stderr:
            if "Application startup complete" in line:
                break
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = ask_body(file_part("alpha.txt", DOCS["alpha"].encode()), max_tokens=2000, stream=True)
        with httpx.stream("POST", url, json=body, timeout=120) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGINT)
            rest = list(lines)  # the stream ends: the answer was cancelled
        assert "data: [DONE]" not in rest
        assert proc.wait(timeout=120) == 130  # kvlocal's exit status for an interrupt
        log = proc.stderr.read()
        assert "cancelled after" in log and "Application shutdown complete" in log and "Traceback" not in log
        assert log.endswith("kvlocal: interrupted\n")
        assert [e.label for e in kvstate.list_entries()] == ["alpha.txt"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the real model ---------------------------------------------------------------------------------------


@pytest.mark.model
def test_the_openai_client_streams_the_planted_fact_of_an_attached_pdf(cache_dir):
    """The README's example: the default model, the sample report as a PDF of a few pages,
    the question streamed back with the `openai` package."""
    lines = [line for paragraph in sample_document().split("\n\n") for line in [*textwrap.wrap(paragraph, 90), ""]]
    pages = [lines[i : i + 48] for i in range(0, len(lines), 48)]  # lines that fit the page: pdfium reads the page
    with serving(None) as running:
        stream = running.client(timeout=1800).chat.completions.create(  # the first token follows the prefill
            model="qwen2.5-coder-1.5b", max_tokens=48, stream=True, messages=[{"role": "user", "content": [
                file_part("report.pdf", make_pdf(pages), "application/pdf"), {"type": "text", "text": SAMPLE_QUESTION}]}])
        chunks = list(stream)
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert SAMPLE_ANSWER in answer
    reads = chunks[-1].model_extra["kv_reads"]
    assert reads["documents"][0]["document"] == "report.pdf" and reads["bytes_read"] < reads["bytes_dense"]


# -- answers decoded together (--batch) -------------------------------------------------------------------


def test_requests_of_the_same_documents_decode_together_and_others_wait(tiny_model, cache_dir):
    """Three requests of one document, queued while the worker is held, join one batch before its first
    step and answer as kvlocal.batch answers them together; a request of another document waits for the
    batch to drain and is answered alone; every cell each answer read holds its own document's text."""
    from kvlocal.batch import AnswerBatch
    from kvlocal.routing import DEFAULT_ROUTE

    questions = ["what does alpha3 hold?", "what does alpha9 hold?", "which word follows alpha12?"]
    alpha = file_part("alpha.txt", DOCS["alpha"].encode())
    with serving(tiny_model, answers=3) as running, ThreadPoolExecutor(4) as pool:
        running.scheduler.hold()
        futures = []
        for i, question in enumerate(questions):  # one at a time: the batch's sequences in this order
            futures.append(pool.submit(running.post, ask_body(alpha, question=question, max_tokens=6)))
            assert running.scheduler.wait_for(lambda s, n=i + 1: s.waiting == n, 60)
        other = pool.submit(running.post, ask_body(file_part("bravo.txt", DOCS["bravo"].encode()),
                                                   question="what does bravo2 hold?", max_tokens=6))
        assert running.scheduler.wait_for(lambda s: s.waiting == 4, 60)
        running.scheduler.release()
        replies = [f.result().json() for f in futures]
        bravo = other.result().json()
        records = [running.record(r["id"]) for r in replies + [bravo]]
    assert all(r.outcome == "done" for r in records)
    assert max(r.answered_beside for r in records[:3]) == 2 and records[3].answered_beside == 0
    for record in records:
        assert record.read_texts
        tag = record.documents[0].split(".")[0]
        assert all(label.startswith(tag) and tag in text for label, text in record.read_texts)

    session = Session(str(tiny_model), threads=2, answers=3)
    try:
        load_set(session, [Document(DOCS["alpha"], "alpha.txt", "txt")])
        batch = AnswerBatch(session, DEFAULT_ROUTE)
        handles = [batch.add(q, max_tokens=6, want_regions=True) for q in questions]
        texts = {}
        while batch.open:
            texts.update({s.answer: s.summary.text for s in batch.step() if s.summary is not None})
    finally:
        session.close()
    assert [r["choices"][0]["message"]["content"] for r in replies] == [texts[h] for h in handles]
