"""The routed engine over llama.cpp's RPC backend, on loopback: two `kvlocal rpc-server`s started here
on free 127.0.0.1 ports hold some of a tiny model's layers and their KV cache.

Oracles: over RPC, routing with every region selected reproduces dense attention, and the read
statistics (rows, bytes, the regions of every layer and head) equal the local run's exactly; the CLI
answers a document and a set as it does locally; a server killed mid-answer ends the answer in one
line with exit status 1 and nothing cached lost; a server of another protocol, or none, is one line.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.engine

from synth_gguf import write_tiny_qwen2  # noqa: E402

from kvlocal import kvstate  # noqa: E402
from kvlocal.evals import library_report  # noqa: E402
from kvlocal.evals import report as report_module  # noqa: E402
from kvlocal.engine import EngineContext, layer_plan, require_patched  # noqa: E402
from kvlocal.errors import UsageError  # noqa: E402
from kvlocal.routing import Route  # noqa: E402
from kvlocal.rpc import RPC_PROTOCOL, Endpoint, RpcError, check_bind, placement, probe  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
N_DOC = 1500
STEPS = [7, 11, 13, 17, 19, 23]
DOC = "\n".join(f"Line {i}: the gauge at post {i} read {i * 13 % 97} units." for i in range(40))
QUESTION = "What did post 7 read?"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kvlocal(*args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), KVLOCAL_RPC="")
    return subprocess.Popen([sys.executable, "-m", "kvlocal.cli", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def start_server(deadline_s: float = 120.0) -> tuple[subprocess.Popen, Endpoint]:
    """`kvlocal rpc-server` on a free loopback port, polled with the protocol's handshake until it answers."""
    endpoint = Endpoint("127.0.0.1", free_port())
    proc = kvlocal("rpc-server", "--port", str(endpoint.port), "--threads", "1")
    end = time.monotonic() + deadline_s
    while True:
        try:
            probe(endpoint, timeout=5)
            return proc, endpoint
        except RpcError:
            if proc.poll() is not None:
                raise AssertionError(f"rpc-server exited {proc.returncode}: {proc.stderr.read()}") from None
            if time.monotonic() > end:
                proc.kill()
                raise AssertionError(f"rpc-server on {endpoint} did not answer in {deadline_s} s") from None
            select.select([proc.stderr], [], [], 0.05)  # wake on its log, or poll again


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def servers():
    started = [start_server(), start_server()]
    yield [endpoint for _, endpoint in started]
    for proc, _ in started:
        stop(proc)


@pytest.fixture(scope="module")
def model4(tmp_path_factory) -> Path:
    """A tiny qwen2 of 4 layers: one here, and layers with KV on each server (--tensor-split 1,2,2)."""
    return write_tiny_qwen2(tmp_path_factory.mktemp("m4") / "tiny4.gguf", n_layer=4, seed=7)


def rpc_list(servers) -> str:
    return ",".join(map(str, servers))


def open_context(model: Path, place=None) -> EngineContext:
    servers, shares = ([str(e) for e in place.servers], place.shares) if place else ((), ())
    return EngineContext.open(model, n_batch=512, threads=1, kv_type="f16", centroid_block=16, centroid_type="f16",
                              n_ctx=2048, rpc_servers=servers, rpc_shares=shares)


ROUTES = (Route(mode="full"), Route(mode="geometric", top_k=1000, region=64, shortlist=0),
          Route(mode="geometric", top_k=1, region=64, shortlist=0))


def oracle_runs(model: Path, place=None):
    """Prefill N_DOC tokens, then decode STEPS densely, with every region, and with one: (logits, stats) per step;
    and the device of each layer."""
    ctx = open_context(model, place)
    try:
        rng = np.random.default_rng(1)
        ctx.decode([int(t) for t in rng.integers(0, 250, size=N_DOC)])
        runs = []
        for route in ROUTES:
            ctx.truncate(N_DOC)
            ctx.apply_route(route)
            steps = []
            for token in STEPS:
                ctx.decode([token])
                steps.append((ctx.last_logits().copy(), ctx.read_stats()))
            runs.append(steps)
        return runs, ctx.layer_devices, ctx.device_labels
    finally:
        ctx.close()


