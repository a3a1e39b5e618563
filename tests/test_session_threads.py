"""The default thread count (a session's and `kvlocal rpc-server`'s): every core the process may run on."""

from __future__ import annotations

import os
import socket

import pytest

from kvlocal.engine import default_threads


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_default_threads_follows_the_affinity_mask():
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert default_threads() == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert default_threads() == len(allowed)


@pytest.mark.engine
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_rpc_server_runs_as_many_threads_as_the_cores_it_may_use(monkeypatch, capsys):
    from kvlocal import rpc

    started = []
    monkeypatch.setattr(os, "execv", lambda binary, argv: started.append(argv))
    monkeypatch.setattr(os, "dup2", lambda fd, fd2: None)  # keep this test's stdout
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        rpc.serve("127.0.0.1", port, None, None, False)
    finally:
        os.sched_setaffinity(0, allowed)
    [argv] = started
    assert argv[argv.index("--threads") + 1] == "1"
