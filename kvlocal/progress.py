"""Progress and summaries on stderr (the answer alone goes to stdout)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from kvlocal.answer import AnswerSummary
from kvlocal.session import LoadResult, PrefillProgress
from kvlocal.units import human_bytes, human_seconds


class StatusLine:
    """A single self-rewriting line on a terminal; occasional plain lines otherwise."""

    def __init__(self, stream: TextIO | None = None, min_interval: float = 0.1) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.min_interval = min_interval if self.tty else 5.0
        self._last = 0.0
        self._width = 0

    def show(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.min_interval:
            return
        self._last = now
        if self.tty:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
        self._width = 0


def prefill_text(p: PrefillProgress, width: int = 24) -> str:
    filled = int(width * p.done / p.total) if p.total else width
    bar = "█" * filled + "░" * (width - filled)
    label = "prefill" if p.prefill == "dense" else f"prefill ({p.prefill})"
    return (
        f"{label} {bar} {p.done:,}/{p.total:,} tokens  {p.rate:,.0f} tok/s  "
        f"ETA {human_seconds(p.eta)}"
    )


def download_text(done: int, total: int, stage: str) -> str:
    pct = 100 * done / total if total else 100
    verb = {"download": "downloading model", "assemble": "assembling model", "verify": "verifying model"}.get(
        stage, stage
    )
    return f"{verb}: {human_bytes(done)} / {human_bytes(total)} ({pct:.0f}%)"


def load_summary(result: LoadResult) -> str:
    if result.cache_hit:
        how = f"loaded saved KV state in {result.seconds:.1f} s (cache hit, no prefill)"
        if result.prefill.routed:
            how += f"; it was prefilled {result.prefill.describe()}"
    else:
        mode = f" {result.prefill.describe()}" if result.prefill.routed else ""
        how = f"prefilled{mode} in {result.seconds:.1f} s ({result.rate:,.0f} tok/s)"
        reads = result.reads
        if result.prefill.routed and reads and reads.bytes_read:
            how += (f"; {reads.ubatches_routed} of {reads.ubatches} ubatches routed, attention read "
                    f"{human_bytes(reads.bytes_read)} vs {human_bytes(reads.bytes_dense)} dense = {reads.reduction:.1f}x fewer bytes")
        how += ", state saved" if result.saved else ""
    return f"document: {result.n_tokens:,} tokens, context {result.n_ctx:,}; {how}"


def answer_summary(s: AnswerSummary) -> str:
    lines = [
        f"answer: {s.n_answer_tokens} tokens at {s.decode_rate:.1f} tok/s "
        f"(question {s.n_question_tokens} tokens)",
        f"route: {s.route.describe()}",
    ]
    if s.focus:
        lines.append(f"read from: {s.focus} alone (the document that holds the question's rarest words; "
                     "--focus set reads every document)")
    if s.steps and s.bytes_dense:
        lines.append(
            f"KV reads over {s.steps} {'step' if s.steps == 1 else 'steps'}: {human_bytes(s.bytes_read)} "
            f"(centroids {human_bytes(s.bytes_meta)}) vs {human_bytes(s.bytes_dense)} dense "
            f"= {s.reduction:.1f}x fewer bytes; rows {s.rows_read:,} vs {s.rows_dense:,}"
        )
        if s.route.question != "steps" and s.n_answer_tokens:
            lines.append(
                f"of which the {s.route.describe_question()}: {human_bytes(s.question_bytes_read)}; "
                f"the answer's {s.n_answer_tokens} steps: {human_bytes(s.bytes_read - s.question_bytes_read)} "
                f"= {s.answer_reduction:.1f}x fewer bytes than dense steps"
            )
    if s.layers and s.model_layers > s.layers:
        lines.append(f"layers: {s.layers_routed} of the model's {s.model_layers} routed: its {s.layers} attention "
                     f"layers; the other {s.model_layers - s.layers} are recurrent and read no KV (not counted)")
    if s.placement:
        lines.append(s.placement)
        if s.n_answer_tokens and (s.wire_sent or s.wire_received):
            lines.append(f"over the wire (RPC), per answer step: {human_bytes(s.wire_sent / s.n_answer_tokens)} sent, "
                         f"{human_bytes(s.wire_received / s.n_answer_tokens)} received")
    if s.hint_cells:
        n_regions = len({c // s.route.region for c in s.hint_cells})
        lines.append(f"text hints: {n_regions} region{'s' if n_regions != 1 else ''} holding the question's "
                     f"rarest words read in place of as many top-k choices")
    if s.fallback:
        lines.append(f"note: routing fell back to dense attention: {s.fallback}")
    if s.context_full:
        lines.append("note: the answer stopped because the context is full (--ctx sets a larger one)")
    return "\n".join(lines)


def set_summary(load) -> list[str]:  # kvlocal.library.SetLoad
    """A line per document of a loaded set, then one for the set."""
    lines = []
    for doc in load.documents:
        if doc.cache_hit:
            how = "saved KV state loaded (cache hit, no prefill)"
        else:
            how = f"prefilled in {doc.seconds:.1f} s ({doc.rate:,.0f} tok/s)" + (", state saved" if doc.saved else "")
        lines.append(f"document {doc.label}: {doc.n_tokens:,} tokens; {how}")
        if doc.rebuilt_reason:
            lines.append(f"document {doc.label}: {doc.rebuilt_reason}")
    positions = ("consecutive positions" if load.layout == "consecutive" else
                 "parallel positions (each after the template head: the set is past the trained context)")
    lines.append(f"set: {len(load.documents)} documents, {load.n_cells:,} cells at {positions}, context {load.n_ctx:,}; "
                 f"{load.cache_hits} from the cache; ready in {load.ready_seconds:.1f} s "
                 f"(states loaded, moved into place), {load.seconds:.1f} s in all")
    return lines
