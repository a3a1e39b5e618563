"""`kvlocal bench serve`: many askers through the real server, of one document or each of its own.

For each document length and each route the benchmark starts `kvlocal serve`'s state (its own
Session, Scheduler and worker, `--batch` answers decoded together) behind the real HTTP server on a
free loopback port, and asks it with plain HTTP clients in threads, streaming server-sent events:

- the document (a planted-facts haystack of the length) is sent as a base64 `file` content part;
  a first request loads it (its prefill, or its cached state), so later requests time decoding only;
  with `--documents each`, every asker has a document of its own (haystacks of the length, one per
  seed), named when the server starts and kept side by side on its shelf (kvlocal.shelf), which the
  server loads once started; each request names its own; the probes are spread over the first
  BUSY_ASKERS documents;
- every probe alone: its answer text and its time to first token (idle);
- N askers at once, for each N of --askers: N long-form requests held at the scheduler until all
  are queued, then released, so they join one batch before its first step. Aggregate decode tok/s
  is the answer tokens after each first one over the time from the last first token to the last
  token; end to end counts every token from the release;
- the probes asked 4 at a time (held and released the same way): their texts against alone;
- a probe sent while 4 long answers decode: its time to first token (busy).

Serve batches requests that ask the documents loaded, or any documents of its shelf.
"""

from __future__ import annotations

import base64
import http.client
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable

from kvlocal.evals.intervals import wilson_interval
from kvlocal.evals.tasks import Case, score

BUSY_ASKERS = 4  # the answers decoding while a probe is timed, and the probes asked at once
SHELF_WAIT_S = 6 * 3600  # the longest wait for a shelf's documents to load (prefill on 2 cores)
LONG_PROMPT = ("Write a long, detailed account of the document, part by part, starting with part {n}. "
               "Do not stop early.")


@dataclass
class Reply:
    """One streamed answer as its client saw it (times from time.perf_counter)."""

    text: str
    completion_tokens: int
    sent: float
    first: float  # the first piece of text
    last: float  # the last piece of text
    job_id: str
    bytes_read: int
    bytes_dense: int

    @property
    def ttft(self) -> float:
        return self.first - self.sent


def stream(port: int, body: dict, on_first: Callable[[], None] | None = None, timeout: float = 1800) -> Reply:
    """POST `body` (streamed) to the server on loopback `port`; the reply's text, counts and times."""
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        sent = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"serve answered {response.status}: {response.read().decode(errors='replace')}")
        pieces: list[str] = []
        first = last = 0.0
        job_id, tokens, reads = "", 0, {}
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            job_id = chunk.get("id", job_id)
            reads = chunk.get("kv_reads", reads)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece:
                    last = time.perf_counter()
                    if not pieces:
                        first = last
                        if on_first:
                            on_first()
                    pieces.append(piece)
        return Reply("".join(pieces), tokens, sent, first or last, last, job_id, reads.get("bytes_read", 0),
                     reads.get("bytes_dense", 0))
    finally:
        conn.close()


