"""Summaries of evaluation rows: markdown tables, a JSON summary, the budget sweep, PNG plots."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from statistics import mean

from kvlocal.atomic import write_text_atomic
from kvlocal.units import human_bytes
from kvlocal.evals.intervals import wilson_interval
from kvlocal.evals.runner import block, hint_rule, question_pass
from kvlocal.route_settings import (
    DEFAULT_CENTROID_BLOCK, DEFAULT_CENTROID_TYPE, DEFAULT_KEEP, DEFAULT_LAYER_TOP_K, DEFAULT_PIN, DEFAULT_QUESTION,
    DEFAULT_QUESTION_TOP_K, DEFAULT_REGION, DEFAULT_SHORTLIST, DEFAULT_SINKS, DEFAULT_WINDOW, MODES, SHORTLIST_AUTO,
    UNCALIBRATED_ROUTE, ModelRoute, auto_shortlist, model_route,
)


def _group(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[tuple(r[k] for k in keys)].append(r)
    return groups


def scoring(row: dict) -> tuple[int, int, float, str, str, int, str, int]:
    """How a geometric row scored and read regions: (centroid block, shortlist, keep, question pass,
    centroid type, pins, budgets per layer, the automatic shortlist's floor); rows written before
    two-level scoring, the selection memory, the question batch, Q8_0 centroids, pins, budgets per
    layer and model routes scanned every centroid, kept no memory, decoded the question token by
    token, kept F16 centroids, pinned nothing, gave every layer top-k and had no floor."""
    return (block(row), row.get("shortlist", 0), row.get("keep", 0.0), question_pass(row),
            row.get("centroid_type", "f16"), row.get("pin", 0), row.get("layer_top_k", ""),
            row.get("shortlist_floor", 0))


DEFAULT_SCORING = (DEFAULT_CENTROID_BLOCK, DEFAULT_SHORTLIST, DEFAULT_KEEP,
                   question_pass({"question": DEFAULT_QUESTION, "question_top_k": DEFAULT_QUESTION_TOP_K}),
                   DEFAULT_CENTROID_TYPE, DEFAULT_PIN, DEFAULT_LAYER_TOP_K, 0)


def scoring_label(point: dict) -> str:
    """'' for the default scoring, else e.g. '/b16' or '/b4 s32 keep 0.9 steps q8_0' (the centroid
    type named unless it is f16, the type of every row written before it was recorded)."""
    b, s, k = point["centroid_block"], point.get("shortlist", 0), point.get("keep", 0.0)
    q, t, pin = point.get("question", "steps"), point.get("centroid_type", "f16"), point.get("pin", 0)
    layers, floor = point.get("layer_top_k", ""), point.get("shortlist_floor", 0)
    if (b, s, k, q, t, pin, layers, floor) == DEFAULT_SCORING:
        return ""
    shortlist = (" s auto" + (f">={floor}" if floor else "")) if s == SHORTLIST_AUTO else f" s{s}" if s else ""
    return (f"/b{b}" + shortlist + (f" keep {k:g}" if k else "") + f" {q}"
            + (f" {t}" if t != "f16" else "") + (f" pin {pin}" if pin else "") + (f" layers {layers}" if layers else ""))


def _accuracy(rows: list[dict]) -> dict:
    """Mean score, its number of rows and its 95 % Wilson interval (None for no rows)."""
    if not rows:
        return {"accuracy": None, "n": 0, "accuracy_ci": None}
    accuracy = mean(r["score"] for r in rows)
    return {"accuracy": accuracy, "n": len(rows), "accuracy_ci": wilson_interval(accuracy, len(rows))}


def main_budget(rows: list[dict]) -> int | None:
    """The top-k the controls ran at (the grid's main budget)."""
    ks = {r["top_k"] for r in rows if r["mode"] in ("window", "random")}
    return min(ks) if ks else None


def main_scoring(rows: list[dict]) -> tuple[int, int, float, str, str, int, str, int]:
    """The scoring of the main geometric cells: the default one if it ran, else the one with the
    smallest centroid block (the finest)."""
    ran = {scoring(r) for r in rows if r["mode"] == "geometric"}
    if DEFAULT_SCORING in ran or not ran:
        return DEFAULT_SCORING
    return min(ran)


def summarize(rows: list[dict]) -> dict:
    """Accuracy, reads and speed per (length, task, mode) at the main budget, plus the sweep."""
    k0 = main_budget(rows)
    s0 = main_scoring(rows)
    main = [r for r in rows if r["mode"] == "full" or
            ((r["top_k"] == k0 or k0 is None) and r.get("layer_top_k", "") == s0[6]
             and (r["mode"] != "geometric" or scoring(r) == s0))]
    cells = []
    for (length, task, mode), group in sorted(_group(main, "length", "task", "mode").items(),
                                              key=lambda kv: (kv[0][0], kv[0][1], _mode_rank(kv[0][2]))):
        far = _accuracy([r for r in group if _outside_window(r)])
        cells.append({
            "length": length, "task": task, "mode": mode, "top_k": None if mode == "full" else k0,
            **_accuracy(group),
            "accuracy_outside_window": far["accuracy"],
            "n_outside": far["n"],
            "accuracy_outside_window_ci": far["accuracy_ci"],
            "reduction": mean(r["bytes_dense"] / r["bytes_read"] for r in group if r["bytes_read"]),
            "meta_share": mean(r["bytes_meta"] / r["bytes_read"] for r in group if r["bytes_read"]),
            "decode_tps": mean(r["decode_tps"] for r in group),
            "prefill_tps": _first([r["prefill_tps"] for r in group]),
        })
    return {"main_top_k": k0, "main_centroid_block": s0[0], "main_shortlist": s0[1], "main_keep": s0[2],
            "main_question": s0[3], "main_centroid_type": s0[4], "main_pin": s0[5], "main_layer_top_k": s0[6],
            "main_shortlist_floor": s0[7],
            "cells": cells, "sweep": sweep(rows)}


def sweep(rows: list[dict]) -> list[dict]:
    """Per length and task: accuracy and reduction of geometric at each budget (top-k and centroid
    block), and the budget with the largest reduction whose accuracy matches full."""
    out = []
    for (length, task), group in sorted(_group(rows, "length", "task").items()):
        dense = _accuracy([r for r in group if r["mode"] == "full"])
        dense_far = _accuracy([r for r in group if r["mode"] == "full" and _outside_window(r)])
        if not dense["n"]:
            continue
        full_acc = dense["accuracy"]
        points = []
        geo = [dict(r, centroid_block=block(r), shortlist=r.get("shortlist", 0), keep=r.get("keep", 0.0),
                    question=question_pass(r),
                    centroid_type=r.get("centroid_type", "f16"), pin=r.get("pin", 0),
                    layer_top_k=r.get("layer_top_k", ""), shortlist_floor=r.get("shortlist_floor", 0))
               for r in group if r["mode"] == "geometric"]
        for (b, s, kp, q, t, pin, layers, floor, k), g in sorted(_group(
                geo, "centroid_block", "shortlist", "keep", "question", "centroid_type", "pin", "layer_top_k",
                "shortlist_floor", "top_k").items()):
            far = _accuracy([r for r in g if _outside_window(r)])
            points.append({"top_k": k, "centroid_block": b, "shortlist": s, "keep": kp, "question": q,
                           "centroid_type": t, "pin": pin, "layer_top_k": layers, "shortlist_floor": floor,
                           **_accuracy(g),
                           "accuracy_outside_window": far["accuracy"], "n_outside": far["n"],
                           "accuracy_outside_window_ci": far["accuracy_ci"],
                           "reduction": mean(r["bytes_dense"] / r["bytes_read"] for r in g)})
        matching = [p for p in points if p["accuracy"] >= full_acc - 1e-9]
        best = max(matching, key=lambda p: p["reduction"]) if matching else None
        out.append({"length": length, "task": task, "full_accuracy": full_acc, "full_n": dense["n"],
                    "full_accuracy_ci": dense["accuracy_ci"], "points": points,
                    "full_accuracy_outside_window": dense_far["accuracy"], "full_n_outside": dense_far["n"],
                    "full_accuracy_outside_window_ci": dense_far["accuracy_ci"],
                    "smallest_matching_top_k": best["top_k"] if best else None,
                    "centroid_block_at_match": best["centroid_block"] if best else None,
                    "scoring_at_match": scoring_label(best) if best else None,
                    "reduction_at_match": best["reduction"] if best else None})
    return out


def markdown(summary: dict) -> str:
    budget = (f"Routing budget: top-{summary['main_top_k']} regions (controls at the same budget)"
              if summary["main_top_k"] is not None else "Routing budget: no window/random controls in these rows")
    lines = [budget, "",
             "| length | task | mode | accuracy [95 % CI] (n) | acc. outside window [95 % CI] (n) "
             "| KV bytes reduction | centroid share | decode tok/s |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    for c in summary["cells"]:
        acc = _accuracy_text(c["accuracy"], c["accuracy_ci"], c["n"])
        far = _accuracy_text(c["accuracy_outside_window"], c["accuracy_outside_window_ci"], c["n_outside"])
        lines.append(
            f"| {c['length']:,} | {c['task']} | {c['mode']} | {acc} | {far} "
            f"| {c['reduction']:.1f}x | {c['meta_share']:.0%} | {c['decode_tps']:.1f} |"
        )
    if any(s["points"] for s in summary["sweep"]):
        lines += ["", "Budget sweep (geometric):", "",
                  "| length | task | full acc. [95 % CI] (n) | budgets (top-k[/centroid block]: acc. [95 % CI], "
                  "reduction; n where it differs from full's) | smallest matching | reduction |",
                  "|---:|---|---:|---|---:|---:|"]
        for s in summary["sweep"]:
            pts = ", ".join(_point_text(p, s["full_n"]) for p in s["points"])
            k = "–" if s["smallest_matching_top_k"] is None else (
                f"{s['smallest_matching_top_k']}{s.get('scoring_at_match') or ''}")
            red = "–" if s["reduction_at_match"] is None else f"{s['reduction_at_match']:.1f}x"
            full = _accuracy_text(s["full_accuracy"], s["full_accuracy_ci"], s["full_n"])
            lines.append(f"| {s['length']:,} | {s['task']} | {full} | {pts} | {k} | {red} |")
    return "\n".join(lines)


def points_markdown(summary: dict) -> str:
    """One row per geometric budget point (top-k and scoring), beside full: accuracy, accuracy on the
    facts outside the sinks and window, and the KV bytes reduction."""
    lines = ["| length | task | route | accuracy [95 % CI] (n) | acc. outside window [95 % CI] (n) | KV bytes reduction |",
             "|---:|---|---|---:|---:|---:|"]
    for s in summary["sweep"]:
        far = _accuracy_text(s.get("full_accuracy_outside_window"), s.get("full_accuracy_outside_window_ci"),
                             s.get("full_n_outside", 0))
        lines.append(f"| {s['length']:,} | {s['task']} | full | "
                     f"{_accuracy_text(s['full_accuracy'], s['full_accuracy_ci'], s['full_n'])} | {far} | 1.0x |")
        for p in sorted(s["points"], key=lambda p: (scoring_label(p), p["top_k"])):
            label = scoring_label(p).lstrip("/") or "default scoring"
            far = _accuracy_text(p.get("accuracy_outside_window"), p.get("accuracy_outside_window_ci"),
                                 p.get("n_outside", 0))
            lines.append(f"| {s['length']:,} | {s['task']} | top-{p['top_k']}, {label} | "
                         f"{_accuracy_text(p['accuracy'], p['accuracy_ci'], p['n'])} | {far} | {p['reduction']:.1f}x |")
    return "\n".join(lines)


def _interval_text(ci: list[float]) -> str:
    return f"[{ci[0] * 100:.0f}–{ci[1] * 100:.0f}]"


def _accuracy_text(accuracy: float | None, ci: list[float] | None, n: int) -> str:
    """e.g. "62% [45–77] (n=24)"; "–" for no rows."""
    return "–" if accuracy is None else f"{accuracy:.0%} {_interval_text(ci)} (n={n})"


def _point_text(point: dict, full_n: int) -> str:
    """A sweep point, e.g. "4/b64: 62% [45–77] x17.2"; its n only where it differs from full's."""
    n = "" if point["n"] == full_n else f" n={point['n']}"
    acc = f"{point['accuracy']:.0%} {_interval_text(point['accuracy_ci'])}"
    return f"{_budget(point)}: {acc}{n} x{point['reduction']:.1f}"


def _budget(point: dict) -> str:
    return f"{point['top_k']}{scoring_label(point)}"


def write_json(summary: dict, path: Path) -> None:
    write_text_atomic(path, json.dumps(summary, indent=2))


def plot(rows: list[dict], summary: dict, folder: Path) -> list[Path]:
    """Accuracy heatmaps (depth x length) per mode, and accuracy vs reduction over the sweep."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'kvlocal[plots]'") from None
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    k0 = summary["main_top_k"]
    s0 = (summary.get("main_centroid_block", DEFAULT_CENTROID_BLOCK), summary.get("main_shortlist", 0),
          summary.get("main_keep", 0.0), summary.get("main_question", "steps"),
          summary.get("main_centroid_type", "f16"), summary.get("main_pin", 0), summary.get("main_layer_top_k", ""),
          summary.get("main_shortlist_floor", 0))
    for task in sorted({r["task"] for r in rows if r["depth"] >= 0}):
        task_rows = [r for r in rows if r["task"] == task and (r["mode"] == "full" or (r["top_k"] == k0
                     and r.get("layer_top_k", "") == s0[6]))
                     and (r["mode"] != "geometric" or scoring(r) == s0)]
        lengths = sorted({r["length"] for r in task_rows})
        depths = sorted({r["depth"] for r in task_rows})
        modes = [m for m in MODES if any(r["mode"] == m for r in task_rows)]
        fig, axes = plt.subplots(1, len(modes), figsize=(3.2 * len(modes), 3.4), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            grid = [[_cell(task_rows, mode, length, d) for length in lengths] for d in depths]
            im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
            ax.set_title(mode)
            ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
            ax.set_xlabel("context length")
        axes[0][0].set_ylabel("needle depth")
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
        fig.suptitle(f"{task}: accuracy by depth and length (top-{k0})")
        path = folder / f"heatmap_{task}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    if any(s["points"] for s in summary["sweep"]):
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for s in summary["sweep"]:
            for lab in sorted({scoring_label(p) for p in s["points"]}):
                pts = sorted((p for p in s["points"] if scoring_label(p) == lab), key=lambda p: p["reduction"])
                tag = f", {lab.lstrip('/')}" if lab else ""
                ax.plot([p["reduction"] for p in pts], [p["accuracy"] for p in pts], marker="o",
                        label=f"{s['task']} {s['length'] // 1024}k{tag} (full {s['full_accuracy']:.0%})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV bytes read: reduction vs dense (centroids included)")
        ax.set_ylabel("accuracy (geometric)")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        path = folder / "sweep.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def _cell(rows, mode, length, depth) -> float:
    scores = [r["score"] for r in rows if r["mode"] == mode and r["length"] == length and r["depth"] == depth]
    return mean(scores) if scores else float("nan")


def _outside_window(row: dict) -> bool:
    """The needle lies before the always-read window (and the sinks), so only routing can find it."""
    if row["depth"] < 0:
        return False
    pos = row["depth"] * row["n_tokens"]
    return row["sinks"] < pos < row["n_tokens"] - row["window"] - 256


def _mode_rank(mode: str) -> int:
    return MODES.index(mode) if mode in MODES else len(MODES)


def _first(values):
    return next((v for v in values if v is not None), None)


def check_ordering(summary: dict, tolerance: float = 0.0) -> list[str]:
    """What `kvlocal eval quick` asserts: geometric matches full; the controls fall below it
    on needles outside the window."""
    problems = []
    by = {(c["length"], c["task"], c["mode"]): c for c in summary["cells"]}
    for (length, task, mode), cell in by.items():
        if mode != "geometric":
            continue
        full = by.get((length, task, "full"))
        if full and cell["accuracy"] < full["accuracy"] - tolerance:
            problems.append(f"{length} {task}: geometric {cell['accuracy']:.0%} < full {full['accuracy']:.0%}")
        for control in ("window", "random"):
            c = by.get((length, task, control))
            if not c or c["accuracy_outside_window"] is None or cell["accuracy_outside_window"] is None:
                continue
            if c["accuracy_outside_window"] >= cell["accuracy_outside_window"]:
                problems.append(
                    f"{length} {task}: {control} {c['accuracy_outside_window']:.0%} is not below geometric "
                    f"{cell['accuracy_outside_window']:.0%} outside the window"
                )
    return problems


# ---- per route: the figures BENCHMARKS.md tabulates (`--routes`) ----------------------------------


def route_label(row: dict) -> str:
    """The route a row ran, in words, from the row's own fields: 'full', 'window top-4', or for
    geometric every scoring setting (an automatic shortlist by the value it took, so a run given the
    same number explicitly joins it), e.g. 'geometric top-4, b8 s64 keep 0.9 pin 2'; then what else
    differs from the default: the sinks and window always read, the question pass when it is not
    dense, Q8_0 centroids, the retired estimate, a routed prefill (e.g. 'prefill top-64',
    'prefill top-16/u128')."""
    mode = row["mode"]
    label = mode if mode == "full" else f"{mode} top-{row['top_k']}"
    if mode != "full" and row.get("layer_top_k"):
        label += f" (layers {row['layer_top_k']})"
    if mode == "geometric":
        shortlist = row.get("shortlist", 0)
        if shortlist == SHORTLIST_AUTO:
            shortlist = row.get("shortlist_used", shortlist)
        label += f", b{block(row)} " + (f"s{shortlist}" if shortlist else "no shortlist")
        label += f" keep {row.get('keep', 0.0):g}"
        if row.get("pin"):
            label += f" pin {row['pin']}"
        if row.get("follow"):
            label += f" follow {row['follow']}"
        if row.get("hints"):
            label += f" hints {row['hints']}" + (" (region rule)" if hint_rule(row) == "region" else "")
        if row.get("centroid_type", "f16") != "f16":
            label += f" {row['centroid_type']}"
    if mode != "full" and row.get("estimate"):
        label += " estimate"
    if mode != "full":  # the always-read parts, where they are not the defaults (a route of its own)
        if row.get("sinks", DEFAULT_SINKS) != DEFAULT_SINKS:
            label += f" sinks {row['sinks']}"
        if row.get("window", DEFAULT_WINDOW) != DEFAULT_WINDOW:
            label += f" window {row['window']}"
    if question_pass(row) != "dense":
        label += f", question {question_pass(row)}"
    prefill = row.get("prefill") or "dense"
    if prefill != "dense":
        parts = prefill.split(":")
        top = next((p[3:] for p in parts if p.startswith("top")), "?")
        ubatch = next((p[len("routed-ubatch"):] for p in parts if p.startswith("routed-ubatch")), None)
        label += f", prefill top-{top}" + (f"/u{ubatch}" if ubatch else "") + (" estimate" if "estimate" in parts else "")
    return label


def answer_reduction(row: dict) -> float:
    """Dense K/V bytes over the bytes read by the answer's steps alone (metadata included): the
    question's read is taken out of both sides. Rows that do not record it (written before the
    question pass was counted apart) take one dense read, bytes_dense / steps, as the question's; a
    question read token by token through the route is read as the answer is, so there the answer's
    steps read what the whole row reads."""
    if question_pass(row) == "steps":
        return row["bytes_dense"] / row["bytes_read"] if row["bytes_read"] else 1.0
    if "question_bytes_read" in row:
        q_read, q_dense = row["question_bytes_read"], row["question_bytes_dense"]
    else:
        q_read = q_dense = row["bytes_dense"] / row["steps"]
    read = row["bytes_read"] - q_read
    return (row["bytes_dense"] - q_dense) / read if read > 0 else 1.0


def answer_step_mib(row: dict) -> tuple[float, float] | None:
    """MiB one answer step reads: (K/V rows, metadata: centroids and the memory). Only for a dense
    question pass recorded apart and an answer of more than one step; what that pass reads beyond one
    dense read (the pins' second read of K, counted as metadata) is the question's, not the steps'."""
    if question_pass(row) != "dense" or "question_bytes_read" not in row or row["steps"] <= 1:
        return None
    q_read, q_dense = row["question_bytes_read"], row["question_bytes_dense"]
    meta = row["bytes_meta"] - max(0, q_read - q_dense)
    kv = row["bytes_read"] - q_read - meta
    steps = row["steps"] - 1
    return kv / steps / 2**20, meta / steps / 2**20


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _code_in(code: str, answer: str) -> bool:
    return code.strip().lower() in answer.lower()


def task_label(row: dict) -> str:
    """The row's task, with the document its needles were planted in when it is not generated prose,
    e.g. 'onekey (GPL-3)': the same task on two fillers is two haystacks, reported apart."""
    return f"{row['task']} ({Path(row['haystack']).name})" if row.get("haystack") else row["task"]


def routes(rows: list[dict]) -> list[dict]:
    """One entry per (length, task on its filler: `task_label`, route): each probe counted once per route (a
    later row of the same haystack, depth and probe replaces an earlier one, so a rerun does not double n).
    Accuracy on the facts outside the sinks and window with its n and 95 % Wilson interval; the share of
    those whose answer equals full attention's (dense prefill, same question pass) on the same probe; the
    reduction of the answer's steps and the total with the question's read, both means over every row of the
    route; MiB per answer step; the median decode rate (short answers: not a benchmark); the median prefill
    rate of the haystacks prefilled in these rows; and what the wrong answers outside the window are:
    another fact's code of the same haystack, or something else (a near-copy, a cut answer)."""
    probes: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
    codes: dict[tuple, set[str]] = defaultdict(set)  # haystack -> every fact's code
    full_answer: dict[tuple, str] = {}
    models = {r.get("model") for r in rows}
    for r in rows:
        haystack = (r.get("model"), r["length"], task_label(r), r.get("seed", 0))
        codes[haystack].update(r.get("expected", []))
        # several models' rows: each route is named with its model
        label = f"{r.get('model')}: {route_label(r)}" if len(models) > 1 else route_label(r)
        probes[(r["length"], task_label(r), label)][(r.get("seed", 0), r["depth"], r.get("probe", 0))] = r
        if r["mode"] == "full" and (r.get("prefill") or "dense") == "dense":
            full_answer[(*haystack, r["depth"], r.get("probe", 0), question_pass(r))] = r["answer"].strip()
    out = []
    for (length, task, label), by_probe in probes.items():
        group = list(by_probe.values())
        far = [r for r in group if _outside_window(r)]
        acc = _accuracy(far)
        paired = [r["answer"].strip() == full_answer[key] for r in far
                  if (key := (r.get("model"), r["length"], task, r.get("seed", 0), r["depth"], r.get("probe", 0),
                              question_pass(r))) in full_answer]
        wrong = [r for r in far if r["score"] < 1]
        other_fact = sum(any(_code_in(c, r["answer"]) for c in codes[(r.get("model"), r["length"], task,
                                                                       r.get("seed", 0))]
                             if c not in r.get("expected", [])) for r in wrong)
        mib = [m for r in group if (m := answer_step_mib(r)) is not None]
        prefilled = {}
        for r in group:
            if r.get("prefill_tps"):
                prefilled.setdefault(r.get("seed", 0), r["prefill_tps"])
        out.append({
            "length": length, "task": task, "route": label, "mode": group[0]["mode"],
            "n_outside": acc["n"], "accuracy_outside_window": acc["accuracy"],
            "accuracy_outside_window_ci": acc["accuracy_ci"],
            "same_as_full": mean(paired) if paired else None, "n_paired": len(paired),
            "answer_reduction": mean(answer_reduction(r) for r in group),
            "total_reduction": mean(r["bytes_dense"] / r["bytes_read"] for r in group if r["bytes_read"]),
            "step_mib": (mean(m[0] for m in mib), mean(m[1] for m in mib)) if mib else None,
            "decode_tps": _median([r["decode_tps"] for r in group if r.get("decode_tps")]),
            "prefill_tps": _median(list(prefilled.values())), "n_prefilled": len(prefilled),
            "wrong_other_fact": other_fact, "wrong_else": len(wrong) - other_fact,
        })
    out.sort(key=lambda e: (e["length"], e["task"], e["route"].rpartition(": ")[0], _mode_rank(e["mode"]), e["route"]))
    return out


SELECTIONS = ("default", "uniform")


def row_model_route(row: dict) -> ModelRoute:
    """The calibrated route of the model a row ran (by its alias; the uniform route for another model)."""
    from kvlocal.models import ALIASES

    spec = ALIASES.get(row.get("model") or "")
    return model_route(spec.sha256 if spec else None)


def on_route(row: dict, route: ModelRoute) -> bool:
    """Whether a row ran `route` as `kvlocal ask` runs it with no routing option, or is full attention or a
    control at its budget: every scoring setting at its default, the automatic shortlist at the value it
    takes for the row's document (a run given that number explicitly counts), the question read densely,
    the document prefilled densely, no hints, the default sinks and window, not the retired estimate."""
    if question_pass(row) != DEFAULT_QUESTION or (row.get("prefill") or "dense") != "dense":
        return False
    if row["mode"] == "full":
        return True  # whatever route options a full row was written with: it reads every cell
    if row.get("hints") or row.get("estimate"):
        return False
    if (row["top_k"], row.get("layer_top_k", "")) != (route.top_k, route.layer_top_k) or \
            (row.get("sinks"), row.get("window")) != (DEFAULT_SINKS, DEFAULT_WINDOW):
        return False
    if row["mode"] != "geometric":
        return True  # the controls read no centroids: their type and scoring do not matter
    shortlist = row.get("shortlist", 0)
    used = row.get("shortlist_used", shortlist) if shortlist == SHORTLIST_AUTO else shortlist
    n_regions = -(-row["n_tokens"] // row.get("region", DEFAULT_REGION))
    return (used == max(route.shortlist_floor, auto_shortlist(n_regions)) and block(row) == DEFAULT_CENTROID_BLOCK
            and row.get("keep", 0.0) == DEFAULT_KEEP and row.get("pin", 0) == DEFAULT_PIN
            and row.get("centroid_type", "f16") == route.centroid_type)


def select(rows: list[dict], which: str) -> list[dict]:
    """The rows of full attention, of one route and of the controls at its budget: `default`, the route
    each row's model takes by default (route_settings.MODEL_ROUTES); `uniform`, the route of a model
    without a calibrated one, whatever the model."""
    if which not in SELECTIONS:
        raise ValueError(f"unknown selection {which!r}; choose {' or '.join(SELECTIONS)}")
    return [r for r in rows if on_route(r, row_model_route(r) if which == "default" else UNCALIBRATED_ROUTE)]


def routes_markdown(entries: list[dict]) -> str:
    lines = ["| length | task | route | acc. outside window [95 % CI] (n) | same answer as full (n) "
             "| reduction: answer steps | reduction: question included | MiB per answer step: K/V + metadata "
             "| decode tok/s (median) | prefill tok/s (median, haystacks) | wrong: another fact's code / other |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in entries:
        acc = _accuracy_text(e["accuracy_outside_window"], e["accuracy_outside_window_ci"], e["n_outside"])
        same = "–" if e["same_as_full"] is None or e["route"].endswith("full") else f"{e['same_as_full']:.0%} ({e['n_paired']})"
        mib = "–" if e["step_mib"] is None else f"{e['step_mib'][0]:.1f} + {e['step_mib'][1]:.1f}"
        decode = "–" if e["decode_tps"] is None else f"{e['decode_tps']:.1f}"
        prefill = "–" if e["prefill_tps"] is None else f"{e['prefill_tps']:.1f} ({e['n_prefilled']})"
        lines.append(f"| {e['length']:,} | {e['task']} | {e['route']} | {acc} | {same} | {e['answer_reduction']:.1f}x "
                     f"| {e['total_reduction']:.1f}x | {mib} | {decode} | {prefill} "
                     f"| {e['wrong_other_fact']} / {e['wrong_else']} |")
    return "\n".join(lines)


def bench_markdown(runs: list[tuple[str, dict]]) -> str:
    """The decode and prefill tables of `kvlocal bench --out FILE.json` runs, one row per run and length."""
    lines = ["| run | model | context tokens | full tok/s | geometric tok/s | speed-up | KV bytes read, reduction "
             "| time to first token (4k): fresh / cached | peak RSS |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, run in runs:
        ttft = (f"{run['ttft_fresh_s']:.1f} s / {run['ttft_cached_s']:.1f} s"
                if run.get("ttft_fresh_s") is not None else "–")
        rss = f"{run['peak_rss_bytes'] / 2**30:.1f} GiB" if run.get("peak_rss_bytes") else "–"
        for d in run.get("lengths", []):
            lines.append(f"| {name} | {run['model']} | {d['n_tokens']:,} | {d['full_tps']:.2f} | {d['geometric_tps']:.2f} "
                         f"| {d['speedup']:.2f}x | {d['bytes_reduction']:.1f}x | {ttft} | {rss} |")
    prefill = [(name, run, d) for name, run in runs for d in run.get("prefill_lengths", [])]
    if prefill:
        # a dense prefill's rate falls with the depth its attention reaches: each length's rate against the
        # run's shortest length's (the same run, so the same machine state)
        lines += ["", "| run | routed prefill | document tokens | dense s | dense tok/s (x the run's shortest) "
                      "| routed s | speed-up | attention bytes read, reduction |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for name, run, d in prefill:
            shortest = min(run["prefill_lengths"], key=lambda e: e["n_tokens"])
            rate = d["n_tokens"] / d["dense_s"]
            relative = rate / (shortest["n_tokens"] / shortest["dense_s"])
            lines.append(f"| {name} | {run.get('prefill', '')} | {d['n_tokens']:,} | {d['dense_s']:.1f} "
                         f"| {rate:,.1f} ({relative:.2f}x) | {_routed_cells(d)} |")
    return "\n".join(lines)




# `kvlocal bench`'s extra decode runs: the other attention path, the controls (kvlocal.evals.bench)
ATTENTION_LABELS = {"gather": "geometric, gathered", "in-place": "geometric, in place"}


def rpc_heads(rows: list[dict]) -> list[str]:
    """The columns a bench report's rows have when its layers were on RPC servers: what crossed the wire
    per answer step, and the same answers' rates with every layer here (none without servers)."""
    heads = ["RPC wire bytes per step (sent + received), full / geometric"] if rows and "full_wire_per_step" in rows[0] else []
    if rows and "here_full_tps" in rows[0]:
        heads += ["every layer here: full / geometric tok/s", "over RPC, x here: full / geometric"]
    return heads


def rpc_cells(row: dict) -> list[str]:
    """A bench row's cells under rpc_heads: each route's wire bytes per step (sent + received where the
    row has the split), the rates here and the RPC run's rates as a share of them."""
    cells = []
    if "full_wire_per_step" in row:
        def wire(route: str) -> str:
            total, sent = row[f"{route}_wire_per_step"], row.get(f"{route}_wire_sent_per_step")
            return human_bytes(total) if sent is None else f"{human_bytes(total)} ({human_bytes(sent)} + {human_bytes(total - sent)})"
        cells.append(f"{wire('full')} / {wire('geometric')}")
    if "here_full_tps" in row:
        full = row["full_tps"] / row["here_full_tps"] if row["here_full_tps"] else 0.0
        geo = row["geometric_tps"] / row["here_geometric_tps"] if row["here_geometric_tps"] else 0.0
        cells += [f"{row['here_full_tps']:.2f} / {row['here_geometric_tps']:.2f}", f"{full:.2f}x / {geo:.2f}x"]
    return cells


def decode_table(report: dict) -> str:
    """The bench report's decode rows as a Markdown table (the columns its rows have)."""
    rows = report["lengths"]
    controls = [m for m in (*ATTENTION_LABELS, "window", "random") if rows and f"{m}_tps" in rows[0]]
    plain = bool(rows) and "plain_loop_tps" in rows[0]
    head = ["context", "KV bytes", "full tok/s", "geometric tok/s", "speedup (ceiling)", "KV bytes read, reduction"]
    head += [f"{ATTENTION_LABELS.get(m, m)} tok/s (x full)" for m in controls] + (["llama.cpp loop tok/s (full / it)"] if plain else [])
    head += rpc_heads(rows)
    lines = [f"model {report['model']} ({report.get('weights', '?')}), {report.get('backend', 'CPU')} "
             f"{report.get('device', '')}".rstrip() + f", {report['threads']} threads, route {report['route']}",
             *([report["placement"]] if report.get("placement") else []),
             "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        cells = [f"{r['n_tokens']:,}", human_bytes(r["kv_bytes"]), f"{r['full_tps']:.2f}", f"{r['geometric_tps']:.2f}",
                 f"{r['speedup']:.2f}x ({r.get('ceiling', 0):.2f}x)", f"{r['bytes_reduction']:.1f}x"]
        cells += [f"{r[f'{m}_tps']:.2f} ({r[f'{m}_speedup']:.2f}x)" for m in controls]
        if plain:
            cells.append(f"{r['plain_loop_tps']:.2f} ({r['full_vs_plain_loop']:.2f}x)")
        cells += rpc_cells(r)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _routed_cells(prefill: dict) -> str:
    """A prefill row's routed seconds, speed-up and byte reduction, or dashes where the bench prefilled dense only."""
    if not prefill.get("routed_s"):
        return "– | – | –"
    return f"{prefill['routed_s']:.1f} | {prefill['speedup']:.2f}x | {prefill['bytes_reduction']:.1f}x"


def bench_text(report: dict) -> str:
    """What `kvlocal bench` prints of its report: the decode table, then the prefill, time to first
    token, memory and centroid upkeep lines of what it measured."""
    lines = [decode_table(report)]
    if report.get("prefill_lengths"):
        dense_only = not any(p.get("routed_s") for p in report["prefill_lengths"])
        compared = "dense only" if dense_only else f"dense vs {report['prefill']}"
        lines += ["", f"prefill, {compared}:",
                  "| context | dense s | routed s | speedup | attention bytes read, reduction |", "|---:|---:|---:|---:|---:|"]
        lines += [f"| {p['n_tokens']:,} | {p['dense_s']:.1f} | {_routed_cells(p)} |" for p in report["prefill_lengths"]]
    if report.get("ttft_fresh_s") is not None:
        fresh, cached = report["ttft_fresh_s"], report["ttft_cached_s"]
        lines.append(f"time to first token (4k document): fresh {fresh:.1f} s, cached {cached:.2f} s ({fresh / cached:.0f}x)")
    lines.append(f"peak RSS: {human_bytes(report['peak_rss_bytes'])}")
    if "centroid_upkeep" in report:
        u = report["centroid_upkeep"]
        lines.append(f"centroid upkeep: prefill {u['with_s']:.1f} s with vs {u['without_s']:.1f} s without "
                     f"= {u['share']:.1%} of prefill")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """`python -m kvlocal.evals.report results.jsonl ...`: one table over the rows of several runs;
    `--routes` first: one row per route (answer-step and total reductions side by side, paired with
    full, what the wrong answers are), `--routes --select default|uniform`: only full attention, that
    route and its controls (`select`); `--bench` first: the tables of `kvlocal bench --out` files;
    `--decode` first: each bench file's decode table as `kvlocal bench` prints it (every mode it timed);
    `--serve` first: each `kvlocal bench serve --out` file's tables as it printed them."""
    import sys

    from kvlocal.evals.runner import load_rows

    args = list(argv if argv is not None else sys.argv[1:])
    kind = args.pop(0) if args and args[0] in ("--routes", "--bench", "--decode", "--serve") else None
    which = None
    if kind == "--routes" and args[:1] == ["--select"]:
        which = args[1] if len(args) > 1 else ""
        args = args[2:]
        if which not in SELECTIONS:
            raise SystemExit(f"--select: choose {' or '.join(SELECTIONS)}")
    paths = [Path(a) for a in args]
    if not paths:
        raise SystemExit("usage: python -m kvlocal.evals.report [--routes [--select default|uniform]] RESULTS.jsonl [...]\n"
                         "       python -m kvlocal.evals.report --bench BENCH.json [...]")
    if kind == "--bench":
        print(bench_markdown([(p.stem, json.loads(p.read_text())) for p in paths]))
        return
    if kind == "--serve":
        from kvlocal.evals.serve_bench import serve_text

        print(serve_text([json.loads(p.read_text()) for p in paths]))
        return
    if kind == "--decode":
        print("\n\n".join(decode_table(json.loads(p.read_text())) for p in paths))
        return
    rows = [r for p in paths for r in load_rows(p)]
    if kind == "--routes":
        print(routes_markdown(routes(select(rows, which) if which else rows)))
        return
    summary = summarize(rows)
    print(markdown(summary))
    print()
    print(points_markdown(summary))


if __name__ == "__main__":
    main()


# ---- RULER (`kvlocal eval ruler`) ----------------------------------------------------------


def ruler_markdown(rows: list[dict]) -> str:
    """Per length: RULER's score per task and route (mean of its per-sample metric, n and 95 % Wilson
    interval), the average over tasks, and the KV bytes each route's answer steps read (dense over read,
    mean over rows). A sample asked twice of a route counts once (the later row)."""
    latest = {(r["length"], r["task"], r["probe"], route_label(r)): r for r in rows}
    lines = []
    for length, group in sorted(_group(list(latest.values()), "length").items()):
        labels = sorted({route_label(r) for r in group}, key=lambda lab: _mode_rank(lab.split()[0]))
        by = _group(group, "task")
        lines += [f"RULER at {length[0]:,} tokens (score: RULER's metric, n and 95 % interval)", "",
                  "| task | " + " | ".join(labels) + " |",
                  "|---|" + "---:|" * len(labels)]
        for (task,) in sorted(by):
            cells = [_ruler_cell([r for r in by[(task,)] if route_label(r) == lab]) for lab in labels]
            lines.append(f"| {task} | " + " | ".join(cells) + " |")
        per_route = [[r for r in group if route_label(r) == lab] for lab in labels]
        lines.append("| **average** | " + " | ".join(_ruler_average(rs) for rs in per_route) + " |")
        lines.append("| KV bytes per answer step | " + " | ".join(
            f"{mean(answer_reduction(r) for r in rs):.1f}x fewer" if rs else "–" for rs in per_route) + " |")
        lines.append("")
    return "\n".join(lines)


def _ruler_cell(rows: list[dict]) -> str:
    cell = _accuracy(rows)
    return _accuracy_text(cell["accuracy"], cell["accuracy_ci"], cell["n"])


def _ruler_average(rows: list[dict]) -> str:
    """The mean over tasks of each task's mean score; its interval is the pooled rows' (the same mean
    where every task has the same n)."""
    if not rows:
        return "–"
    tasks = _group(rows, "task")
    score = mean(mean(r["score"] for r in rs) for rs in tasks.values())
    return _accuracy_text(score, wilson_interval(score, len(rows)), len(rows))
