"""RULER's own prediction client against `kvlocal serve`: the files on either side of it.

    ruler_files.py data LENGTH SAMPLES DATA_DIR   RULER's samples, as `kvlocal eval ruler` asks them
                                                   (same generators, sizes and indices), written in RULER's
                                                   layout: DATA_DIR/<task>/validation.jsonl
    ruler_files.py score PRED_DIR [ROWS]           RULER's metric over call_api.py's predictions
                                                   (PRED_DIR/<task>.jsonl), per task and average, n and a
                                                   95 % interval; with ROWS (a `kvlocal eval ruler`
                                                   results.jsonl) the same samples' scores there beside

Run with the project's environment (.venv/bin/python); the steps around it: ruler-client.md.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from kvlocal.cli_options import lengths
from kvlocal.evals import ruler
from kvlocal.evals.intervals import wilson_interval
from kvlocal.evals.ruler_runner import ruler_budget
from kvlocal.route_settings import DEFAULT_HINTS, DEFAULT_KEEP, DEFAULT_PIN
from kvlocal.session import Session

DEFAULTS = (DEFAULT_KEEP, DEFAULT_PIN, DEFAULT_HINTS)  # the route kvlocal serve answered with


def write_data(length: int, samples: int, data_dir: Path) -> None:
    session = Session(None, threads=1)
    try:
        count = lambda text: len(session.tokenize(text, bos=False))  # noqa: E731
        configs = ruler.task_configs()
        for task in ruler.TASK_NAMES:
            budget = ruler_budget(session, length, configs[task]["tokens_to_generate"])
            rows = ruler.generate(task, length, samples, count, budget=budget)
            folder = data_dir / task
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / "validation.jsonl", "w", encoding="utf-8") as out:
                for sample in rows:
                    out.write(json.dumps({"index": sample.index, "input": sample.text,
                                          "outputs": list(sample.outputs), "length": count(sample.text)}) + "\n")
            print(f"{task}: {len(rows)} samples", file=sys.stderr)
    finally:
        session.close()


def score(pred_dir: Path, rows_file: Path | None) -> None:
    theirs: dict[tuple[str, int], float] = {}
    if rows_file:
        for line in rows_file.read_text().splitlines():
            row = json.loads(line)
            if row["mode"] == "geometric" and (row["keep"], row["pin"], row["hints"]) == DEFAULTS:
                theirs[(row["task"], row["probe"])] = row["score"]
    per_task: dict[str, list[float]] = defaultdict(list)
    beside: dict[str, list[float]] = defaultdict(list)
    for task in ruler.TASK_NAMES:
        path = pred_dir / f"{task}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            pred = json.loads(line)
            per_task[task].append(ruler.score(task, pred["pred"], pred["outputs"]))
            if (task, pred["index"]) in theirs:
                beside[task].append(theirs[(task, pred["index"])])
    print("| task | n | RULER's client → kvlocal serve | kvlocal eval ruler, same samples |")
    print("|---|---:|---:|---:|")
    for task, scores in per_task.items():
        other = f"{100 * ruler.average(beside[task]):.0f} %" if len(beside[task]) == len(scores) else "–"
        print(f"| {task} | {len(scores)} | {100 * ruler.average(scores):.0f} % | {other} |")
    flat = [s for scores in per_task.values() for s in scores]
    mean = ruler.average([ruler.average(s) for s in per_task.values()])
    low, high = wilson_interval(mean, len(flat))
    line = f"| average | {len(flat)} | {100 * mean:.0f} % [{100 * low:.0f}–{100 * high:.0f}] |"
    both = [s for t in per_task for s in beside[t]]
    if len(both) == len(flat):
        other = ruler.average([ruler.average(beside[t]) for t in per_task])
        blow, bhigh = wilson_interval(other, len(both))
        line += f" {100 * other:.0f} % [{100 * blow:.0f}–{100 * bhigh:.0f}] |"
    else:
        line += " – |"
    print(line)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "data":
        write_data(lengths(sys.argv[2])[0], int(sys.argv[3]), Path(sys.argv[4]))
    elif len(sys.argv) in (3, 4) and sys.argv[1] == "score":
        score(Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) == 4 else None)
    else:
        sys.exit(__doc__)
