"""The CLI end to end on the tiny synthetic model: streams, summaries, exit codes, the KV state cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.engine

from synth_gguf import write_truncated  # noqa: E402

from kvlocal import kvstate  # noqa: E402
from kvlocal.cli import app  # noqa: E402
from kvlocal.errors import CancelledError  # noqa: E402
from kvlocal.session import Session  # noqa: E402

DOC = "\n".join(f"Line {i}: the gauge at post {i} read {i * 13 % 97} units." for i in range(40))


@pytest.fixture
def doc(tmp_path) -> Path:
    path = tmp_path / "report.txt"
    path.write_text(DOC)
    return path


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def ask(doc, model, *extra):
    return run("ask", str(doc), "What did post 7 read?", "--model", str(model), "--max-tokens", "4", *extra)


def test_ask_streams_to_stdout_and_reports_to_stderr(cache_dir, doc, tiny_model):
    first = ask(doc, tiny_model)
    assert first.exit_code == 0, first.stderr
    assert "kvlocal:" not in first.stdout
    assert "prefilled in" in first.stderr and "state saved" in first.stderr
    assert "KV reads over" in first.stderr and "fewer bytes" in first.stderr

    second = ask(doc, tiny_model)
    assert second.exit_code == 0, second.stderr
    assert "cache hit, no prefill" in second.stderr
    assert second.stdout == first.stdout  # greedy, same state


def test_damaged_cache_entry_is_detected_and_rebuilt(cache_dir, doc, tiny_model):
    assert ask(doc, tiny_model).exit_code == 0
    [entry] = kvstate.list_entries()
    data = bytearray(entry.path.read_bytes())
    data[-100] ^= 0xFF
    entry.path.write_bytes(bytes(data))

    result = ask(doc, tiny_model)
    assert result.exit_code == 0, result.stderr
    assert "saved state discarded: its checksum does not match" in result.stderr
    assert "prefilled in" in result.stderr
    assert "cache hit" in ask(doc, tiny_model).stderr


def test_mismatched_cache_entry_is_not_loaded(cache_dir, doc, tiny_model, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text(DOC.replace("gauge", "meter"))
    assert ask(other, tiny_model).exit_code == 0
    assert ask(doc, tiny_model).exit_code == 0
    a, b = kvstate.list_entries()
    # put the other document's entry where this document's entry lives
    os.replace(a.path if "other" in a.label else b.path, b.path if "other" in a.label else a.path)
    result = ask(doc, tiny_model)
    assert result.exit_code == 0
    assert "does not match this document" in result.stderr


def test_cache_list_and_clear(cache_dir, doc, tiny_model):
    assert ask(doc, tiny_model).exit_code == 0
    listing = run("cache", "list")
    assert listing.exit_code == 0 and "report.txt" in listing.stdout
    cleared = run("cache", "clear")
    assert cleared.exit_code == 0 and "removed 1 saved KV state" in cleared.stderr
    assert "no saved KV states" in run("cache", "list").stdout


@pytest.mark.parametrize(
    "name, content, code, message",
    [
        ("missing.txt", None, 1, "no such file"),
        ("notes.xyz", bytes(range(256)) * 4, 2, "xyz"),  # binary: a text file of any extension is read
        ("empty.txt", b"", 1, "empty"),
        ("broken.pdf", b"%PDF-1.7\n1 0 obj\n<< /Type /Catalog", 1, "not a readable PDF"),
    ],
)
def test_bad_documents_are_one_line_errors(cache_dir, tmp_path, tiny_model, name, content, code, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    result = run("ask", str(path), "q?", "--model", str(tiny_model))
    assert result.exit_code == code
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_bad_models_are_one_line_errors(cache_dir, doc, tiny_model, tmp_path):
    truncated = write_truncated(tiny_model, tmp_path / "cut.gguf")
    text = tmp_path / "fake.gguf"
    text.write_text("not a model")
    for model, code, message in [
        (truncated, 1, "truncated or damaged"),
        (text, 1, "not a GGUF model file"),
        ("no-such-alias", 2, "unknown model"),
    ]:
        result = ask(doc, model)
        assert result.exit_code == code, result.stderr
        assert message in result.stderr.lower() or message in result.stderr
        assert "Traceback" not in result.stderr


def test_usage_errors_exit_2(cache_dir, doc, tiny_model):
    assert ask(doc, tiny_model, "--route", "sideways").exit_code == 2
    assert ask(doc, tiny_model, "--region", "48").exit_code == 2
    assert ask(doc, tiny_model, "--kv-type", "q3").exit_code == 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--threads", "0"], "--threads"),
        (["--threads", "100000"], "--threads"),
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "-1"], "--temperature"),
        (["--seed", "-1"], "--seed"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--centroid-block", "128", "--region", "64"], "multiple of the centroid block"),
    ],
)
def test_bad_settings_are_refused_before_any_work(cache_dir, doc, tiny_model, extra, message):
    result = ask(doc, tiny_model, *extra)
    assert result.exit_code == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert "prefilled" not in result.stderr and not kvstate.list_entries()


def test_an_answer_cut_by_a_full_context_says_so(cache_dir, doc, tiny_model):
    result = run("ask", str(doc), "What did post 7 read?", "--model", str(tiny_model), "--max-tokens", "100000")
    assert result.exit_code == 0, result.stderr
    assert "the context is full" in result.stderr
    assert "the context is full" not in ask(doc, tiny_model).stderr  # 4 tokens fit


def test_empty_model_name_is_a_usage_error(cache_dir, doc):
    result = run("ask", str(doc), "q?", "--model", "")
    assert result.exit_code == 2 and "the model name is empty" in result.stderr and "(option --model)" in result.stderr


def test_empty_question_is_refused_before_the_prefill(cache_dir, doc, tiny_model):
    result = run("ask", str(doc), "  ", "--model", str(tiny_model))
    assert result.exit_code == 2 and "question is empty" in result.stderr and "prefilled" not in result.stderr


def test_truncated_cache_entry_is_rebuilt(cache_dir, doc, tiny_model):
    assert ask(doc, tiny_model).exit_code == 0
    [entry] = kvstate.list_entries()
    data = entry.path.read_bytes()
    for keep in (1000, 5001):  # inside the token list, at odd and even offsets
        entry.path.write_bytes(data[:keep])
        result = ask(doc, tiny_model)
        assert result.exit_code == 0, result.stderr
        assert "truncated" in result.stderr and "prefilled in" in result.stderr
        data = kvstate.list_entries()[0].path.read_bytes()
    assert "cache hit" in ask(doc, tiny_model).stderr


def test_an_unusable_cache_dir_does_not_lose_the_answer(tmp_path, monkeypatch, doc, tiny_model):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(blocker))
    result = ask(doc, tiny_model)
    assert result.exit_code == 0, result.stderr
    assert "could not save the KV state" in result.stderr and "state saved" not in result.stderr
    assert result.stdout.strip()  # the answer still came


def test_eval_refuses_bad_tasks_and_outputs_before_loading(cache_dir, tiny_model, tmp_path):
    a_file = tmp_path / "a.txt"
    a_file.write_text("x")
    for args, message in [
        (["--tasks", "bogus"], "choose from passkey"),
        (["--tasks", ""], "none given"),
        (["--seeds", ""], "--seeds"),
        (["--out", str(a_file)], "is a file"),
    ]:
        result = run("eval", "--model", str(tiny_model), "--lengths", "2k", "--depths", "2", *args)
        assert result.exit_code == 2, (args, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr


def test_lengths_beyond_the_model_context_are_refused(cache_dir, tiny_model, tmp_path):
    # the tiny model's trained context is 4096 tokens
    for command in ("eval", "bench"):
        result = run(command, "--model", str(tiny_model), "--lengths", "8k", "--out", str(tmp_path / f"{command}.out"))
        assert result.exit_code == 2, result.stderr
        assert "exceed the model's trained context" in result.stderr


def test_bench_refuses_a_bad_out_path_before_running(cache_dir, tiny_model, tmp_path):
    for out, message in [(tmp_path, "is a folder"), (tmp_path / "no" / "b.json", "does not exist")]:
        result = run("bench", "--model", str(tiny_model), "--lengths", "2k", "--out", str(out))
        assert result.exit_code == 2, result.stderr
        assert message in result.stderr and "prefilled" not in result.stderr


def test_document_longer_than_context(cache_dir, tmp_path, tiny_model):
    path = tmp_path / "long.txt"
    path.write_text(DOC * 12)
    result = run("ask", str(path), "q?", "--model", str(tiny_model))
    assert result.exit_code == 1
    assert "tokens" in result.stderr and "context holds 4,096" in result.stderr


def test_interrupted_prefill_saves_nothing(cache_dir, tiny_model):
    session = Session(str(tiny_model), n_batch=64)
    calls = []

    def progress(p):
        calls.append(p)
        if len(calls) == 2:
            raise KeyboardInterrupt

    with pytest.raises(CancelledError):
        session.load_document(DOC, progress=progress)
    assert kvstate.list_entries() == []
    assert not session.load_document(DOC).cache_hit


def test_ask_does_not_import_textual(cache_dir, doc, tiny_model):
    code = (
        "import sys\n"
        "from kvlocal.cli import app\n"
        "from typer.testing import CliRunner\n"
        f"r = CliRunner().invoke(app, ['ask', {str(doc)!r}, 'q?', '--model', {str(tiny_model)!r}, '-n', '2'])\n"
        "assert r.exit_code == 0, r.stderr\n"
        "print('textual' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_cli_route_defaults_come_from_one_place():
    """The CLI's defaults are route_settings' names, and RouteConfig's and PrefillConfig's the same ones."""
    from kvlocal import route_settings
    from kvlocal.cli_options import PrefillOptions, RouteOptions
    from kvlocal.routing import DEFAULT_ROUTE, PrefillConfig, RouteConfig

    options = RouteOptions()
    assert options.centroid_block is route_settings.DEFAULT_CENTROID_BLOCK
    assert options.config(RouteConfig().mode) == DEFAULT_ROUTE  # nothing given: a set, a model take their own
    assert PrefillOptions().config(PrefillConfig().mode) == PrefillConfig()


def test_route_settings_import_nothing_heavy():
    code = "import sys, kvlocal.route_settings; print(any(m in sys.modules for m in ('numpy', 'ctypes', 'llama_cpp')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_cli_threads_bound_is_the_sessions():
    from kvlocal import cli_options, session

    assert cli_options.MAX_THREADS == session.MAX_THREADS


@pytest.mark.parametrize("command", ["bench", "eval"])
def test_too_short_context_is_a_usage_error(cache_dir, tiny_model, command):
    result = run(command, "--model", str(tiny_model), "--lengths", "1k")
    assert result.exit_code == 2, result.stderr
    assert "at least 2k" in result.stderr and "Traceback" not in result.stderr


def test_bench_reports_speed_ttft_and_upkeep(cache_dir, tiny_model, tmp_path):
    out = tmp_path / "bench.json"
    result = run("bench", "--model", str(tiny_model), "--lengths", "2k", "--tokens", "4", "--top-k", "2",
                 "--centroid-block", "32", "--prefill-lengths", "2k", "--prefill-top-k", "1", "--prefill-from", "512",
                 "--out", str(out))
    assert result.exit_code == 0, result.stderr
    report = json.loads(out.read_text())
    [prefill] = report["prefill_lengths"]
    assert prefill["dense_s"] > 0 and prefill["routed_s"] > 0 and prefill["bytes_reduction"] > 1
    assert "| routed s |" in result.stdout
    [length] = report["lengths"]
    assert length["length"] == 2048 and length["full_tps"] > 0 and length["geometric_tps"] > 0
    assert length["bytes_reduction"] > 1  # routed steps read fewer bytes than dense ones
    assert report["ttft_fresh_s"] > 0 and report["ttft_cached_s"] > 0
    assert report["centroid_upkeep"]["with_s"] > 0 and report["centroid_upkeep"]["without_s"] > 0
    assert "| geometric tok/s |" in result.stdout and "centroid upkeep" in result.stdout


def test_bench_dense_prefill_only(cache_dir, tiny_model, tmp_path):
    out = tmp_path / "bench.json"
    result = run("bench", "--model", str(tiny_model), "--lengths", "2k", "--tokens", "2", "--centroid-block", "32",
                 "--no-upkeep", "--no-ttft", "--prefill-lengths", "2k", "--no-prefill-routed", "--out", str(out))
    assert result.exit_code == 0, result.stderr
    report = json.loads(out.read_text())
    [prefill] = report["prefill_lengths"]
    assert prefill["dense_s"] > 0 and prefill["routed_s"] is None and prefill["speedup"] is None
    assert report["prefill"] == "dense only"
    assert "prefill, dense only:" in result.stdout and "| – | – | – |" in result.stdout
    assert "routed in" not in result.stderr  # no routed prefill was run


def test_bench_without_ttft_prefills_nothing_past_its_lengths(cache_dir, tiny_model, tmp_path):
    # the Vulkan check decodes a state the CPU saved: a slow device must not prefill the 4k document
    out = tmp_path / "bench.json"
    result = run("bench", "--model", str(tiny_model), "--lengths", "2k", "--tokens", "2", "--top-k", "2",
                 "--centroid-block", "32", "--prefill-lengths", "none", "--no-upkeep", "--no-ttft", "--out", str(out))
    assert result.exit_code == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["ttft_fresh_s"] is None and report["ttft_cached_s"] is None and "centroid_upkeep" not in report
    assert "time to first token" not in result.stdout and "| geometric tok/s |" in result.stdout
    assert len(list((cache_dir / "states").glob("*.kvstate"))) == 1  # the 2k haystack's, and no 4k document


@pytest.mark.parametrize("seed", [0, 4, 5])
def test_haystacks_at_the_trained_context_leave_room_for_the_answer(cache_dir, tmp_path, seed):
    # with the tiny models' tokenizer, seeds 4 and 5 overshot a 32k target past the trained context
    from synth_gguf import write_tiny_qwen2

    from kvlocal.evals.runner import DEFAULT_DEPTHS, make_case
    from kvlocal.prompt import build_prompt
    from kvlocal.session import ANSWER_RESERVE

    session = Session(str(write_tiny_qwen2(tmp_path / "t32k.gguf", n_ctx=32768)))
    case = make_case(session, "passkey", 32768, list(DEFAULT_DEPTHS), seed)
    prefix = session.tokenize_prompt(build_prompt(case.text, session.chat_template).prefix_segments(), bos=True)
    assert len(prefix) + ANSWER_RESERVE <= session.trained_ctx


def test_a_folder_in_place_of_a_cache_entry_is_replaced(cache_dir, doc, tiny_model):
    assert ask(doc, tiny_model).exit_code == 0
    [entry] = kvstate.list_entries()
    entry.path.unlink()
    entry.path.mkdir()
    result = ask(doc, tiny_model)
    assert result.exit_code == 0, result.stderr
    assert "saved state discarded" in result.stderr and "state saved" in result.stderr
    assert entry.path.is_file()
    assert run("cache", "clear").exit_code == 0


def test_eval_resumes_and_keys_on_max_tokens(cache_dir, tiny_model, tmp_path):
    out = tmp_path / "ev"
    args = ["eval", "--model", str(tiny_model), "--lengths", "2k", "--depths", "2", "--modes", "full",
            "--no-plots", "--out", str(out)]
    assert run(*args).exit_code == 0
    n = len((out / "results.jsonl").read_text().splitlines())
    assert n == 2
    assert run(*args).exit_code == 0  # a rerun finds every row done
    assert len((out / "results.jsonl").read_text().splitlines()) == n
    assert run(*args, "--max-tokens", "3").exit_code == 0  # another answer budget is another row
    assert len((out / "results.jsonl").read_text().splitlines()) == 2 * n


def test_lab_refuses_bad_settings_before_any_work(tmp_path):
    out = tmp_path / "lab"
    for args, says in ((["--rules", "mean16,nope"], "--rules: nope"), (["--budgets", "0"], "--budgets"),
                       (["--tasks", "cwe"], "--tasks"), (["--depths", "1"], ""),
                       (["prefill", "--rules", "engine,mean16"], "--rules: mean16"),  # a decode rule is not a prefill one
                       (["prefill", "--chunks", "512,0"], "--chunks"), (["prefill", "--prefill-from", "-1"], "")):
        result = run("lab", *args, "--out", str(out))  # "prefill" first: `kvlocal lab prefill`
        assert result.exit_code == 2, (args, result.output)
        assert says in result.output + result.stderr
    assert not out.exists()


def test_route_settings_reach_the_engine_call(tiny_model, doc):
    """--shortlist and --keep are refused when out of range and accepted otherwise."""
    assert ask(doc, tiny_model, "--keep", "1.5").exit_code == 2
    assert ask(doc, tiny_model, "--shortlist", "-1").exit_code == 2
    result = ask(doc, tiny_model, "--shortlist", "4", "--keep", "0.5")
    assert result.exit_code == 0, result.stderr
    assert "shortlist 4, keep 0.5" in result.stderr
    result = ask(doc, tiny_model, "--shortlist", "auto")
    assert result.exit_code == 0, result.stderr


def test_doctor_names_the_backend_devices(cache_dir):
    # the devices the engine's backends registered: the CPU always; a GPU build lists its GPU (or
    # lavapipe, with GGML_VK_VISIBLE_DEVICES) before it
    from kvlocal.engine import backend_devices

    devices = backend_devices()
    assert devices and devices[-1].kind == "cpu" and devices[-1].name == "CPU"
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("device ")]
    assert [line.split(":")[0] for line in lines] == [f"device {d.name}" for d in devices]
    assert lines[-1].startswith("device CPU: ") and "(cpu" in lines[-1]


def test_bench_serve_asks_the_real_server_alone_and_together(cache_dir, tiny_model, tmp_path):
    """Askers of one document through the HTTP server: the ones sent at once decoded beside each other, the
    full route reading every cell and giving alone the answers it gives 4 at a time (the batch's exact
    oracle), the routed one reading fewer."""
    out = tmp_path / "serve.json"
    result = run("bench", "serve", "--model", str(tiny_model), "--lengths", "2k", "--askers", "1,2", "--tokens", "6",
                 "--probes", "4", "--top-k", "2", "--centroid-block", "32", "--out", str(out))
    assert result.exit_code == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["askers"] == [1, 2] and list(report["routes"]) == ["geometric", "full"]
    [(length, by_mode)] = report["lengths"].items()
    assert length == "2048"
    for mode in ("geometric", "full"):
        askers = by_mode[mode]["askers"]
        assert (askers["1"]["beside"], askers["2"]["beside"]) == (0, 1)
        assert all(a["tokens"] > 0 and a["decode_tok_s"] > 0 for a in askers.values())
        assert len(by_mode[mode]["probes"]) == 4 and all(t > 0 for t in by_mode[mode]["ttft_idle_s"])
    full, routed = by_mode["full"]["askers"]["2"], by_mode["geometric"]["askers"]["2"]
    assert full["bytes_read"] == full["bytes_dense"] > 0 and 0 < routed["bytes_read"] < routed["bytes_dense"]
    assert by_mode["full"]["same_text"] == 4
    assert "| 2 askers |" in result.stdout and "| same text |" in result.stdout


def test_bench_serve_asks_each_asker_its_own_document_together(cache_dir, tiny_model, tmp_path):
    """--documents each: every asker asks its own named document (a shelf), and still decodes beside
    the others; full attention gives alone the answers it gives 4 at a time."""
    out = tmp_path / "serve.json"
    result = run("bench", "serve", "--model", str(tiny_model), "--lengths", "2k", "--askers", "1,2", "--tokens", "6",
                 "--probes", "4", "--top-k", "2", "--centroid-block", "32", "--documents", "each", "--out", str(out))
    assert result.exit_code == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["documents"] == "each"
    by_mode = report["lengths"]["2048"]
    for mode in ("geometric", "full"):
        askers = by_mode[mode]["askers"]
        assert (askers["1"]["beside"], askers["2"]["beside"]) == (0, 1)
        assert all(a["tokens"] > 0 and a["decode_tok_s"] > 0 for a in askers.values())
    assert by_mode["full"]["same_text"] == 4
    assert "shelf" in result.stderr


def test_bench_serve_refuses_bad_documents_before_any_work(cache_dir, tiny_model):
    result = run("bench", "serve", "--model", str(tiny_model), "--documents", "some")
    assert result.exit_code == 2 and "--documents" in result.stderr and "Traceback" not in result.stderr


def test_bench_serve_refuses_bad_askers_before_any_work(cache_dir, tiny_model):
    result = run("bench", "serve", "--model", str(tiny_model), "--askers", "0,2")
    assert result.exit_code == 2 and "--askers" in result.stderr and "Traceback" not in result.stderr
