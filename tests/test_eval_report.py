"""The eval report: which rows make the main table, and the budget sweep over top-k and centroid block."""

from __future__ import annotations

from kvlocal.evals import report


def _row(mode: str, score: float, *, top_k: int = 4, block: int | None = 16, depth: float = 0.5,
         bytes_read: int = 100, bytes_meta: int = 0) -> dict:
    row = {"length": 4096, "task": "passkey", "mode": mode, "top_k": top_k, "score": score, "depth": depth,
           "n_tokens": 4000, "sinks": 64, "window": 128, "bytes_dense": 1000, "bytes_read": bytes_read,
           "bytes_meta": bytes_meta, "decode_tps": 10.0, "prefill_tps": 50.0}
    if block is not None:
        row["centroid_block"] = block
    return row


def test_sweep_counts_centroid_block_as_part_of_the_budget():
    rows = [
        _row("full", 1.0, bytes_read=1000),
        _row("window", 0.0, bytes_read=50),
        _row("random", 0.0, bytes_read=50),
        _row("geometric", 1.0, block=None, bytes_read=80, bytes_meta=30),  # written before blocks were recorded
        _row("geometric", 1.0, block=64, bytes_read=58, bytes_meta=8),
        _row("geometric", 0.0, top_k=2, block=64, bytes_read=40, bytes_meta=8),
    ]
    summary = report.summarize(rows)
    assert summary["main_top_k"] == 4 and summary["main_centroid_block"] == 16
    geo = [c for c in summary["cells"] if c["mode"] == "geometric"]
    assert len(geo) == 1 and geo[0]["n"] == 1 and geo[0]["reduction"] == 1000 / 80  # the block-16 row only
    [sweep] = summary["sweep"]
    assert [(p["top_k"], p["centroid_block"]) for p in sweep["points"]] == [(4, 16), (2, 64), (4, 64)]
    # the matching budget with the largest reduction: top-4 with one centroid per 64 tokens
    assert (sweep["smallest_matching_top_k"], sweep["centroid_block_at_match"]) == (4, 64)
    text = report.markdown(summary)
    assert "4/b64: 100% x17.2" in text and "| 4/b64 | 17.2x |" in text
    assert report.check_ordering(summary) == []


def test_main_cells_use_the_default_block_when_finer_ones_ran_too():
    rows = [
        _row("full", 1.0, bytes_read=1000),
        _row("window", 0.0, bytes_read=50),
        _row("geometric", 0.0, block=16, bytes_read=80, bytes_meta=30),
        _row("geometric", 1.0, block=8, bytes_read=110, bytes_meta=60),
    ]
    summary = report.summarize(rows)
    assert summary["main_centroid_block"] == 16
    [geo] = [c for c in summary["cells"] if c["mode"] == "geometric"]
    assert geo["accuracy"] == 0.0 and geo["reduction"] == 1000 / 80
    # without a default-block row, the smallest block run makes the main cells
    assert report.summarize([r for r in rows if r.get("centroid_block") != 16])["main_centroid_block"] == 8
