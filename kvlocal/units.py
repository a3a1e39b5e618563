"""Human-readable sizes and durations, for the CLI's stderr lines and the TUI alike (imports nothing)."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def human_seconds(s: float) -> str:
    if s == float("inf"):
        return "--:--"
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
