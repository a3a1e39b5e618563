"""Eval case generation (kvlocal.evals.tasks / haystack): sizing, planting, determinism, scoring.

A cheap fake tokenizer stands in for the model's; no model is loaded."""

from __future__ import annotations

import re
from collections import Counter
from types import SimpleNamespace

import pytest

from kvlocal.evals import TASKS, Probe, build_case, score
from kvlocal.evals.haystack import build_haystack

DEPTHS = [round(i / 10, 1) for i in range(11)]
NEEDLE_TASKS = [t for t in TASKS if t != "cwe"]
MAGIC = re.compile(r"(?:The|One of the) special magic numbers? for (.+?) is (\d+)\.")
VAR = re.compile(r"VAR ([A-Z]{5}) = (?:VAR ([A-Z]{5})|(\d+))\.")
LOOKALIKE = re.compile(r"([A-Z][a-z]+ [A-Z][a-z]+) from ([A-Z][a-z]+) was issued the access code ([a-z]+-\d{4})\.")


def words(text: str) -> int:
    return len(re.findall(r"\w+|[^\w\s]", text))


def quarter(text: str) -> int:
    return len(text) // 4


def whole(value: str, text: str) -> int:
    return len(re.findall(rf"(?<![0-9A-Za-z]){re.escape(value)}(?![0-9A-Za-z])", text))


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_in_seed(task: str) -> None:
    a = build_case(task, 2048, DEPTHS, seed=7, count_tokens=words)
    assert a == build_case(task, 2048, DEPTHS, seed=7, count_tokens=words)
    b = build_case(task, 2048, DEPTHS, seed=8, count_tokens=words)
    assert a.text != b.text and a.probes != b.probes
    assert a.seed == 7 and a.task == task and all(p.task == task for p in a.probes)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("n", [2048, 8192])
@pytest.mark.parametrize("tokenizer", [words, quarter])
def test_size_within_bounds_with_few_tokenizer_calls(task: str, n: int, tokenizer) -> None:
    calls = []
    count = lambda s: calls.append(len(s)) or tokenizer(s)  # noqa: E731
    case = build_case(task, n, DEPTHS, seed=1, count_tokens=count)
    assert 0.95 * n <= tokenizer(case.text) <= 1.03 * n
    assert case.n_tokens == tokenizer(case.text)
    assert len(calls) <= 5


