"""`kvlocal bench`: speed and memory of routed vs dense decoding and prefill, measured in one run.

Everything is a ratio between measurements taken back to back in this process on the same
prefilled state, so a noisy, shared machine still gives comparable figures.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvlocal.evals.report import ATTENTION_LABELS
from kvlocal.evals.runner import DEFAULT_DEPTHS, make_case
from kvlocal.routing import PrefillConfig, RouteConfig
from kvlocal.session import Session


@dataclass
class DecodeRun:
    mode: str
    tokens: int
    seconds: float
    bytes_read: int
    bytes_dense: int
    route: str = ""  # the route the answer took (a set of documents may take its own: routing.resolve_route)
    wire_sent: int = 0  # bytes the answer's steps sent over the RPC servers' connections
    wire_received: int = 0  # and received

    @property
    def wire_per_step(self) -> float:
        return (self.wire_sent + self.wire_received) / self.tokens if self.tokens else 0.0

    @property
    def wire_sent_per_step(self) -> float:
        return self.wire_sent / self.tokens if self.tokens else 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def speedup_of(runs: dict[str, DecodeRun]) -> float:
    """Geometric's decode rate over full's (0 when either did not run)."""
    full, geo = runs.get("full"), runs.get("geometric")
    return geo.rate / full.rate if full and geo and full.rate else 0.0


@dataclass
class LengthResult:
    length: int
    n_tokens: int
    kv_bytes: int
    runs: dict[str, DecodeRun] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return speedup_of(self.runs)


def _decode(session: Session, question: str, route: RouteConfig, n_tokens: int, repeats: int) -> DecodeRun:
    """Tokens per second of the answer steps (question steps excluded), best of `repeats`."""
    best = None
    for _ in range(repeats):
        summary = session.answer(question, route=route, max_tokens=n_tokens)
        run = DecodeRun(route.mode, summary.n_answer_tokens, summary.decode_seconds,
                        summary.bytes_read, summary.bytes_dense, summary.route.describe(),
                        summary.wire_sent, summary.wire_received)
        if best is None or run.rate > best.rate:
            best = run
    return best


CONTROLS = ("window", "random")  # the controls, timed at the geometric route's budget
PLAIN_LOOP = "llama.cpp loop"  # dense decoding by llama.cpp's own loop (Session.plain_loop)


def _plain_loop(session: Session, question: str, n_tokens: int, repeats: int) -> DecodeRun:
    """llama.cpp's own dense decoding of the same answer length on the same state, best of `repeats`."""
    best = None
    for _ in range(repeats):
        tokens, seconds = session.plain_loop(question, n_tokens)
        run = DecodeRun(PLAIN_LOOP, tokens, seconds, 0, 0, "full (dense attention), llama.cpp's loop")
        if best is None or run.rate > best.rate:
            best = run
    return best


def _full_and_geometric(session: Session, question: str, route: RouteConfig, n_tokens: int, repeats: int,
                        log: Callable[[str], None], controls: bool = False,
                        plain_loop: bool = False, other_attention: bool = False) -> dict[str, DecodeRun]:
    """The answer steps' rate with full attention, then with `route`, back to back on the loaded state;
    with `controls` also the window and random routes at `route`'s budget, with `other_attention` `route`
    read by the other attention path (gathered, or in place), with `plain_loop` llama.cpp's own dense loop."""
    runs = {}
    other = "in-place" if route.attention == "gather" else "gather"
    for mode in ("full", "geometric", *((other,) if other_attention else ()), *(CONTROLS if controls else ())):
        if mode == "full":
            r = RouteConfig(mode="full", question=route.question)
        elif mode in ATTENTION_LABELS:
            r = replace(session.route_for(route), attention=mode)
        else:
            r = route if mode == "geometric" else replace(session.route_for(route), mode=mode)
        runs[mode] = _decode(session, question, r, n_tokens, repeats)
        log(f"  {mode:<9} {runs[mode].rate:6.2f} tok/s over {runs[mode].tokens} tokens")
    if plain_loop:
        runs[PLAIN_LOOP] = _plain_loop(session, question, n_tokens, repeats)
        log(f"  {PLAIN_LOOP} {runs[PLAIN_LOOP].rate:6.2f} tok/s over {runs[PLAIN_LOOP].tokens} tokens")
    return runs


