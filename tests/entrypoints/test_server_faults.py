"""Faults of the multi-process server (tiny random Llama, DP=2 over gloo, CPU): an engine
core killed mid-request fails every in-flight request (HTTP 500 with an OpenAI-style body;
a stream ends with an error event, then ``[DONE]``), ``/health`` answers 503, the server
exits non-zero and leaves no process behind; a server killed with SIGKILL leaves no engine
core behind either; SIGTERM sent to the server's whole process group (``timeout``, systemd)
is a clean stop (exit 0), not an engine death."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.distributed.conftest import CONFIGS

CONTEXT = 4096  # long enough that the requests below are still running when the core dies


@pytest.fixture
def model(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps({**CONFIGS["llama"], "max_position_embeddings": CONTEXT}))
    return str(tmp_path)


def _start(model: str, new_session: bool = False):
    from tandem.config import embedded_default_model
    from tandem.entrypoints.openai.testing import RemoteServer

    return RemoteServer([model, "--tokenizer", embedded_default_model(), "--load-format", "dummy", "--num-kv-blocks",
                         "2048", "--max-model-len", str(CONTEXT), "--dtype", "float32", "--device", "cpu",
                         "--data-parallel-size", "2"], env={"TANDEM_STARTUP_TIMEOUT_S": "300"},
                        new_session=new_session)


def _gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_killed_engine_core_fails_requests_and_server_exits(model):
    srv = _start(model)
    try:
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        cores = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
        assert len(cores) == 2, [p.cmdline() for p in children]
        body = {"prompt": [11, 12, 13], "max_tokens": CONTEXT - 16, "ignore_eos": True, "temperature": 0}
        results: dict = {}
        started = threading.Event()

        def streaming() -> None:
            lines = []
            with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()
            results["stream"] = lines

        def plain() -> None:
            results["plain"] = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)

        threads = [threading.Thread(target=streaming), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert started.wait(60)
        time.sleep(0.5)
        os.kill(cores[0].pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
        lines = results["stream"]
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][len("data: "):])
        assert err["error"]["code"] == 500 and "engine" in err["error"]["message"]
        # One request was on the killed replica, the other on the survivor, stopped with it.
        r = results["plain"]
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError", r.text
        try:
            assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass  # already gone
        assert srv.proc.wait(15) != 0
        assert _gone(children, 10) == []
    finally:
        srv.stop()


def test_sigkilled_server_leaves_no_engine_core(model):
    srv = _start(model)
    try:
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        assert len(children) >= 2
        srv.proc.kill()
        srv.proc.wait(10)
        assert _gone(children, 15) == []
    finally:
        srv.stop()


def test_sigterm_to_the_process_group_is_a_clean_stop(model):
    srv = _start(model, new_session=True)
    try:
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        os.killpg(srv.proc.pid, signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log()[-3000:]
        assert "died" not in srv.log() and "exited" not in srv.log()
        assert _gone(children, 10) == []
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def loading_server():
    """``tandem serve`` of the embedded model, polled from its start: the statuses ``/health``
    gave (None: no connection) until the first 200."""
    import subprocess
    import sys

    from tandem.entrypoints.openai.testing import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.entrypoints.cli", "serve", "--port", str(port),
                             "--max-model-len", "512", "--kv-cache-memory-gib", "0.25", "--device", "cpu"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    statuses: list[int | None] = []
    deadline = time.monotonic() + 240
    try:
        while not statuses or statuses[-1] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            try:
                statuses.append(httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code)
            except httpx.TransportError:
                statuses.append(None)
            time.sleep(0.2)
        yield proc, statuses
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_health_is_503_while_the_model_loads(loading_server):
    _, statuses = loading_server
    answered = [s for s in statuses if s is not None]
    assert answered[0] == 503 and set(answered) == {503, 200}, statuses
    # Once listening, it never refuses a connection.
    assert None not in statuses[statuses.index(503):], statuses


def test_sigterm_of_an_idle_server_exits_within_3_s(loading_server):
    proc, _ = loading_server
    children = psutil.Process(proc.pid).children(recursive=True)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(30)
    took = time.monotonic() - start
    assert code == 0 and took < 3.0, (code, took, proc.stderr.read()[-2000:])
    assert _gone(children, 3) == []


def test_sigterm_while_loading_is_a_clean_stop():
    import subprocess
    import sys

    from tandem.entrypoints.openai.testing import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.entrypoints.cli", "serve", "--port", str(port),
                             "--max-model-len", "512", "--device", "cpu"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        status = None
        while status is None and time.monotonic() < deadline:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
            except httpx.TransportError:
                time.sleep(0.1)
        assert status == 503
        children = psutil.Process(proc.pid).children(recursive=True)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        err = proc.stderr.read()
        assert code == 0 and time.monotonic() - start < 3.0, err[-2000:]
        assert "Traceback" not in err and "exited" not in err and "died" not in err, err[-2000:]
        assert _gone(children, 3) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