@pytest.mark.parametrize("task", NEEDLE_TASKS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_answers_planted_at_their_depth(task: str, seed: int) -> None:
    case = build_case(task, 2048, DEPTHS, seed=seed, count_tokens=words)
    for probe in case.probes:
        assert probe.question.endswith(".") and "Answer with" in probe.question
        for answer in probe.answers:
            assert whole(answer, case.text) >= 1
            if task != "vartrack":  # numbers: planted once, never in the filler
                assert whole(answer, case.text) == 1
        first = re.search(rf"(?<![0-9A-Z]){re.escape(probe.answers[0])}(?![0-9A-Z])", case.text).start()
        assert abs(first / len(case.text) - probe.depth) <= 0.05, (probe, first / len(case.text))


def test_probe_counts_and_groups() -> None:
    count = {t: len(build_case(t, 2048, DEPTHS, seed=0, count_tokens=words).probes) for t in TASKS}
    assert count == {"passkey": 11, "multikey": 11, "lookalike": 11, "onekey": 11, "multivalue": 3, "multiquery": 11,
                     "vartrack": 3, "cwe": 1, "manifest": 11, "tray": 11}
    mv = build_case("multivalue", 2048, DEPTHS, seed=0, count_tokens=words)
    assert sorted(len(p.answers) for p in mv.probes) == [3, 4, 4]
    assert [p.depth for p in mv.probes] == [0.0, 0.1, 0.2]  # groups interleave, so each spans the text
    one = build_case("multivalue", 2048, [0.2, 0.4, 0.6, 0.8], seed=0, count_tokens=words)
    assert len(one.probes) == 1 and len(one.probes[0].answers) == 4
    mq = build_case("multiquery", 2048, [0.5], seed=0, count_tokens=words)  # a lone depth gets a partner
    assert len(mq.probes) == 1 and len(set(mq.probes[0].answers)) == 2


def test_passkey_facts_are_distinct() -> None:
    case = build_case("passkey", 2048, DEPTHS, seed=3, count_tokens=words)
    assert len(case.probes) == 11
    questions = [p.question for p in case.probes]
    values = [p.answers[0] for p in case.probes]
    assert len(set(questions)) == 11 and len(set(values)) == 11
    for probe in case.probes:
        assert case.text.count(probe.answers[0]) == 1


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_multikey_distractors_look_alike_but_differ(seed: int) -> None:
    case = build_case("multikey", 4096, DEPTHS, seed=seed, count_tokens=words)
    planted = dict(MAGIC.findall(case.text))
    assert len(planted) == len(MAGIC.findall(case.text))  # every key once
    asked = {re.search(r"for (.+?) mentioned", p.question).group(1): p.answers[0] for p in case.probes}
    assert all(planted[k] == v for k, v in asked.items())
    distractors = {k: v for k, v in planted.items() if k not in asked}
    assert 2 * len(asked) - 2 <= len(distractors) <= 3 * len(asked)
    answers = set(asked.values())
    assert not answers & set(distractors.values())
    for key in distractors:  # differs from some asked key in one part only (colour, box or digit order)
        parts = key.split()
        assert any(sum(a != b for a, b in zip(parts, k.split())) == 1 for k in asked), key


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_lookalike_facts_share_one_shape_and_code_prefixes(seed: int) -> None:
    depths = [0.9, 0.1, 0.5, 0.3, 0.7, 0.0, 1.0, 0.2, 0.8, 0.4, 0.6]  # not in order: planting sorts by depth
    case = build_case("lookalike", 4096, depths, seed=seed, count_tokens=words)
    facts = [(m.start(), m.groups()) for m in LOOKALIKE.finditer(case.text)]
    assert len(facts) == len(depths)
    asked = [(re.fullmatch(r"What access code was (.+) from (.+) issued\? Answer with the code only\.", p.question)
              .groups(), p.answers[0], p.depth) for p in case.probes]
    assert [d for _, _, d in asked] == depths
    in_depth_order = sorted(asked, key=lambda a: a[2])
    assert [(person, place, code) for _, (person, place, code) in sorted(facts)] == [
        (*who, code) for who, code, _ in in_depth_order]
    codes = [code for _, code, _ in asked]
    assert len({who[0] for who, _, _ in asked}) == len({who[1] for who, _, _ in asked}) == len(set(codes)) == 11
    for code in codes:
        assert whole(code, case.text) == 1 and whole(code.split("-")[1], case.text) == 1
    # 11 codes from 4 words and 3 two-digit prefixes: several share a word, and several their first digits
    assert max(Counter(c.split("-")[0] for c in codes).values()) >= 3
    assert max(Counter(c.split("-")[1][:2] for c in codes).values()) >= 4


def test_lookalike_refuses_more_depths_than_places() -> None:
    with pytest.raises(ValueError, match="at most 40 depths"):
        build_case("lookalike", 8192, [i / 40 for i in range(41)], seed=0, count_tokens=words)


CODE = re.compile(r"[a-z]+-\d{4}")


def onekey_facts(case) -> list[str]:
    """The planted fact sentences in text order: the sentences holding a probe's code."""
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(case.text.split()))
    return [s for s in sentences if CODE.search(s) and any(whole(p.answers[0], s) for p in case.probes)]


def differing_words(a: str, b: str) -> list[tuple[str, str]]:
    wa, wb = a.split(), b.split()
    assert len(wa) == len(wb), (a, b)
    return [(x, y) for x, y in zip(wa, wb) if x != y]