def read_ceiling(weights_bytes: int, run: DecodeRun, full: DecodeRun) -> float:
    """The speed-up over `full` that `run`'s reads allow where decoding is bound by memory bandwidth:
    (weights + dense KV bytes per step) / (weights + the KV bytes `run` read per step)."""
    if not run.tokens or not full.tokens:
        return 0.0
    dense = full.bytes_dense / full.tokens
    read = run.bytes_read / run.tokens
    return (weights_bytes + dense) / (weights_bytes + read)


def _haystack(session: Session, length: int) -> str:
    """The eval grid's passkey haystack of seed 0, so a state saved by `kvlocal eval` is reused."""
    return make_case(session, "passkey", length, list(DEFAULT_DEPTHS), 0).text


def bench_lengths(session: Session, lengths: list[int], route: RouteConfig, *, n_tokens: int = 48,
                  repeats: int = 2, log: Callable[[str], None] = print, controls: bool = False,
                  plain_loop: bool = False, other_attention: bool = False) -> list[LengthResult]:
    results = []
    for length in lengths:
        loaded = session.load_document(_haystack(session, length), label=f"bench {length}")
        log(f"bench {length}: {loaded.n_tokens:,} tokens ({'cache hit' if loaded.cache_hit else 'prefilled'})")
        question = "Write a detailed summary of the document, section by section."
        res = LengthResult(length, loaded.n_tokens, session.kv_bytes())
        res.runs = _full_and_geometric(session, question, route, n_tokens, repeats, log, controls, plain_loop,
                                       other_attention)
        results.append(res)
    return results


@dataclass
class PrefillRun:
    """One document prefilled from scratch, densely and (unless the bench was told dense only) then routed."""

    length: int
    n_tokens: int
    dense_s: float
    routed_s: float | None  # None: not prefilled routed
    bytes_reduction: float | None  # attention K/V and metadata bytes the routed prefill read, vs dense

    @property
    def speedup(self) -> float | None:
        return self.dense_s / self.routed_s if self.routed_s else None


def bench_prefill(session: Session, lengths: list[int], prefill: PrefillConfig, *,
                  log: Callable[[str], None] = print, routed: bool = True) -> list[PrefillRun]:
    """Seconds to prefill the eval grid's passkey haystack of each length, dense then (with `routed`) routed."""
    results = []
    for length in lengths:
        text = _haystack(session, length)
        dense = session.load_document(text, label=f"bench prefill {length}", use_cache=False)
        log(f"prefill {length}: {dense.n_tokens:,} tokens dense in {dense.seconds:.1f} s ({dense.rate:,.1f} tok/s)")
        if not routed:
            results.append(PrefillRun(length, dense.n_tokens, dense.seconds, None, None))
            continue
        sparse = session.load_document(text, label=f"bench prefill {length}", use_cache=False, prefill=prefill)
        reduction = sparse.reads.reduction if sparse.reads else 1.0
        log(f"prefill {length}: routed in {sparse.seconds:.1f} s ({sparse.rate:,.1f} tok/s), "
            f"{dense.seconds / max(sparse.seconds, 1e-9):.2f}x faster, {reduction:.1f}x fewer attention bytes")
        results.append(PrefillRun(length, dense.n_tokens, dense.seconds, sparse.seconds, reduction))
    return results


def time_to_first_token(session: Session, text: str, route: RouteConfig, question: str) -> dict[str, float]:
    """Seconds from asking to the first answer token: a fresh document (prefill) vs its saved state."""
    out = {}
    for label, use_cache in (("fresh", False), ("cached", True)):
        if use_cache:
            session.load_document(text, label="bench ttft")  # make sure the state is saved
            session.unload()  # a new context, as a new process would have
        start = time.perf_counter()
        session.load_document(text, label="bench ttft", use_cache=use_cache)
        answer = session.ask(question, route=route, max_tokens=1)
        next(answer, None)  # the first token (or none, if the answer ends at once)
        answer.close()
        out[label] = time.perf_counter() - start
    return out


