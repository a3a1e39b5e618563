"""Human-readable sizes and durations, for the CLI's stderr lines and the TUI alike (imports only re)."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> float | None:
    """Bytes from a size such as `8GiB`, `8G`, `512M`, `1.5g` or `1000000` (binary units); None if it is not one."""
    match = _SIZE.match(text)
    if not match or (match.group(3) and match.group(3).lower() not in ("b", "ib")):
        return None
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


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
