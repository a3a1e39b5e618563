"""The hand-off between the ask worker (a thread) and the UI: text and KV reads of the answer so far.

The worker calls `LiveAnswer.add(piece)` for every decoded token; that only takes a lock and updates
numpy arrays, so decoding never waits for the UI. A UI timer calls `take()` every ~80 ms and gets the
text written since the last call plus a snapshot of the reads (the latest step and the accumulated
counts), so however fast the model decodes, the heatmap repaints at a bounded rate.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace

import numpy as np

from kvlocal.answer import ReadTotals
from kvlocal.routing import ReadStats


def regions_for(n_tokens: int, region_size: int) -> int:
    return -(-n_tokens // region_size) if region_size > 0 else 0


@dataclass
class ReadMap:
    """Which (layer, region) cells an answer read: the last step and how many steps read each cell."""

    acc: np.ndarray  # int32 [n_layer, n_cols]: steps that read the cell
    now: np.ndarray  # bool [n_layer, n_cols]: read by the latest step
    steps: int
    doc_regions: int  # regions of the document prompt; further columns are the question and answer
    region_size: int
    extent: int = 0  # columns in use (document regions or further, when the window reads the answer)

    @classmethod
    def empty(cls, n_layer: int, doc_regions: int, region_size: int, n_cols: int | None = None) -> ReadMap:
        n_cols = max(n_cols or doc_regions, doc_regions, 1)
        return cls(
            acc=np.zeros((max(n_layer, 1), n_cols), np.int32),
            now=np.zeros((max(n_layer, 1), n_cols), bool),
            steps=0,
            doc_regions=doc_regions,
            region_size=region_size,
            extent=doc_regions,
        )

    @property
    def n_layer(self) -> int:
        return int(self.acc.shape[0])

    def copy(self) -> ReadMap:
        return ReadMap(self.acc.copy(), self.now.copy(), self.steps, self.doc_regions, self.region_size, self.extent)

    def region_total(self, region: int) -> int:
        """Reads of a region summed over layers (a step that reads it in 3 layers counts 3)."""
        if not 0 <= region < self.acc.shape[1]:
            return 0
        return int(self.acc[:, region].sum())

    def layers_reading(self, region: int) -> int:
        if not 0 <= region < self.acc.shape[1]:
            return 0
        return int((self.acc[:, region] > 0).sum())


@dataclass
class LiveUpdate:
    text: str
    reads: ReadMap | None  # None when no step arrived since the last update
    step: ReadStats | None  # the latest step's, as the engine counted them
    n_tokens: int
    rate: float  # decode tokens per second so far
    totals: ReadTotals = field(default_factory=ReadTotals)  # summed over the answer's steps (a copy)


class LiveAnswer:
    """Thread-safe accumulator of one streaming answer."""

    def __init__(self, n_layer: int, n_ctx: int, n_prefix: int, region_size: int) -> None:
        self.region_size = region_size
        self._lock = threading.Lock()
        self._reads = ReadMap.empty(n_layer, regions_for(n_prefix, region_size), region_size, regions_for(n_ctx, region_size))
        self._text: list[str] = []
        self._step: ReadStats | None = None
        self._totals = ReadTotals()
        self._dirty = False
        self._n_tokens = 0
        self._t_first = 0.0
        self._t_last = 0.0

    # -- worker side ------------------------------------------------------------------------------

    def add(self, piece) -> None:  # kvlocal.session.AnswerPiece
        now = time.perf_counter()
        with self._lock:
            if piece.text:
                self._text.append(piece.text)
            if piece.token >= 0:
                self._n_tokens += 1
                if self._n_tokens == 1:
                    self._t_first = now
                self._t_last = now
            if piece.stats is not None:
                self._add_stats(piece.stats)
            self._dirty = True

    def _add_stats(self, stats) -> None:  # kvlocal.routing.ReadStats
        reads = self._reads
        n_layer, n_cols = reads.acc.shape
        now = reads.now
        now[:] = False
        routed = np.zeros(n_layer, bool)
        layers = np.asarray(stats.layers, np.int64)
        regions = np.asarray(stats.regions)
        if layers.size and regions.size:
            per_layer = regions.reshape(len(layers), -1).astype(np.int64)
            rows = np.repeat(layers, per_layer.shape[1])
            cols = per_layer.ravel()
            ok = (rows >= 0) & (rows < n_layer) & (cols >= 0) & (cols < n_cols)
            now[rows[ok], cols[ok]] = True
            routed[layers[(layers >= 0) & (layers < n_layer)]] = True
        # layers that attended densely (full mode, a fallback, or layers the engine does not route) read
        # every region of the context; shown over the columns in use, as n_kv is padded past the tokens
        dense = ~routed
        dense[min(n_layer, max(int(stats.n_layer), 0)) :] = False
        now[dense, : min(n_cols, reads.extent)] = True
        reads.acc += now
        reads.steps += 1
        touched = np.flatnonzero(now.any(axis=0))
        if touched.size:
            reads.extent = max(reads.extent, int(touched[-1]) + 1)
        self._step = stats
        self._totals.add(stats)

    # -- UI side ----------------------------------------------------------------------------------

    def take(self) -> LiveUpdate | None:
        """What changed since the last call (None if nothing did)."""
        with self._lock:
            if not self._dirty:
                return None
            self._dirty = False
            text = "".join(self._text)
            self._text.clear()
            elapsed = self._t_last - self._t_first
            rate = (self._n_tokens - 1) / elapsed if self._n_tokens > 1 and elapsed > 0 else 0.0
            return LiveUpdate(
                text=text,
                reads=self._reads.copy() if self._reads.steps else None,
                step=self._step,
                n_tokens=self._n_tokens,
                rate=rate,
                totals=replace(self._totals),  # a snapshot
            )

    def reads(self) -> ReadMap:
        with self._lock:
            return self._reads.copy()