def centroid_upkeep_share(model: str | None, text: str, threads: int | None, centroid_block: int = 16,
                          repeats: int = 2) -> dict[str, float]:
    """Prefill time with the region centroids kept up to date vs without them (same text, fresh contexts)."""
    times: dict[str, list[float]] = {"with": [], "without": []}
    for _ in range(repeats):
        for label, blk in (("without", 0), ("with", centroid_block)):
            session = Session(model, threads=threads, centroid_block=blk)
            start = time.perf_counter()
            session.load_document(text, label="bench upkeep", use_cache=False)
            times[label].append(time.perf_counter() - start)
            session.close()
    with_, without = min(times["with"]), min(times["without"])
    return {"with_s": with_, "without_s": without, "share": (with_ - without) / with_}


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class SetBench:
    """A library set readied from its cached bodies, then decoded full and geometric back to back."""

    n_documents: int
    length: int  # each document's context length
    n_cells: int
    layout: str
    ready_s: float  # state loads, shifts and centroids, in a fresh context (no prefill)
    kv_bytes: int
    runs: dict[str, DecodeRun] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return speedup_of(self.runs)


def bench_library(session, sizes: list[int], length: int, route: RouteConfig, *, n_tokens: int = 48,
                  repeats: int = 1, seed: int = 0, log: Callable[[str], None] = print) -> list[SetBench]:
    """For each set size: the eval's library set of `seed` (`kvlocal eval library`), its missing bodies
    prefilled and cached first, then readied from the cache in a fresh context and decoded."""
    from kvlocal.evals.library_runner import LibraryConfig, make_set_case
    from kvlocal.library import load_set

    results = []
    for n in sizes:
        case = make_set_case(session, LibraryConfig(n, [length], [seed], ["full"]), length, seed, None)
        first = load_set(session, case.documents, log=log)
        if first.cache_hits < len(first.documents):
            log(f"bench library {n}: {len(first.documents) - first.cache_hits} bodies prefilled and cached")
        session.unload()
        loaded = load_set(session, case.documents)
        res = SetBench(n, length, loaded.n_cells, loaded.layout, loaded.ready_seconds, session.kv_bytes())
        log(f"bench library {n} x {length}: {loaded.n_cells:,} cells ({loaded.layout}), ready in {loaded.ready_seconds:.1f} s")
        question = "Write a detailed summary of the documents, one by one."
        res.runs = _full_and_geometric(session, question, route, n_tokens, repeats, log)
        results.append(res)
    return results


def machine_fields(session: Session) -> dict:
    """Where a bench ran: the device the model's layers were offloaded to (the first non-CPU device the
    engine registered, else the CPU), and the weights' type and size."""
    from kvlocal.engine import backend_devices

    devices = backend_devices()
    device = next((d for d in devices if d.kind != "cpu"), devices[-1] if devices else None)
    return {
        "backend": device.name if device else "CPU",
        "device": device.description if device else "",
        "weights": session.model.info.weight_type,
        "weights_bytes": session.model.info.file_size,
        **({"placement": placement} if (placement := session.layer_placement()) else {}),
    }


def rpc_fields(runs: dict[str, DecodeRun], here: dict[str, DecodeRun] | None) -> dict:
    """A row's fields of a run that put layers on RPC servers (none otherwise): what crossed the wire per
    answer step, and with `here` the same answers' rates with every layer on this machine."""
    full, geo = runs["full"], runs["geometric"]
    row = {}
    if full.wire_per_step or geo.wire_per_step:  # layers on RPC servers: what crossed the wire per answer step
        row["full_wire_per_step"], row["geometric_wire_per_step"] = full.wire_per_step, geo.wire_per_step
        row["full_wire_sent_per_step"] = full.wire_sent_per_step  # of which sent to the servers
        row["geometric_wire_sent_per_step"] = geo.wire_sent_per_step
    if here:
        row["here_full_tps"], row["here_geometric_tps"] = here["full"].rate, here["geometric"].rate
    return row