def test_the_server_speaks_this_engines_protocol_and_patch_set(servers):
    info = probe(servers[0])
    assert info.protocol == RPC_PROTOCOL
    assert info.build == require_patched().build_id and info.build.startswith("kvlocal:")
    assert len(info.devices) >= 1 and all(total >= free > 0 for free, total in info.devices)


def refusal_by_a_peer(model4, docs, tmp_path, protocol: tuple[int, int, int], build: bytes | None) -> tuple[str, int]:
    """`kvlocal ask --rpc` against a peer that answers HELLO as a server of `protocol` and, asked its
    patch set, answers `build` (None: hangs up, as a server without the command does): the one
    line the client printed (it must exit 1, print no answer and cache nothing), and the peer's port."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer():
        conn, _ = listener.accept()
        with conn:
            conn.recv(1 + 8 + 24, socket.MSG_WAITALL)
            conn.sendall(struct.pack("<Q", 28) + bytes(protocol) + bytes(1) + bytes(24))
            if conn.recv(1 + 8, socket.MSG_WAITALL) and build is not None:
                conn.sendall(struct.pack("<Q", 64) + build.ljust(64, b"\0"))
                conn.recv(1)  # until the client hangs up

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        result = ask(tmp_path / "cache", model4, docs[:1], "--rpc", f"127.0.0.1:{port}")
    finally:
        thread.join(timeout=30)
        listener.close()
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.kvstate*"))
    [line] = result.stderr.strip().splitlines()
    return line, port


@pytest.mark.parametrize("answer, said", [
    (b"kvlocal:0123456789abcdef", "patch set 0123456789abcdef"),
    (None, "no kvlocal patch set"),  # a server without the command hangs up, as upstream's does
], ids=["another patch set", "upstream"])
def test_a_server_of_another_patch_set_is_refused_in_one_line(model4, docs, tmp_path, answer, said):
    line, port = refusal_by_a_peer(model4, docs, tmp_path, RPC_PROTOCOL, answer)
    own = require_patched().build_id.removeprefix("kvlocal:")
    assert line == (f"kvlocal: error: RPC server 127.0.0.1:{port} was built from {said}, this engine from {own}: "
                    f"run the server of this kvlocal (`kvlocal rpc-server`)")


def test_every_region_over_rpc_reproduces_dense_and_reads_exactly_what_local_reads(servers, model4):
    local, local_layers, _ = oracle_runs(model4)
    remote, layers, labels = oracle_runs(model4, placement(rpc_list(servers), "1,2,2"))
    assert local_layers == ["CPU"] * 5
    # 4 layers + the output, split 1:2:2 -> layer 0 here, 1-2 on the first server, 3 and the output on the second
    first, second = layers[1], layers[3]
    assert layers == ["CPU", first, first, second, second] and first != second
    assert labels[first] == str(servers[0]) and labels[second] == str(servers[1])
    dense, routed, small = remote
    diff = max(float(np.max(np.abs(a[0] - b[0]))) for a, b in zip(dense, routed))
    scale = max(float(np.max(np.abs(a[0]))) for a in dense)
    assert diff <= 5e-3 * max(1.0, scale), f"max |logit diff| {diff} (scale {scale})"  # as tests/test_routing.py
    assert [int(np.argmax(a[0])) for a in dense] == [int(np.argmax(b[0])) for b in routed]
    assert all(s.n_layer_routed == s.n_layer == 4 for _, s in routed)
    assert max(float(np.max(np.abs(a[0] - b[0]))) for a, b in zip(dense, small)) > diff
    # the same computation on the same CPU code: the local run's logits, and its reads exactly
    for here, there in zip(local, remote):
        for (logits_here, stats_here), (logits_there, stats_there) in zip(here, there):
            np.testing.assert_allclose(logits_there, logits_here, rtol=0, atol=1e-5)
            for field in ("n_layer_routed", "n_sel", "n_kv", "rows_read", "rows_dense", "bytes_kv", "bytes_meta",
                          "bytes_dense"):
                assert getattr(stats_there, field) == getattr(stats_here, field), field
            if stats_here.n_layer_routed:
                np.testing.assert_array_equal(stats_there.regions, stats_here.regions)


def ask(cache: Path, model: Path, docs: list[Path], *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), KVLOCAL_RPC="", KVLOCAL_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-m", "kvlocal.cli", "ask", *map(str, docs), QUESTION, "--model",
                           str(model), "--max-tokens", "8", *extra], env=env, capture_output=True, text=True)


@pytest.fixture
def docs(tmp_path) -> list[Path]:
    paths = []
    for i in range(2):
        path = tmp_path / f"report-{i}.txt"
        path.write_text(DOC.replace("gauge", ["gauge", "meter"][i]))
        paths.append(path)
    return paths


def test_ask_over_rpc_answers_as_locally_and_says_where_the_layers_were(servers, model4, docs, tmp_path):
    here = ask(tmp_path / "cache-here", model4, docs[:1])
    assert here.returncode == 0, here.stderr
    there = ask(tmp_path / "cache-there", model4, docs[:1], "--rpc", rpc_list(servers), "--tensor-split", "1,2,2")
    assert there.returncode == 0, there.stderr
    assert there.stdout == here.stdout
    assert (f"layers 0 on this machine (CPU), 1-2 on {servers[0]} (RPC" in there.stderr
            and f"3 and the output on {servers[1]} (RPC" in there.stderr), there.stderr
    again = ask(tmp_path / "cache-there", model4, docs[:1], "--rpc", rpc_list(servers), "--tensor-split", "1,2,2")
    assert again.returncode == 0 and "cache hit, no prefill" in again.stderr, again.stderr
    assert again.stdout == here.stdout
    # what the answer's steps sent and received over the servers' connections
    for run in (there, again):
        assert re.search(r"over the wire \(RPC\), per answer step: [\d.]+ KiB sent, [\d.]+ KiB received", run.stderr)
    assert "over the wire" not in here.stderr


def test_a_set_of_documents_over_rpc_answers_as_locally(servers, model4, docs, tmp_path):
    here = ask(tmp_path / "cache", model4, docs)
    assert here.returncode == 0, here.stderr
    there = ask(tmp_path / "cache", model4, docs, "--rpc", rpc_list(servers))  # the cached documents, assembled there
    assert there.returncode == 0, there.stderr
    assert there.stdout == here.stdout
    assert "on this machine (CPU)" in there.stderr and str(servers[1]) in there.stderr


def test_serve_over_rpc_answers_as_ask_does_here(servers, model4, docs, tmp_path, monkeypatch):
    import httpx

    from kvlocal.serve.command import open_state, serving_in_thread
    from kvlocal.serve.schemas import Limits

    here = ask(tmp_path / "cache", model4, docs[:1])
    assert here.returncode == 0, here.stderr
    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(tmp_path / "cache"))
    state = open_state([str(docs[0])], [], Limits(), model=str(model4), threads=1,
                       placement=placement(rpc_list(servers), "1,2,2"))
    body = {"model": "kvlocal", "max_tokens": 8, "documents": [docs[0].name],
            "messages": [{"role": "user", "content": QUESTION}]}
    session = state.scheduler.worker.session
    try:
        with serving_in_thread(state) as port:
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
            where = session.layer_placement()
    finally:
        session.close()  # the servers serve one client at a time: the next tests' turn
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == here.stdout.rstrip("\n")
    assert f"1-2 on {servers[0]} (RPC" in where and f"3 and the output on {servers[1]} (RPC" in where, where


def bench(cache: Path, model: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), KVLOCAL_RPC="", KVLOCAL_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-m", "kvlocal.cli", "bench", *args, "--model", str(model), "--lengths",
                           "2k", "--tokens", "3", "--threads", "1"], env=env, capture_output=True, text=True)


def test_bench_over_rpc_times_the_same_answers_here_first_and_counts_the_wire(servers, model4, tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = bench(tmp_path / "cache", model4, "document", "--prefill-lengths", "none", "--no-upkeep", "--no-ttft",
                   "--rpc", rpc_list(servers), "--out", str(out))
    assert result.returncode == 0, result.stderr
    # the document was prefilled once, here, and the RPC run loaded it from the cache
    assert "tokens (prefilled)" in result.stderr and "tokens (cache hit)" in result.stderr
    assert result.stderr.index("tokens (prefilled)") < result.stderr.index("layers split with")
    assert len(list((tmp_path / "cache" / "states").glob("*.kvstate"))) == 1
    report = json.loads(out.read_text())
    assert f"on {servers[1]} (RPC" in report["placement"]
    [row] = report["lengths"]
    assert row["here_full_tps"] > 0 and row["here_geometric_tps"] > 0
    for route in ("full", "geometric"):  # every step sends its graph and receives the logits
        assert 0 < row[f"{route}_wire_sent_per_step"] < row[f"{route}_wire_per_step"]
    assert "| every layer here: full / geometric tok/s | over RPC, x here: full / geometric |" in result.stdout
    assert re.search(r"\| [\d.]+ / [\d.]+ \| [\d.]+x / [\d.]+x \|$", result.stdout, re.M), result.stdout
    report_module.main(["--decode", str(out)])  # the table again, from the file
    assert capsys.readouterr().out.strip() in result.stdout
    # --no-here: the servers only (a library this machine could not hold alone)
    alone = bench(tmp_path / "cache", model4, "document", "--prefill-lengths", "none", "--no-upkeep", "--no-ttft",
                  "--rpc", rpc_list(servers), "--no-here", "--out", str(out))
    assert alone.returncode == 0, alone.stderr
    assert "every layer on this machine" not in alone.stderr and "tokens (cache hit)" in alone.stderr
    [row] = json.loads(out.read_text())["lengths"]
    assert "here_full_tps" not in row and row["full_wire_per_step"] > 0
    assert "every layer here" not in alone.stdout


def test_bench_library_over_rpc_reports_the_set_here_and_over_the_wire(servers, model4, tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = bench(tmp_path / "cache", model4, "library", "2", "--rpc", rpc_list(servers), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("bodies prefilled and cached") == 1  # here; the RPC run readied them from the cache
    report = json.loads(out.read_text())
    [entry] = report["library"]
    assert entry["here_full_tps"] > 0 and entry["here_geometric_tps"] > 0 and entry["full_wire_per_step"] > 0
    assert f"on {servers[0]} (RPC" in report["placement"]
    wire = r"[\d.]+ KiB \([\d.]+ KiB \+ [\d.]+ KiB\)"  # per step: sent + received
    assert re.search(rf"^\| 2 x 2k \| .* \| {wire} / {wire} \| [\d.]+ / [\d.]+ \| [\d.]+x / [\d.]+x \|$",
                     result.stdout, re.M), result.stdout
    library_report.main(["--decode", str(out)])  # the table again, from the file
    assert capsys.readouterr().out == result.stdout


def test_bench_over_an_unreachable_server_is_one_line_before_any_work(model4, tmp_path):
    port = free_port()
    result = bench(tmp_path / "cache", model4, "document", "--rpc", f"127.0.0.1:{port}")
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"kvlocal: error: cannot reach RPC server 127.0.0.1:{port}: "), line
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.kvstate*"))


def test_a_server_killed_mid_answer_is_one_line_exit_1_and_nothing_cached_is_lost(model4, docs, tmp_path,
                                                                                  monkeypatch):
    cache = tmp_path / "cache"
    proc, endpoint = start_server()
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT), KVLOCAL_RPC="", KVLOCAL_CACHE_DIR=str(cache))
        client = subprocess.Popen([sys.executable, "-m", "kvlocal.cli", "ask", str(docs[0]), QUESTION, "--model",
                                   str(model4), "--max-tokens", "1500", "--rpc", str(endpoint)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = client.stdout.read(1)  # the answer has started streaming
        proc.kill()
        proc.wait()
        rest, stderr = client.communicate(timeout=120)
    finally:
        stop(proc)
    assert first, stderr
    assert client.returncode == 1, (first + rest, stderr)
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("kvlocal: error: the engine stopped (Remote RPC server crashed"), stderr
    assert f"RPC server {endpoint} is gone" in last
    assert "saved KV states are intact" in last
    # the prefilled document was saved before the answer began, and still loads
    monkeypatch.setenv("KVLOCAL_CACHE_DIR", str(cache))
    assert len(kvstate.list_entries()) == 1
    local = ask(cache, model4, docs[:1])
    assert local.returncode == 0 and "cache hit, no prefill" in local.stderr, local.stderr


def test_a_server_of_another_protocol_is_refused_in_one_line(model4, docs, tmp_path):
    """A peer answering the handshake as a protocol 6 server (what an older ggml-rpc-server does)."""
    line, port = refusal_by_a_peer(model4, docs, tmp_path, (6, 0, 0), None)
    assert line == (f"kvlocal: error: RPC server 127.0.0.1:{port} speaks protocol 6.0.0, this engine "
                    f"{'.'.join(map(str, RPC_PROTOCOL))}: run the server built with this kvlocal (`kvlocal rpc-server`)")


def test_an_unreachable_server_is_one_line_before_any_work(model4, docs, tmp_path):
    port = free_port()
    result = ask(tmp_path / "cache", model4, docs[:1], "--rpc", f"127.0.0.1:{port}")
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"kvlocal: error: cannot reach RPC server 127.0.0.1:{port}: "), line
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.kvstate*"))


def test_doctor_lists_the_servers_it_reaches(servers, tmp_path):
    gone = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), KVLOCAL_RPC=f"{rpc_list(servers)},127.0.0.1:{gone}")
    out = subprocess.run([sys.executable, "-m", "kvlocal.cli", "doctor"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "RPC: built in (protocol 7.0.0; server " in out.stdout
    for endpoint in servers:
        assert (f"RPC server {endpoint}: reachable, RPC protocol {'.'.join(map(str, RPC_PROTOCOL))}, patch set "
                f"{require_patched().patchset}, 1 device") in out.stdout
    assert f"RPC server 127.0.0.1:{gone}: UNREACHABLE: cannot reach" in out.stdout


@pytest.mark.parametrize("rpc, split, message", [
    ("localhost", None, "'localhost' is not HOST:PORT"),
    ("a:1,a:1", None, "a server is named twice"),
    ("a:1", "1", "--tensor-split gives 1 shares; it needs 2"),
    ("a:1", "1,x", "is not a list of numbers"),
    ("a:1", "1,0", "the servers' add up to more than 0"),
    (None, "1,1", "--tensor-split needs --rpc"),
])
def test_bad_rpc_options_are_usage_errors(rpc, split, message):
    with pytest.raises(UsageError, match=message):
        placement(rpc, split)


def test_default_shares_are_equal_and_plan_llama_cpps_split():
    place = placement("a:1,b:2", None)
    assert place.shares == (1.0, 1.0, 1.0)
    assert layer_plan(24, place.shares) == (17, [1.0, 1.0])  # 25 places: 8 here, 17 on the servers
    assert layer_plan(4, placement("a:1", "0,1").shares) == (5, [1.0])


def test_rpc_server_refuses_a_non_loopback_address_without_allow_remote():
    result = kvlocal("rpc-server", "--host", "0.0.0.0", "--port", str(free_port()))
    out, err = result.communicate(timeout=120)
    assert result.returncode == 2, err
    [line] = err.strip().splitlines()
    assert line.startswith("kvlocal: error: --host 0.0.0.0 is not a loopback address") and "--allow-remote" in line
    assert check_bind("0.0.0.0", free_port(), allow_remote=True).startswith("warning: serving RPC on 0.0.0.0:")
    assert check_bind("127.0.0.1", free_port(), allow_remote=False) is None