@pytest.mark.parametrize("seed", range(8))  # every shape twice
def test_onekey_facts_differ_in_one_key_word(seed: int) -> None:
    depths = [0.9, 0.1, 0.5, 0.3, 0.7, 0.0, 1.0, 0.2, 0.8, 0.4, 0.6]
    case = build_case("onekey", 4096, depths, seed=seed, count_tokens=words)
    assert [p.depth for p in case.probes] == depths and all(p.task == "onekey" for p in case.probes)
    facts = onekey_facts(case)
    assert len(facts) == len(depths)  # every fact planted once, and asked once
    codes = [p.answers[0] for p in case.probes]
    assert len(set(codes)) == len(codes) and all(CODE.fullmatch(c) for c in codes)
    in_text_order = sorted(case.probes, key=lambda p: p.depth)
    for fact, probe in zip(facts, in_text_order):
        code = probe.answers[0]
        assert fact.endswith(f" {code}.") and whole(code, case.text) == 1
        assert whole(code.split("-")[1], case.text) == 1  # the filler never repeats a code's digits
    templates = [f.replace(p.answers[0], "CODE") for f, p in zip(facts, in_text_order)]
    questions = [p.question for p in in_text_order]
    for i in range(1, len(facts)):  # the same sentence and the same question, one key word apart
        [(key_a, key_b)] = differing_words(templates[0], templates[i])
        assert differing_words(questions[0], questions[i]) == [(key_a, key_b)]
        assert whole(key_b, case.text) == 1  # the key is named only by its fact
    # 11 codes from two words and few prefixes: they share their word and their first digits, and
    # some pairs differ only in the last digit ("amber-4452", "amber-4459")
    assert len({c.split("-")[0] for c in codes}) <= 2
    assert max(Counter(c.split("-")[1][:2] for c in codes).values()) >= 3
    assert max(Counter(c.split("-")[1][:3] for c in codes).values()) >= 2


def test_onekey_shape_follows_the_seed() -> None:
    from kvlocal.evals.tasks import ONEKEY_SHAPES

    shapes = []
    for seed in range(len(ONEKEY_SHAPES) + 1):
        case = build_case("onekey", 2048, [0.2, 0.5, 0.8], seed=seed, count_tokens=words)
        shape = ONEKEY_SHAPES[seed % len(ONEKEY_SHAPES)]
        prefix = shape[0].split("{key}")[0]
        assert all(f.startswith(prefix) for f in onekey_facts(case))
        shapes.append(prefix)
    assert len(set(shapes)) == len(ONEKEY_SHAPES) and shapes[0] == shapes[-1]
    keys = [set(s[2]) for s in ONEKEY_SHAPES]  # a place, a person, a host, a year
    assert all(len(k) >= 40 and not k & other for i, k in enumerate(keys) for other in keys[i + 1:])
    assert all(len(key.split()) == 1 for k in keys for key in k)
    with pytest.raises(ValueError, match="at most 40 depths"):
        build_case("onekey", 8192, [i / 40 for i in range(41)], seed=2, count_tokens=words)


TAG = re.compile(r"[A-Z]{2}-\d{5}")


@pytest.mark.parametrize("task", ["manifest", "tray"])
@pytest.mark.parametrize("seed", range(3))
def test_held_apart_families_are_one_sentence_with_one_key_word_changed(task: str, seed: int) -> None:
    from kvlocal.evals.tasks import ONEKEY_SHAPES

    depths = [0.9, 0.1, 0.5, 0.3, 0.7, 0.0, 1.0, 0.2, 0.8, 0.4, 0.6]
    case = build_case(task, 4096, depths, seed=seed, count_tokens=words)
    assert [p.depth for p in case.probes] == depths and all(p.task == task for p in case.probes)
    codes = [p.answers[0] for p in case.probes]
    assert len(set(codes)) == len(codes) and all(TAG.fullmatch(c) for c in codes)
    facts = [s for s in re.split(r"(?<=[.!?])\s+", " ".join(case.text.split())) if TAG.search(s)]
    in_text_order = sorted(case.probes, key=lambda p: p.depth)
    assert [f.split()[-1] for f in facts] == [f"{p.answers[0]}." for p in in_text_order]
    for code in codes:
        assert whole(code, case.text) == 1 and whole(code.split("-")[1], case.text) == 1
    templates = [f.replace(p.answers[0], "CODE") for f, p in zip(facts, in_text_order)]
    for i in range(1, len(facts)):
        [(_, key)] = differing_words(templates[0], templates[i])
        assert whole(key, case.text) == 1
    # two letter pairs, and siblings that share their first four digits ("KT-40917", "KT-40913")
    assert len({c[:2] for c in codes}) <= 2
    assert max(Counter(c[3:7] for c in codes).values()) >= 2
    # apart from the onekey shapes: no key in common
    keys = {differing_words(templates[0], t)[0][1] for t in templates[1:]}
    assert not keys & {k for shape in ONEKEY_SHAPES for k in shape[2]}


