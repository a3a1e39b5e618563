"""The counter lines under the heatmap: what the latest step read, and what the answer read so far."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from kvlocal.answer import ReadTotals
from kvlocal.routing import ReadStats
from kvlocal.units import human_bytes

IDLE = "Ask a question to see which KV regions each decode step reads.\nx: regions of the context, start to end · y: layers, first on top"


class ReadCounters(Static):
    """Rows and bytes read by the latest step vs the dense equivalent, reduction and decode speed."""

    DEFAULT_CSS = """
    ReadCounters {
        height: auto;
        color: $text-muted;
    }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(IDLE, id=id, classes=classes)

    def show_idle(self, text: str = IDLE) -> None:
        if "\n" not in text:
            text += "\n"  # two lines, like the live counters, so the layout does not jump
        self.update(text)

    def show_live(
        self,
        step: ReadStats | None,
        totals: ReadTotals,
        n_tokens: int,
        rate: float | None,
        *,
        label: str = "answer",
    ) -> None:
        """Live: the latest step, then the answer so far. `step` None: a finished answer (`label`)."""
        text = Text(no_wrap=False, overflow="fold")
        if step is not None:
            text.append("step ", style="bold")
            text.append(f"{step.rows_read:,} rows · {human_bytes(step.bytes_read)}")
            text.append(f" vs dense {step.rows_dense:,} · {human_bytes(step.bytes_dense)}")
            text.append(f" = {step.reduction:.1f}× fewer", style="bold")
            text.append("\n")
            text.append(f"{label} ", style="bold")
            text.append(f"{n_tokens} tok")
            if rate is not None:
                text.append(f" · {rate:,.1f} tok/s")
            if totals.bytes_dense:
                text.append(f" · {human_bytes(totals.bytes_read)} of {human_bytes(totals.bytes_dense)}")
                text.append(f" = {totals.reduction:.1f}×", style="bold")
        else:
            text.append(label, style="bold")
            text.append(f" · {n_tokens} tok")
            if rate is not None:
                text.append(f" · {rate:,.1f} tok/s")
            text.append("\n")
            if totals.bytes_dense:
                text.append(f"KV read {human_bytes(totals.bytes_read)} of {human_bytes(totals.bytes_dense)} dense")
                text.append(f" = {totals.reduction:.1f}× fewer", style="bold")
                text.append(f" ({totals.rows_read:,} of {totals.rows_dense:,} rows)")
            else:
                text.append("no KV read statistics (no decode steps)")
        if totals.fallback:
            text.append(f"\ndense fallback: {totals.fallback}", style="yellow")
        self.update(text)