def length_fields(result: LengthResult, weights_bytes: int, here: LengthResult | None = None) -> dict:
    """One context length's row of the bench report: each mode's rate, its ratio to full, its KV read
    reduction, and the ratio its reads would allow if decoding were bound by memory bandwidth; with
    `here`, the same length decoded with every layer on this machine (a bench over RPC servers)."""
    full, geo = result.runs["full"], result.runs["geometric"]
    row = {"length": result.length, "n_tokens": result.n_tokens, "kv_bytes": result.kv_bytes,
           "full_tps": full.rate, "geometric_tps": geo.rate, "speedup": result.speedup,
           "bytes_reduction": geo.bytes_dense / max(1, geo.bytes_read),
           "ceiling": read_ceiling(weights_bytes, geo, full)}
    for mode in (*ATTENTION_LABELS, *CONTROLS):
        if mode in result.runs:
            run = result.runs[mode]
            row[f"{mode}_tps"] = run.rate
            row[f"{mode}_speedup"] = run.rate / full.rate if full.rate else 0.0
            row[f"{mode}_ceiling"] = read_ceiling(weights_bytes, run, full)
    row.update(rpc_fields(result.runs, here.runs if here else None))
    if PLAIN_LOOP in result.runs:
        row["plain_loop_tps"] = result.runs[PLAIN_LOOP].rate
        row["full_vs_plain_loop"] = full.rate / row["plain_loop_tps"] if row["plain_loop_tps"] else 0.0
    return row


def document_report(session: Session, results: list[LengthResult], route: RouteConfig, prefill: PrefillConfig,
                    prefills: list[PrefillRun], first_token: dict, here: list[LengthResult] | None = None) -> dict:
    """`kvlocal bench`'s report (its --out file, kvlocal.evals.report.bench_text's input); `here`: the
    same lengths decoded with every layer on this machine, when `session` put layers on RPC servers."""
    return {
        "model": session.model.alias or str(session.model.path), "threads": session.threads,
        **machine_fields(session),
        "route": session.route_for(route).describe(),
        "lengths": [length_fields(r, session.model.info.file_size, h) for r, h in zip(results, here or [None] * len(results))],
        "prefill": "dense only" if prefills and not any(p.routed_s for p in prefills) else prefill.describe(),
        "prefill_lengths": [{"length": p.length, "n_tokens": p.n_tokens, "dense_s": p.dense_s, "routed_s": p.routed_s,
                             "speedup": p.speedup, "bytes_reduction": p.bytes_reduction} for p in prefills],
        "ttft_fresh_s": first_token.get("fresh"), "ttft_cached_s": first_token.get("cached"),
        "peak_rss_bytes": peak_rss_bytes(),
    }


def library_report(session: Session, results: list[SetBench], route: RouteConfig, seed: int,
                   here: list[SetBench] | None = None) -> dict:
    """`kvlocal bench library`'s report (its --out file, kvlocal.evals.library_report.bench_text's input);
    `here`: the same sets decoded with every layer on this machine, when `session` put layers on RPC servers."""
    return {
        "model": session.model.alias or str(session.model.path), "threads": session.threads,
        "route": session.route_for(route).describe(),
        **({"placement": placement} if (placement := session.layer_placement()) else {}),
        "seed": seed,
        "library": [{"n_documents": r.n_documents, "length": r.length, "n_cells": r.n_cells, "layout": r.layout,
                     "ready_s": r.ready_s, "kv_bytes": r.kv_bytes, "full_tps": r.runs["full"].rate,
                     "geometric_tps": r.runs["geometric"].rate, "speedup": r.speedup,
                     "bytes_reduction": r.runs["geometric"].bytes_dense / max(1, r.runs["geometric"].bytes_read),
                     "geometric_route": r.runs["geometric"].route,
                     **rpc_fields(r.runs, h.runs if h else None)}
                    for r, h in zip(results, here or [None] * len(results))],
        "peak_rss_bytes": peak_rss_bytes(),
    }
