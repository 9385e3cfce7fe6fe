"""Stopping ``tandem serve`` (embedded SmolLM2, fp32, CPU) with ``--shutdown-timeout``
(vLLM's flag): with a timeout, SIGTERM drains: new ``/v1`` requests and ``/health`` get 503
while the requests in flight (streamed and not) run to their full length, then the server
exits 0 and leaves no process behind, also with two API servers signalled through their
process group; what is left at the timeout, or when a second signal comes, is aborted (HTTP
500; a stream with an error event, then ``[DONE]``), as everything is at once with timeout 0."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.entrypoints.test_api_server_manager import _per_api_server

ARGS = ["--max-model-len", "512", "--kv-cache-memory-gib", "0.25", "--dtype", "float32", "--device", "cpu"]
MAX_TOKENS = 200
DRAIN_S = 120  # far longer than the generations: a drained request never meets the timeout


def _start(shutdown_timeout: int, *extra: str, new_session: bool = False):
    from tandem.entrypoints.openai.testing import RemoteServer

    return RemoteServer([*ARGS, "--shutdown-timeout", str(shutdown_timeout), *extra], new_session=new_session)


def _gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


class _Requests:
    """Long completions (``ignore_eos``) on threads: ``streams`` streamed ones, each on a
    connection of its own, and ``plain`` non-streamed ones."""

    def __init__(self, url: str, streams: int, plain: int, max_tokens: int = MAX_TOKENS) -> None:
        self.url = url
        self.lines: list[list[str]] = [[] for _ in range(streams)]
        self.responses: list[httpx.Response] = []
        self._first = threading.Semaphore(0)
        body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        self.threads = [threading.Thread(target=self._stream, args=(body, i)) for i in range(streams)]
        self.threads += [threading.Thread(target=self._plain, args=(body,)) for _ in range(plain)]
        self.count = streams + plain
        for t in self.threads:
            t.start()

    def _stream(self, body: dict, i: int) -> None:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    if not self.lines[i]:
                        self._first.release()
                    self.lines[i].append(line)

    def _plain(self, body: dict) -> None:
        self.responses.append(httpx.post(f"{self.url}/v1/completions", json=body, timeout=120))

    def wait_first_chunks(self) -> None:
        for _ in self.lines:
            assert self._first.acquire(timeout=120)

    def wait_started(self) -> None:
        """Until every stream has its first chunk and every request is in the engine (one
        API server)."""
        self.wait_first_chunks()
        deadline = time.monotonic() + 60
        while httpx.get(f"{self.url}/debug/engine_stats", timeout=30).json()["num_live_requests"] < self.count:
            assert time.monotonic() < deadline, "the requests never all reached the engine"
            time.sleep(0.05)

    def join(self) -> None:
        for t in self.threads:
            t.join(120)
            assert not t.is_alive()


def _chunks(lines: list[str]) -> list[dict]:
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def _assert_complete(reqs: _Requests, max_tokens: int = MAX_TOKENS) -> None:
    for lines in reqs.lines:
        chunks = _chunks(lines)
        assert not any("error" in c for c in chunks), chunks[-1]
        assert chunks[-1]["usage"]["completion_tokens"] == max_tokens, chunks[-1]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    for r in reqs.responses:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == max_tokens
        assert r.json()["choices"][0]["finish_reason"] == "length"


def _assert_aborted(reqs: _Requests) -> None:
    for lines in reqs.lines:
        chunks = _chunks(lines)
        err = chunks[-1]["error"]
        assert err["code"] == 500 and "stopping" in err["message"], err
        assert len(chunks) - 1 < MAX_TOKENS
    for r in reqs.responses:
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError", r.text
        assert "stopping" in r.json()["error"]["message"]


def _wait_health_503(url: str, timeout: float = 10.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while (r := httpx.get(f"{url}/health", timeout=5)).status_code == 200:
        assert time.monotonic() < deadline, "/health still answers 200"
        time.sleep(0.05)
    return r


def _assert_refused(url: str) -> None:
    """A new request during the drain: 503, OpenAI-shaped, and /health 503."""
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2}, timeout=10)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "ServiceUnavailableError" and err["code"] == 503 and "shutting down" in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}
    assert _wait_health_503(url).json()["error"]["code"] == 503


def test_sigterm_drains_the_requests_in_flight_then_exits_0():
    srv = _start(DRAIN_S)
    try:
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        reqs = _Requests(srv.url, streams=3, plain=1)
        reqs.wait_started()
        srv.proc.send_signal(signal.SIGTERM)
        _wait_health_503(srv.url)
        _assert_refused(srv.url)
        assert all(t.is_alive() for t in reqs.threads)  # refused while the drain ran
        reqs.join()
        _assert_complete(reqs)
        assert srv.proc.wait(30) == 0, srv.log()[-3000:]
        assert _gone(children, 10) == []
        log = srv.log()
        assert f"draining 4 request(s) in flight for up to {DRAIN_S} s" in log, log[-3000:]
        assert "4 request(s) finished, 0 aborted; 1 new request(s) refused" in log, log[-3000:]
    finally:
        srv.stop()


@pytest.mark.parametrize("shutdown_timeout", [0, 1])
def test_what_is_in_flight_at_the_timeout_is_aborted(shutdown_timeout):
    """0 (the default, vLLM's): aborted at once; 1: after a second of drain."""
    srv = _start(shutdown_timeout)
    try:
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        # Far more than a second of generation: still running at the timeout.
        reqs = _Requests(srv.url, streams=1, plain=1, max_tokens=480)
        reqs.wait_started()
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        reqs.join()
        took = time.monotonic() - start
        _assert_aborted(reqs)
        assert took >= shutdown_timeout and took < shutdown_timeout + 10, took
        assert srv.proc.wait(30) == 0, srv.log()[-3000:]
        assert _gone(children, 10) == []
        if shutdown_timeout:
            assert "0 request(s) finished, 2 aborted" in srv.log(), srv.log()[-3000:]
    finally:
        srv.stop()


def test_a_second_signal_aborts_the_drain_at_once():
    srv = _start(DRAIN_S)
    try:
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        reqs = _Requests(srv.url, streams=1, plain=1, max_tokens=480)
        reqs.wait_started()
        srv.proc.send_signal(signal.SIGTERM)
        _wait_health_503(srv.url)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)  # Ctrl-C
        reqs.join()
        assert time.monotonic() - start < 5
        _assert_aborted(reqs)
        assert srv.proc.wait(30) == 0, srv.log()[-3000:]
        assert _gone(children, 10) == []
        assert "0 request(s) finished, 2 aborted" in srv.log(), srv.log()[-3000:]
    finally:
        srv.stop()


def test_two_api_servers_drain_on_sigterm_to_the_process_group():
    """The group's SIGTERM reaches the launcher and both API servers, then the launcher
    forwards its own: the API servers drain all the same."""
    srv = _start(DRAIN_S, "--api-server-count", "2", new_session=True)
    try:
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        batches = []
        for _ in range(6):  # new connections until both API servers hold a stream
            batches.append(_Requests(srv.url, streams=2, plain=0))
            batches[-1].wait_first_chunks()
            if all(s["num_live_requests"] > 0 for s in _per_api_server(srv.url).values()):
                break
        else:
            pytest.fail("the streams never reached both API servers")
        os.killpg(srv.proc.pid, signal.SIGTERM)
        _wait_health_503(srv.url)
        time.sleep(1.0)  # one API server drains: the other, signalled with it, surely does by now
        _assert_refused(srv.url)
        for b in batches:
            b.join()
            _assert_complete(b)
        assert srv.proc.wait(30) == 0, srv.log()[-3000:]
        assert _gone(children, 10) == []
        assert srv.log().count(" 0 aborted;") == 2, srv.log()[-3000:]
    finally:
        srv.stop()
