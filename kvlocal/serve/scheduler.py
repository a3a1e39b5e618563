"""Admission and the worker that owns the session.

Requests become Jobs. `Scheduler.submit` admits a job while fewer than `queue_size` jobs wait (else
ApiError 429) and hands it to the Worker, which owns the one Session and answers the jobs one at a
time, in arrival order: it readies the job's documents as `kvlocal ask A B "q"` does (a set through
kvlocal.library.load_set, cached per document; the set left loaded for the next job that asks the
same documents), decodes the answer with the server's route (`kvlocal ask`'s default unless `serve
--route` and its options say otherwise), and sends the pieces back to the request's event loop. A
job's `cancel` (its client went away, or the server stops) ends its prefill or decoding after the
current batch or token, and the worker takes the next job.

With `answers` > 1 (`kvlocal serve --batch N`) the worker decodes up to that many jobs together
(kvlocal.batch.AnswerBatch): between two steps it takes the waiting jobs that ask the documents
loaded (each reads its question and joins), and a job that asks other documents waits until the
batch has drained. Given a shelf (the documents the server was started with, kvlocal.shelf), the
worker keeps them side by side in one context, so that a job about any one of them joins the batch
whichever of them the others ask. It loads them while no job waits, one at a time from the start; a
job about one not loaded yet has it prefilled between the steps of the answers under way, then joins
them. A job about anything else (a set, an attached file) is answered as before, and the shelf is
loaded again (from the cache) once the queue is empty.
Admission, queueing, cancellation and the events a request reads are per job and the same either way.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvlocal.batch import AnswerBatch
from kvlocal.docset import text_digest
from kvlocal.errors import CancelledError, KvlocalError
from kvlocal.ingest import Document
from kvlocal.layout import SetReads
from kvlocal.library import check_set_fits, load_set
from kvlocal.routing import DEFAULT_ROUTE, ReadStats, RouteConfig
from kvlocal.serve.schemas import ApiError, api_error, usage
from kvlocal.session import Prefix, Session
from kvlocal.shelf import ShelfPlace, load_onto, open_shelf
from kvlocal.units import human_bytes

_ids = itertools.count(1)


@dataclass
class Job:
    """One request's question, its documents, and the events its answer sends back (from the worker
    thread to the request's event loop): ("delta", text), ("done", JobResult), ("error", ApiError),
    ("cancelled", None)."""

    documents: list[Document]
    question: str
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    id: str = field(default_factory=lambda: f"chatcmpl-kvlocal-{next(_ids)}")

    def emit(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the request's loop is gone (the server stopped): nobody reads this
            pass


@dataclass(frozen=True)
class JobResult:
    text: str
    finish: str  # "stop" or "length"
    usage: dict
    reads: dict  # the kv_reads extension field


@dataclass(frozen=True)
class JobRecord:
    """What a finished job did (the last few are kept: the log's facts, for tests and debugging)."""

    id: str
    documents: tuple[str, ...]
    outcome: str  # "done", "cancelled" or "error"
    answer_tokens: int = 0
    # with `audit`: (document, text) of the cells of each region the engine reports the answer read
    read_texts: tuple[tuple[str, str], ...] = ()
    answered_beside: int = 0  # the most other answers decoded in one batch with a step of this one (--batch)


class Scheduler:
    """The bounded queue in front of one Worker (see the module's docstring)."""

    def __init__(self, session: Session, *, queue_size: int = 8, max_kv: int | None = None,
                 log: Callable[[str], None] | None = None, audit: bool = False,
                 route: RouteConfig | None = None, shelf: tuple[Document, ...] = ()) -> None:
        self.queue_size = queue_size
        self.waiting = 0
        self.running: dict[str, Job] = {}  # by id: the jobs the worker has taken and not finished
        self.records: deque[JobRecord] = deque(maxlen=256)
        self.log = log or (lambda text: print(f"kvlocal serve: {text}", file=sys.stderr, flush=True))
        self.worker = Worker(session, max_kv=max_kv, log=self.log, audit=audit, route=route or DEFAULT_ROUTE,
                             shelf=shelf)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._later: deque[Job | None] = deque()  # taken from the queue while a batch of other documents ran
        self._changed = threading.Condition()
        self._open = threading.Event()  # cleared by hold(): the worker starts no job
        self._open.set()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvlocal-serve-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`; ApiError 429 when `queue_size` jobs already wait, 503 once stopping."""
        with self._changed:
            if self._stopping:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            if self.waiting >= self.queue_size:
                raise ApiError(429, f"the server is busy: {self.waiting} requests are waiting; try again shortly",
                               code="rate_limit_exceeded", kind="rate_limit_error")
            self.waiting += 1
            self._changed.notify_all()
        self._jobs.put(job)

    def hold(self) -> None:
        """The worker starts no further job until release() (the one running finishes)."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def wait_for(self, predicate: Callable[[Scheduler], bool], timeout: float) -> bool:
        """Block until `predicate(self)` holds (checked at each change of state), or `timeout` passes."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout)

    def record(self, job_id: str, timeout: float) -> JobRecord | None:
        """The worker's record of a job once it is written (None if it is not within `timeout` seconds)."""
        if not self.wait_for(lambda s: any(r.id == job_id for r in s.records), timeout):
            return None
        return next(r for r in self.records if r.id == job_id)

    def stop(self) -> None:
        """Cancel the running and waiting jobs, let the worker finish what it is writing, and join it."""
        self.cancel_running()
        self._open.set()
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join()

    def cancel_running(self) -> None:
        """Admit no further job and cancel the running one (the first step of stopping)."""
        with self._changed:
            self._stopping = True
            self.worker.cancel_loads.set()
            for job in self.running.values():
                job.cancel.set()

    def _run(self) -> None:
        while (job := self._next_job()) is not None:
            self._open.wait()
            if not self._take(job):
                continue
            if self.worker.session.answers > 1:
                self.worker.run_batch(job, self._joining, self._finished)
            else:
                self._finished(job, self.worker.run(job))

    def _next_job(self) -> Job | None:
        """The next job: one put aside while a batch ran, else the queue's. While the queue is empty the
        worker loads the shelf's documents, one at a time (a job that comes meanwhile waits for the
        document being loaded, not for the rest)."""
        if self._later:
            return self._later.popleft()
        while True:
            try:
                return self._jobs.get_nowait()
            except queue.Empty:
                if not self.worker.load_next():
                    return self._jobs.get()
                with self._changed:
                    self._changed.notify_all()

    def _take(self, job: Job) -> bool:
        """Count `job` as running, or answer it at once if it was cancelled or the server is stopping."""
        with self._changed:
            self.waiting -= 1
            stopping = self._stopping
            taken = not (stopping or job.cancel.is_set())
            if taken:
                self.running[job.id] = job
            self._changed.notify_all()
        if not taken:
            job.emit("error", ApiError(503, "the server is shutting down", code="shutting_down")) if stopping \
                else job.emit("cancelled")
            self._finished(job, JobRecord(job.id, tuple(d.source for d in job.documents), "cancelled"))
        return taken

    def _finished(self, job: Job, record: JobRecord) -> None:
        with self._changed:
            self.running.pop(job.id, None)
            self.records.append(record)
            self._changed.notify_all()

    def _joining(self, can_join: Callable[[Job], bool]) -> list[Job]:
        """The waiting jobs that may join the running batch now (taken and counted as running); the
        others taken from the queue wait in `_later`, in their order, for the batch to drain."""
        joining: list[Job] = []
        if not self._open.is_set():
            return joining
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return joining
            if job is None or self._later or not can_join(job):
                self._later.append(job)
                if job is None:
                    return joining
            elif self._take(job):
                joining.append(job)


class Worker:
    """Owns the session: readies each job's documents and decodes its answer (one job at a time, or
    with the session's `answers` > 1 several jobs together: of the same documents, or each of a
    document on the shelf)."""

    def __init__(self, session: Session, *, max_kv: int | None, log: Callable[[str], None], audit: bool,
                 route: RouteConfig, shelf: tuple[Document, ...] = ()) -> None:
        if shelf and session.answers < 2:
            raise ValueError("a shelf serves answers decoded together")
        self.session = session
        self.route = route  # every answer's (its seed the request's)
        self.max_kv = max_kv
        self.log = log
        self.audit = audit
        self._loaded: tuple | None = None  # the documents the session holds (by text and name)
        self.shelf_documents = shelf
        self._shelf_keys = {self._key_of((doc,)) for doc in shelf}
        self._places: dict[tuple, ShelfPlace] | None = None  # the open shelf's places by job key; None: not open
        self._shelf: dict[tuple, Prefix] = {}  # the loaded ones' prefixes
        self._unloadable: set[tuple] = set()  # places whose idle load failed (a job naming one tries again)
        self._shelf_started = 0.0
        self.steps = 0  # decode steps of batches run so far
        self.cancel_loads = threading.Event()  # set when the server stops: an idle load ends between ubatches

    @property
    def shelf_ready(self) -> bool:
        """Whether the shelf has nothing left to load (every document loaded, or its idle load failed);
        True without a shelf."""
        return not self.shelf_documents or (self._places is not None and not self._to_load())

    def _to_load(self) -> list[tuple]:
        return [key for key in self._places if key not in self._shelf and key not in self._unloadable]

    def load_next(self) -> bool:
        """The worker's idle work: open the shelf, or load its next document not loaded yet (from the
        cache, or prefilled and saved). False when there is nothing to load or the server stops."""
        if self.shelf_ready or self.cancel_loads.is_set():
            return False
        try:
            if self._places is None:
                self._open_shelf()
                return True
            key = self._to_load()[0]
            try:
                self._load_place(key, self.cancel_loads, None)
            except CancelledError:
                return False
            except Exception as err:  # noqa: BLE001 - the server goes on without it
                self._unloadable.add(key)
                self.log(f"shelf: {self._places[key].document.source} not loaded: {err}")
        except Exception as err:  # noqa: BLE001 - the shelf could not be opened: documents load per job
            self.log(f"shelf: not opened: {type(err).__name__}: {err}")
            self._forget()
            self.shelf_documents, self._shelf_keys = (), set()
            return False
        return True

    def _open_shelf(self) -> None:
        """Open the shelf with a place for each of its documents, none loaded (kvlocal.shelf.open_shelf)."""
        self._forget()
        self._shelf_started = time.perf_counter()
        places = open_shelf(self.session, self.shelf_documents, region=self.session.route_for(self.route).region)
        self._places = {self._key_of((place.document,)): place for place in places}

    def _load_place(self, key: tuple, cancel: threading.Event | None, job_id: str | None,
                    between: Callable[[], None] | None = None) -> None:
        """Load the shelf's place `key` (for job `job_id`, or None: as idle work; `between`: the other
        answers' steps, run between two ubatches of its prefill)."""
        place = self._places[key]
        load_onto(self.session, place, cancel=cancel, between=between,
                  log=lambda text: self.log(f"{job_id}: {text}" if job_id else text))
        self._shelf[key] = self.session.shelf[place.seq]
        self._unloadable.discard(key)
        if self.shelf_ready:
            n_tokens = sum(self._places[k].n_tokens for k in self._shelf)
            self.log(f"shelf ready: {len(self._shelf)} of {len(self._places)} documents, {n_tokens:,} tokens in "
                     f"{self.session.context.n_ctx:,} cells, {time.perf_counter() - self._shelf_started:.1f} s "
                     "after it opened")

    def _forget(self) -> None:
        """The worker knows of nothing the session holds (other documents replace the shelf, or a
        failure left the session's state unknown)."""
        self._loaded, self._places, self._shelf, self._unloadable = None, None, {}, set()

    def run(self, job: Job) -> JobRecord:
        try:
            self._ready(job)
            return self._answer(job)
        except Exception as err:  # noqa: BLE001 - a request must not take the worker down
            return self._failed(job, err)

    def _failed(self, job: Job, err: Exception) -> JobRecord:
        """The job's error sent to its client (500 for what is not kvlocal's own error)."""
        labels = tuple(d.source for d in job.documents)
        if isinstance(err, CancelledError):  # while its documents were readied
            self.log(f"{job.id}: cancelled after 0 answer tokens")
            job.emit("cancelled")
            return JobRecord(job.id, labels, "cancelled")
        if isinstance(err, KvlocalError):
            self.log(f"{job.id}: {err}")
            job.emit("error", api_error(err))
        else:
            self._forget()
            self.log(f"{job.id}: internal error: {type(err).__name__}: {err}")
            job.emit("error", ApiError(500, f"internal error: {type(err).__name__}", code="internal_error"))
        return JobRecord(job.id, labels, "error")

    def run_batch(self, first: Job, joining: Callable[[Callable[[Job], bool]], list[Job]],
                  finished: Callable[[Job, JobRecord], None]) -> None:
        """Answer `first` and every job `joining` hands over between steps, decoded together; each
        job's record goes to `finished` as its answer ends."""
        try:
            self._ready(first)
            batch = AnswerBatch(self.session, self.route)
        except Exception as err:  # noqa: BLE001 - a request must not take the worker down
            finished(first, self._failed(first, err))
            return
        run = _BatchRun(self, batch, joining, finished)
        run.join(first)
        try:
            while batch.open or run.loaded_waiting:
                run.advance()
        except Exception as err:  # noqa: BLE001
            for job in [job for job, _, _ in run.answering.values()] + run.loaded_waiting:
                finished(job, self._failed(job, err))
            self._forget()
        finally:
            batch.close()

    @staticmethod
    def _key_of(documents) -> tuple:
        return tuple((text_digest(d.text), d.source) for d in documents)

    def _key(self, job: Job) -> tuple:
        return self._key_of(job.documents)

    def _ready(self, job: Job) -> None:
        """Load the job's documents, unless the session holds exactly them already (or, for a
        document of the shelf, the shelf)."""
        key = self._key(job)
        if key in self._shelf_keys:
            if self._places is None:
                self._open_shelf()
            if key not in self._shelf:
                self._load_place(key, job.cancel, job.id)
            return
        if key == self._loaded:
            return
        self._forget()
        session = self.session
        if len(job.documents) > 1:
            check_set_fits(session, job.documents, self.max_kv)
        load = load_set(session, job.documents, cancel=job.cancel, log=lambda text: self.log(f"{job.id}: {text}"))
        hits = load.cache_hits
        self.log(f"{job.id}: {len(job.documents)} document(s), {load.n_tokens:,} tokens ready in {load.seconds:.1f} s "
                 f"({hits} from the cache)")
        self._loaded = key

    def _answer(self, job: Job) -> JobRecord:
        session = self.session
        tally = DocumentReads(session.read_tally())
        route = replace(self.route, seed=job.seed)
        answer = session.ask(job.question, route=route, max_tokens=job.max_tokens, temperature=job.temperature,
                             seed=job.seed, want_regions=True, cancel=job.cancel)
        try:
            for piece in answer:
                tally.add(piece.stats)
                if piece.text:
                    job.emit("delta", piece.text)
        finally:
            answer.close()
        summary = answer.summary()
        return self._close(job, summary, tally)

    def _close(self, job: Job, summary, tally: DocumentReads, beside: int = 0, prefix: Prefix | None = None) -> JobRecord:
        """The ended answer's record; its client gets the whole answer, or the cancelled event."""
        session = self.session
        labels = tuple(d.source for d in job.documents)
        read_texts = self._read_texts(summary.region_reads, tally, prefix) if self.audit else ()
        if job.cancel.is_set():
            self.log(f"{job.id}: cancelled after {summary.n_answer_tokens} answer tokens")
            job.emit("cancelled")
            return JobRecord(job.id, labels, "cancelled", summary.n_answer_tokens, read_texts, beside)
        reads = tally.report(summary)
        finish = "length" if summary.n_answer_tokens >= job.max_tokens or summary.context_full else "stop"
        self.log(f"{job.id}: {summary.n_answer_tokens} answer tokens; read {human_bytes(summary.bytes_read)} of "
                 f"{human_bytes(summary.bytes_dense)} dense ({summary.reduction:.1f}x fewer); "
                 f"{tally.reads.describe(rest=False)}")
        usage_counts = usage((prefix or session.prefix).cells + summary.n_question_tokens, summary.n_answer_tokens)
        job.emit("done", JobResult(summary.text, finish, usage_counts, reads))
        return JobRecord(job.id, labels, "done", summary.n_answer_tokens, read_texts, beside)

    def _read_texts(self, region_reads: dict[tuple[int, int], int], tally: DocumentReads,
                    prefix: Prefix | None = None) -> tuple[tuple[str, str], ...]:
        """The text of the document cells in each region the engine reported read (audit)."""
        size = tally.region_size
        texts = []
        for region in sorted({r for _, r in region_reads}):
            lo, hi = region * size, (region + 1) * size
            for span in tally.reads.spans:
                if max(lo, span.start) < min(hi, span.end):
                    texts.append((span.label, self.session.span_text(max(lo, span.start), min(hi, span.end), prefix)))
        return tuple(texts)


class DocumentReads:
    """An answer's reads by document (kvlocal.layout.SetReads) with the dense figure of each."""

    def __init__(self, reads: SetReads) -> None:
        self.reads = reads
        self.layer_heads = 0  # rows a cell holds, summed over the steps: a dense read of one cell
        self.region_size = 0
        self.rows_read = 0  # the engine's count over the answer's steps

    def add(self, stats: ReadStats | None) -> None:
        self.reads.add(stats)
        if stats is not None:
            self.layer_heads += stats.n_layer * stats.n_head_kv
            self.rows_read += stats.rows_read
            self.region_size = stats.region_size or self.region_size

    def report(self, summary) -> dict:
        """The kv_reads extension field: the answer's bytes read against dense (the question's read
        included), and over the answer's steps the rows the engine reported read (`answer_rows_read`) by
        where they lie: each document (in bytes too, at the dense read's bytes per row), the template
        head, and the question and answer."""
        per_row = summary.bytes_dense / summary.rows_dense if summary.rows_dense else 0.0
        documents = [{"document": span.label, "rows_read": rows, "bytes_read": round(rows * per_row),
                      "bytes_dense": round((span.end - span.start) * self.layer_heads * per_row)}
                     for span, rows in zip(self.reads.spans, self.reads.documents)]
        return {"bytes_read": summary.bytes_read, "bytes_dense": summary.bytes_dense,
                "reduction": round(summary.reduction, 2), "steps": summary.steps, "rows_read": summary.rows_read,
                "route": summary.route.mode, "answer_rows_read": self.rows_read, "documents": documents,
                "template_rows": self.reads.head,
                "question_answer_rows": self.reads.rest}


class _BatchRun:
    """One batch of a Worker (Worker.run_batch): the jobs it answers, those that join it between steps,
    and a shelf document prefilled between its steps for a job that then joins."""

    def __init__(self, worker: Worker, batch: AnswerBatch, joining: Callable[[Callable[[Job], bool]], list[Job]],
                 finished: Callable[[Job, JobRecord], None]) -> None:
        self.worker, self.batch, self.joining, self.finished = worker, batch, joining, finished
        self.key, self.shelf_open = worker._loaded, worker._places is not None
        self.answering: dict[int, tuple[Job, DocumentReads, Prefix | None]] = {}  # handle -> job, reads, prefix
        self.beside: dict[int, int] = {}  # handle -> the most other answers decoded with one of its steps
        self.loaded_waiting: list[Job] = []  # loaded between steps, waiting for a route like the open answers'
        self.loading = False  # a shelf document is being prefilled between steps (one at a time)

    def prefix_of(self, job: Job) -> Prefix | None:
        """A loaded shelf document's prefix, for a job about one."""
        return self.worker._shelf.get(self.worker._key(job)) if self.shelf_open else None

    def to_load(self, job: Job) -> bool:
        """Whether `job` is about a shelf document not loaded yet."""
        places = self.worker._places
        return places is not None and self.worker._key(job) in places and self.prefix_of(job) is None

    def can_join(self, job: Job) -> bool:
        batch = self.batch
        n_question = len(batch.question_tokens(job.question))
        if self.to_load(job):  # loads between the others' steps first, unless one loads already
            return not self.loading and batch.can_take(n_question, job.max_tokens)
        prefix = self.prefix_of(job)
        if prefix is None and (self.shelf_open or self.worker._key(job) != self.key):
            return False
        return batch.can_take(n_question, job.max_tokens, batch.route_of(job.question, prefix))

    def join(self, job: Job) -> None:
        """Open `job`'s answer, its shelf document first prefilled between the others' steps."""
        worker, batch = self.worker, self.batch
        if self.to_load(job):
            self.loading, steps_before = True, worker.steps
            try:
                worker._load_place(worker._key(job), job.cancel, job.id, between=self.share_time())
            except Exception as err:  # noqa: BLE001
                self.finished(job, worker._failed(job, err))
                return
            finally:
                self.loading = False
                batch.resume()
            worker.log(f"{job.id}: {worker.steps - steps_before} decode steps of the other answers between "
                       "its prefill's ubatches")
            if batch.open and not batch.takes_route(batch.route_of(job.question, self.prefix_of(job))):
                self.loaded_waiting.append(job)
                return
        prefix = self.prefix_of(job)
        try:
            handle = batch.add(job.question, max_tokens=job.max_tokens, temperature=job.temperature,
                               seed=job.seed, want_regions=True, cancel=job.cancel, prefix=prefix)
        except Exception as err:  # noqa: BLE001
            self.finished(job, worker._failed(job, err))
            return
        self.answering[handle] = (job, DocumentReads(worker.session.read_tally(prefix)), prefix)
        self.beside[handle] = 0

    def share_time(self) -> Callable[[], None]:
        """Work between two ubatches of a prefill: the open answers' steps, for as long as the ubatch
        took (at least one), so that both go on at about half their speed."""
        mark = time.perf_counter()

        def between() -> None:
            nonlocal mark
            start = time.perf_counter()
            ubatch_s = start - mark
            self.advance()
            while self.batch.open and time.perf_counter() - start < ubatch_s:
                self.advance()
            mark = time.perf_counter()
        return between

    def advance(self) -> None:
        """Take the jobs that may join, then decode one step of every open answer."""
        batch = self.batch
        for job in [j for j in self.loaded_waiting if not batch.open or self.can_join(j)]:
            self.loaded_waiting.remove(job)
            self.join(job)
        for job in self.joining(self.can_join):
            self.join(job)
        for handle in self.answering:
            self.beside[handle] = max(self.beside[handle], len(batch.open) - 1)
        if self.loading:
            batch.resume()  # after a prefill ubatch, the open answers' route
        if batch.open:
            self.worker.steps += 1
        for step in batch.step():
            job, tally, prefix = self.answering[step.answer]
            if step.piece is not None:
                tally.add(step.piece.stats)
                if step.piece.text:
                    job.emit("delta", step.piece.text)
            if step.summary is not None:
                del self.answering[step.answer]
                self.finished(job, self.worker._close(job, step.summary, tally, self.beside[step.answer], prefix))