def request(document: dict | str, question: str, max_tokens: int) -> dict:
    """A request about `document`: a `file` content part, or the name of a document the server was started with."""
    if isinstance(document, str):
        return {"model": "kvlocal", "max_tokens": max_tokens, "temperature": 0, "documents": [document],
                "messages": [{"role": "user", "content": question}]}
    return {"model": "kvlocal", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": [document, {"type": "text", "text": question}]}]}


def document_part(name: str, text: str) -> dict:
    data = base64.b64encode(text.encode()).decode()
    return {"type": "file", "file": {"filename": name, "file_data": f"data:text/plain;base64,{data}"}}


def together(state, port: int, bodies: list[dict], pool: ThreadPoolExecutor,
             on_first: Callable[[], None] | None = None) -> tuple[list, float]:
    """Send `bodies` at once, held at the scheduler until all are queued (so they join one batch
    before its first step); their futures in order and the time of the release."""
    scheduler = state.scheduler
    scheduler.hold()
    try:
        futures = [pool.submit(stream, port, body, on_first) for body in bodies]
        if not scheduler.wait_for(lambda s: s.waiting >= len(bodies), 600):
            raise RuntimeError("the requests did not reach the server's queue")
    finally:
        released = time.perf_counter()
        scheduler.release()
    return futures, released


def decode_rate(replies: list[Reply]) -> float:
    """Answer tokens after each first one, per second from the last first token to the last token."""
    start, end = max(r.first for r in replies), max(r.last for r in replies)
    after = sum(max(0, r.completion_tokens - 1) for r in replies)
    return after / (end - start) if end > start else 0.0


def bench_route(state, port: int, docs: list[dict | str], cases: list[Case], askers: list[int], n_tokens: int,
                log: Callable[[str], None]) -> dict:
    """One route's figures (see the module's docstring): every asker asks `docs[0]` (one document), or
    asker i `docs[i]` (a document each); `cases[i]` is `docs[i]`'s."""
    each = len(docs) > 1
    # (document, probe): one document's probes, or probe i of document i % BUSY_ASKERS
    probes = [(docs[i % BUSY_ASKERS] if each else docs[0], (cases[i % BUSY_ASKERS] if each else cases[0]).probes[i])
              for i in range(len(cases[0].probes))]
    probe_tokens = 24
    workers = max(max(askers), BUSY_ASKERS) + 1
    with ThreadPoolExecutor(workers) as pool:
        started = time.perf_counter()
        if each and not state.scheduler.wait_for(lambda s: s.worker.shelf_ready, SHELF_WAIT_S):
            raise RuntimeError(f"the server's shelf was not loaded in {SHELF_WAIT_S} s")
        loaded = stream(port, request(docs[0], cases[0].probes[0].question, 1))
        log(f"  document{'s' * each} ready in {loaded.first - started:.1f} s")
        alone = [stream(port, request(doc, p.question, probe_tokens)) for doc, p in probes]
        rates = {}
        for n in askers:
            bodies = [request(docs[i] if each else docs[0], LONG_PROMPT.format(n=i + 1), n_tokens) for i in range(n)]
            futures, released = together(state, port, bodies, pool)
            replies = [f.result() for f in futures]
            tokens = sum(r.completion_tokens for r in replies)
            end_to_end = tokens / (max(r.last for r in replies) - released)
            rates[n] = {"decode_tok_s": decode_rate(replies), "end_to_end_tok_s": end_to_end, "tokens": tokens,
                        "bytes_read": sum(r.bytes_read for r in replies),
                        "bytes_dense": sum(r.bytes_dense for r in replies),
                        "beside": max(_record(state, r.job_id).answered_beside for r in replies)}
            log(f"  {n} asker(s): {rates[n]['decode_tok_s']:.2f} tok/s decoding together "
                f"({end_to_end:.2f} end to end, {tokens} tokens)")
        grouped: list[Reply] = []
        for at in range(0, len(probes), BUSY_ASKERS):
            group = probes[at:at + BUSY_ASKERS]
            grouped += [f.result() for f in together(state, port, [request(doc, p.question, probe_tokens)
                                                                   for doc, p in group], pool)[0]]
        busy = _busy_ttft(state, port, docs, probes[-1], probe_tokens, n_tokens, pool)
    same = sum(a.text == g.text for a, g in zip(alone, grouped))
    log(f"  probes: {same}/{len(probes)} same text alone and {BUSY_ASKERS} at a time; "
        f"time to first token {statistics.median(r.ttft for r in alone):.2f} s idle, {busy['ttft']:.2f} s "
        f"beside {busy['beside']} decoding")
    return {
        "askers": {str(n): v for n, v in rates.items()},
        "probes": [{"question": p.question, "answers": list(p.answers), "depth": p.depth,
                    "alone": a.text, "together": g.text, "score_alone": score(p, a.text),
                    "score_together": score(p, g.text)} for (_, p), a, g in zip(probes, alone, grouped)],
        "same_text": same,
        "ttft_idle_s": [r.ttft for r in alone],
        "ttft_busy_s": busy["ttft"],
        "busy_beside": busy["beside"],
    }


def _record(state, job_id: str):
    record = state.scheduler.record(job_id, 60)
    if record is None:
        raise RuntimeError(f"no record of {job_id}")
    return record


def _busy_ttft(state, port: int, docs: list[dict | str], probe: tuple, probe_tokens: int, n_tokens: int,
               pool: ThreadPoolExecutor) -> dict:
    """A probe's time to first token while BUSY_ASKERS long answers decode (sent once each has
    its first token; they are long enough to go on decoding past the probe's first token): all
    about one document, or the long answers each about its own and the probe about `probe`'s."""
    started = threading.Barrier(BUSY_ASKERS + 1)
    bodies = [request(docs[i] if len(docs) > 1 else docs[0], LONG_PROMPT.format(n=i + 1), 3 * n_tokens)
              for i in range(BUSY_ASKERS)]
    futures, _ = together(state, port, bodies, pool, lambda: started.wait(600))
    started.wait(600)
    doc, question = probe
    probe = stream(port, request(doc, question.question, probe_tokens))
    long = [f.result() for f in futures]
    record = _record(state, probe.job_id)
    still = sum(r.last > probe.first for r in long)
    return {"ttft": probe.ttft, "beside": min(record.answered_beside, still)}


def serve_report(session_info: dict, lengths: dict, routes: dict, askers: list[int], n_tokens: int,
                 documents: str = "one") -> dict:
    return {"kind": "serve", "session": session_info, "askers": askers, "tokens": n_tokens, "documents": documents,
            "routes": {mode: asdict(route) for mode, route in routes.items()},
            "lengths": lengths}


def route_label(mode: str, route: dict) -> str:
    """A route's name in the tables: its mode, and the memory and pins when not the defaults."""
    from kvlocal.route_settings import DEFAULT_KEEP, DEFAULT_PIN

    if mode == "geometric" and (route["keep"], route["pin"]) != (DEFAULT_KEEP, DEFAULT_PIN):
        return f"{mode} keep {route['keep']:g} pin {route['pin']}"
    return mode


def serve_text(reports: list[dict]) -> str:
    """The tables (markdown) of one or more reports, a row per length and route."""
    askers = sorted({n for r in reports for n in r["askers"]})
    rows = [(r, by_mode, mode) for r in reports for by_mode in r["lengths"].values() for mode in r["routes"]]
    lines = sorted({r["session"].get("line", "") for r in reports})
    lines.append("\naggregate decode tok/s, answers decoded together (end to end in brackets):")
    lines.append("| context | route | " + " | ".join(f"{n} asker{'s' * (n > 1)}" for n in askers)
                 + " | most vs 1 | x full, by askers | KV bytes read, reduction |")
    lines.append("|---:|---|" + "---:|" * (len(askers) + 3))
    for report, by_mode, mode in rows:
        row = by_mode[mode]["askers"]
        rate = {int(n): v["decode_tok_s"] for n, v in row.items()}
        cells = [f"{rate[n]:.2f} ({row[str(n)]['end_to_end_tok_s']:.2f})" if n in rate else "–" for n in askers]
        full = by_mode.get("full", {}).get("askers", {})
        versus = ", ".join(f"{n}: {rate[n] / full[str(n)]['decode_tok_s']:.2f}" for n in sorted(rate) if str(n) in full)
        most = row[str(max(rate))]
        cut = most["bytes_dense"] / most["bytes_read"] if most["bytes_read"] else 0
        lines.append(f"| {_context(report, by_mode)} | {route_label(mode, report['routes'][mode])} | " + " | ".join(cells)
                     + f" | {rate[max(rate)] / rate[min(rate)]:.2f}x | {(versus if mode != 'full' else '') or '–'} "
                       f"| {cut:.1f}x |")
    lines.append(f"\nprobes alone and {BUSY_ASKERS} at a time; time to first token idle and beside "
                 f"{BUSY_ASKERS} decoding answers:")
    lines.append("| context | route | same text | correct alone [95 % CI] | correct together [95 % CI] | TTFT idle s (median) "
                 "| TTFT busy s | busy / idle |")
    lines.append("|---:|---|---:|---:|---:|---:|---:|---:|")
    for report, by_mode, mode in rows:
        r = by_mode[mode]
        n = len(r["probes"])
        idle = statistics.median(r["ttft_idle_s"])
        alone, both = (_correct([p[key] for p in r["probes"]]) for key in ("score_alone", "score_together"))
        lines.append(f"| {_context(report, by_mode)} | {route_label(mode, report['routes'][mode])} | {r['same_text']}/{n} "
                     f"| {alone} | {both} | {idle:.2f} | {r['ttft_busy_s']:.2f} (beside {r['busy_beside']}) "
                     f"| {r['ttft_busy_s'] / idle:.2f}x |")
    return "\n".join(lines)


def _context(report: dict, by_mode: dict) -> str:
    """A table's context cell: the document's tokens, and "each" where every asker had its own."""
    return f"{by_mode['n_tokens']:,}" + (" each" if report.get("documents") == "each" else "")


def _correct(scores: list[float]) -> str:
    """Correct probes, their share and its 95 % Wilson interval (each probe asks one fact: 0 or 1)."""
    n, right = len(scores), sum(scores)
    low, high = wilson_interval(right / n, n)
    return f"{right:g}/{n} [{100 * low:.0f}–{100 * high:.0f} %]"


def bench_serve(model, threads, lengths: list[int], modes: list[str], routes: dict, askers: list[int],
                n_tokens: int, n_probes: int, centroid_block: int, centroid_type, log, documents: str = "one") -> dict:
    """Every length and route (see the module's docstring), every asker of one document
    (`documents` "one") or of its own ("each"); the report."""
    from kvlocal.evals.runner import make_case
    from kvlocal.serve.command import open_state, serving_in_thread
    from kvlocal.serve.schemas import Limits
    from kvlocal.session import Session

    answers = max(max(askers), BUSY_ASKERS + 1)
    n_docs = answers if documents == "each" else 1
    probe_session = Session(model, threads=threads)  # its vocabulary: the cases' token counts
    try:
        depths = [round(0.1 + 0.8 * i / max(1, n_probes - 1), 3) for i in range(n_probes)]
        cases = {length: [make_case(probe_session, "lookalike", length, depths, seed) for seed in range(n_docs)]
                 for length in lengths}
    finally:
        probe_session.close()
    results: dict = {}
    info: dict = {}
    for length, length_cases in cases.items():
        by_mode: dict = {"n_tokens": length_cases[0].n_tokens}
        names = [f"lookalike-{length}-{seed}.txt" for seed in range(n_docs)]
        with tempfile.TemporaryDirectory(prefix="kvlocal-serve-bench-") as folder:
            sources = []
            if documents == "each":
                for name, case in zip(names, length_cases):
                    (Path(folder) / name).write_text(case.text)
                    sources.append(str(Path(folder) / name))
            docs = names if documents == "each" else [document_part(names[0], length_cases[0].text)]
            for mode in modes:
                log(f"serve bench {length}: {len(docs)} document(s) of {length_cases[0].n_tokens:,} tokens, route {mode}")
                state = open_state(sources, [], Limits(), model=model, threads=threads, answers=answers,
                                   queue=2 * answers, route=routes[mode], centroid_block=centroid_block,
                                   centroid_type=centroid_type)
                if documents == "each" and len(state.scheduler.worker.shelf_documents) != n_docs:
                    raise RuntimeError("the documents do not fit side by side on the server's shelf (the KV limit)")
                info = info or {"line": _session_line(state, answers, documents)}
                with serving_in_thread(state) as port:
                    by_mode[mode] = bench_route(state, port, docs, length_cases, askers, n_tokens, log)
        results[str(length)] = by_mode
    return serve_report(info, results, routes, askers, n_tokens, documents)


def _session_line(state, answers: int, documents: str = "one") -> str:
    import platform

    session = state.scheduler.worker.session
    who = "one document asked by every asker" if documents == "one" else "each asker its own document (a shelf)"
    return (f"model {session.model.path.stem}, {platform.machine()} CPU, {session.threads} threads, "
            f"serve --batch {answers}, {who}")