def test_onekey_answers_are_checked_exactly() -> None:
    case = build_case("onekey", 2048, [0.3, 0.6], seed=0, count_tokens=words)
    for probe in case.probes:
        code = probe.answers[0]
        word, digits = code.split("-")
        sibling = f"{word}-{digits[:3]}{(int(digits[3]) + 1) % 10}"
        assert score(probe, code) == 1.0 and score(probe, f"The code is {code.upper()}.") == 1.0
        assert score(probe, sibling) == 0.0 and score(probe, f"{word}-{digits[:3]}") == 0.0
        assert score(probe, f"{word}-{digits}0") == 0.0 and score(probe, digits) == 0.0
    other = case.probes[1].answers[0]
    assert score(case.probes[0], other) == 0.0


def test_onekey_planted_into_a_supplied_document() -> None:
    document = FILLER + "\n\nThe Kyoto office and the Oslo office closed in 1931."  # names keys some seeds draw
    for seed in range(4):
        case = build_case("onekey", 2048, DEPTHS, seed=seed, count_tokens=words, filler=document)
        assert case == build_case("onekey", 2048, DEPTHS, seed=seed, count_tokens=words, filler=document)
        facts = onekey_facts(case)
        assert len(facts) == len(DEPTHS)
        body = case.text
        for fact in facts:
            body = body.replace(fact, "")
        assert body.lstrip().startswith("Paragraph 0 of the report") and "zebra39." in body
        sentences = set(re.split(r"(?<=[.!?])\s+", " ".join(document.split())))
        assert all(s in sentences for s in re.split(r"(?<=[.!?])\s+", " ".join(body.split())) if s)
        for probe in case.probes:
            first = case.text.index(probe.answers[0])
            assert abs(first / len(case.text) - probe.depth) <= 0.05
            key = differing_words(case.probes[0].question, probe.question)
            assert all(whole(k.rstrip("?"), case.text) == 1 for _, k in key)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vartrack_chain_resolves_to_value(seed: int) -> None:
    case = build_case("vartrack", 4096, DEPTHS, seed=seed, count_tokens=words)
    assign = {}
    for name, ref, value in VAR.findall(case.text):
        assert name not in assign
        assign[name] = ref or value

    def resolve(name: str) -> str:
        while name in assign:
            name = assign[name]
        return name

    for probe in case.probes:
        value = re.search(r"the value (\d+)", probe.question).group(1)
        names = {n for n in assign if resolve(n) == value}
        assert names == set(probe.answers) and 4 <= len(names) <= 5
        order = [case.text.index(f"VAR {n} =") for n in probe.answers]
        assert order == sorted(order)  # the chain reads in document order
    assert len({resolve(n) for n in assign}) == len(case.probes) + 1  # plus one decoy chain


@pytest.mark.parametrize("n", [2048, 8192])
def test_cwe_top_ten_are_most_frequent(n: int) -> None:
    case = build_case("cwe", n, DEPTHS, seed=5, count_tokens=words, filler="ignored. text.")
    lines = case.text.splitlines()
    assert all(re.fullmatch(rf"{i}\. [a-z]+", line) for i, line in enumerate(lines, 1))
    counts = Counter(line.split()[1] for line in lines).most_common()
    (probe,) = case.probes
    assert probe.depth == -1 and len(probe.answers) == 10
    assert {w for w, _ in counts[:10]} == set(probe.answers)
    assert counts[9][1] >= 2 * counts[10][1]


def test_score() -> None:
    one = Probe("passkey", "q", ("1234567",), 0.5)
    assert score(one, "1234567") == 1.0
    assert score(one, "The special magic number is 1234567.") == 1.0
    assert score(one, "91234567") == 0.0 and score(one, "12345678") == 0.0
    assert score(one, "123 4567") == 0.0
    assert score(one, "") == 0.0
    multi = Probe("multivalue", "q", ("1111111", "2222222", "3333333", "4444444"), 0.1)
    assert score(multi, "1111111, 3333333") == 0.5
    assert score(multi, "4444444\n3333333\n2222222\n1111111") == 1.0
    names = Probe("vartrack", "q", ("QPEXK", "ABCDE"), 0.2)
    assert score(names, "qpexk and AbCdE") == 1.0
    assert score(names, "QPEXKZ, ABCDE") == 0.5
    phrase = Probe("cwe", "q", ("blue  locker",), -1)
    assert score(phrase, "The Blue\nLocker!") == 1.0
    code = Probe("lookalike", "q", ("amber-3397",), 0.3)  # the hyphenated code is one whole token
    assert score(code, "amber-3397") == 1.0 and score(code, "The code is Amber-3397.") == 1.0
    assert score(code, "amber-3389") == 0.0 and score(code, "cobalt-3397") == 0.0
    assert score(code, "amber-33970") == 0.0 and score(code, "amber 3397") == 0.0 and score(code, "3397") == 0.0


FILLER = "\n\n".join(
    f"Paragraph {p} of the report, sentence one says zebra{p}. It continues with detail number {p}a here. "
    f"Finally it closes paragraph {p} with care."
    for p in range(40)
)


@pytest.mark.parametrize("task", NEEDLE_TASKS)
def test_filler_mode_uses_given_text(task: str) -> None:
    case = build_case(task, 2048, DEPTHS, seed=0, count_tokens=words, filler=FILLER)  # filler ~1000 tokens
    assert 0.95 * 2048 <= words(case.text) <= 1.03 * 2048
    stripped = VAR.sub("", MAGIC.sub("", case.text))
    for probe in case.probes:  # passkey and lookalike facts are sentences of their own
        if task in ("passkey", "lookalike", "onekey", "manifest", "tray"):
            stripped = re.sub(r"[^.]*\b" + re.escape(probe.answers[0]) + r"\b[^.]*\.", "", stripped)
    sentences = set(re.split(r"(?<=[.!?])\s+", " ".join(FILLER.split())))
    for s in re.split(r"(?<=[.!?])\s+", " ".join(stripped.split())):
        assert s in sentences, s
    assert stripped.lstrip().startswith("Paragraph 0 of the report")
    assert case.text.count("zebra3.") >= 2  # repeated from the start when too short
    for probe in case.probes:
        first = case.text.index(probe.answers[0])
        assert abs(first / len(case.text) - probe.depth) <= 0.05


def test_filler_cut_when_long_and_forbidden_values_skipped() -> None:
    text, starts, n = build_haystack(300, [(0.5, "NEEDLE 4242.")], seed=0, count_tokens=words, filler=FILLER,
                                     forbid=["zebra1"])
    assert 0.95 * 300 <= n <= 1.03 * 300 and "Paragraph 39" not in text
    assert "zebra1." not in text and "zebra2." in text
    assert text[starts[0]:].startswith("NEEDLE 4242.") and abs(starts[0] / len(text) - 0.5) < 0.05


def test_generated_prose_is_varied() -> None:
    case = build_case("passkey", 4096, [0.5], seed=0, count_tokens=words)
    paragraphs = case.text.split("\n\n")
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(case.text.split()))
    assert len(set(sentences)) >= 0.9 * len(sentences)
    assert all(3 <= len(re.split(r"(?<=[.!?])\s+", p)) <= 8 for p in paragraphs[:-1])
    assert not re.search(r"\d{5}", case.text.replace(case.probes[0].answers[0], ""))


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        build_case("nope", 2048, DEPTHS, seed=0, count_tokens=words)
    with pytest.raises(ValueError):
        build_case("passkey", 2048, [1.5], seed=0, count_tokens=words)
    with pytest.raises(ValueError):
        build_case("passkey", 2048, [], seed=0, count_tokens=words)
    with pytest.raises(ValueError):
        build_case("passkey", 2048, [0.5], seed=0, count_tokens=words, filler="  \n ")


def test_cli_eval_takes_every_task(monkeypatch, tmp_path) -> None:
    import typer
    from typer.testing import CliRunner

    from kvlocal import cli, cli_common
    from kvlocal.errors import KvlocalError
    from kvlocal.evals import runner

    [tasks_option] = [p for p in typer.main.get_command(cli.app).commands["eval"].commands["grid"].params if p.name == "tasks"]
    assert ",".join(TASKS) in tasks_option.help

    grids = []

    def stop_at_the_grid(session, config, out, **_) -> None:
        grids.append(config)
        raise KvlocalError("stopped at the grid")

    monkeypatch.setattr(cli_common, "open_session", lambda *args: SimpleNamespace(trained_ctx=32768))
    monkeypatch.setattr(runner, "run_grid", stop_at_the_grid)
    result = CliRunner().invoke(cli.app, ["eval", "--tasks", "lookalike", "--depths", "8", "--lengths", "2k",
                                          "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and "stopped at the grid" in result.stderr, result.stderr
    [grid] = grids
    assert grid.tasks == ["lookalike"] and len(grid.depths) == 8
