"""``tandem serve --api-server-count 2`` with two engine cores (DP=2 over gloo, tiny random
Llama, CPU): concurrent greedy completions through the ``openai`` client equal the offline
single-process ones, requests are spread over both API-server processes and both replicas,
``/metrics`` sums over the API servers, streams cut mid-way give every replica's KV blocks
back; SIGTERM ends the live requests of every API server
(500 / stream error event then ``[DONE]``) and stops everything with exit 0; an engine core
killed mid-request fails the live requests of every API server (500 / stream error event
then ``[DONE]``) and everything exits non-zero; an API server killed stops the whole server
(as vLLM's does); a launcher killed with SIGKILL leaves no API server or core behind.
psutil checks that no process is left."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest

from tests.distributed.conftest import CONFIGS, PROMPTS
from tests.entrypoints.test_server_parallel import (LAYOUTS, MAX_TOKENS, _engine_args, _offline_texts,
                                                     cut_streams_and_wait_freed)

FLAGS = ["--data-parallel-size", "2", "--api-server-count", "2"]
ENV = {"TANDEM_STARTUP_TIMEOUT_S": "300"}
CONTEXT = 4096  # long enough that the fault tests' requests are still running when it strikes


def _model(tmp_path, family: str = "llama", **overrides) -> str:
    (tmp_path / "config.json").write_text(json.dumps({**CONFIGS[family], **overrides}))
    return str(tmp_path)


def _start(args: list[str], layout: list[str] = ()):
    from tandem.entrypoints.openai.testing import RemoteServer

    return RemoteServer([*args, *layout, *FLAGS], env=ENV)


def _processes(srv) -> tuple[list[psutil.Process], list[psutil.Process], list[psutil.Process]]:
    """(API servers, engine cores, every child) of a running server, once both API servers
    answer."""
    pids = {s["api_server"]["pid"] for s in _per_api_server(srv.url).values()}
    children = psutil.Process(srv.proc.pid).children(recursive=True)
    api = [p for p in children if p.pid in pids]
    cores = [p for p in children if p.pid not in pids and "spawn_main" in " ".join(p.cmdline())]
    assert len(api) == 2 and len(cores) == 2, [p.cmdline() for p in children]
    return api, cores, children


def _per_api_server(url: str, timeout: float = 60.0) -> dict[int, dict]:
    """``/debug/engine_stats`` of both API servers (a new connection each time: the kernel
    spreads connections over the servers' sockets by address hash; one still attaching to
    the cores answers 503)."""
    seen: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < 2 and time.monotonic() < deadline:
        r = httpx.get(f"{url}/debug/engine_stats", timeout=30)
        if r.status_code == 503:
            time.sleep(0.1)
            continue
        s = r.json()
        seen[s["api_server"]["index"]] = s
    assert sorted(seen) == [0, 1], seen
    return seen


def _gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_bind_sockets_share_a_free_port_and_refuse_a_used_one():
    from tandem.entrypoints.openai.api_server_manager import bind_sockets

    socks = bind_sockets("127.0.0.1", 0, 3)
    try:
        assert len({s.getsockname() for s in socks}) == 1
        # Another server's SO_REUSEPORT sockets on the port: refused, not joined.
        with pytest.raises(ConnectionError, match="cannot listen"):
            bind_sockets("127.0.0.1", socks[0].getsockname()[1], 2)
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("layout", ["dp2-llama", "dp2-ep-dbo-qwen3_moe"])
def test_two_api_servers_equal_offline_and_share_the_load(tmp_path, layout):
    family, flags = LAYOUTS[layout]
    model = _model(tmp_path, family)
    prompts = PROMPTS * 2
    want = _offline_texts(model, prompts)
    srv = _start(_engine_args(model), flags)
    try:
        api, cores, children = _processes(srv)  # both API servers serve before the load starts
        name = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY").models.list().data[0].id

        async def concurrent() -> list[str]:
            # A client per request: each its own connection, so both API servers get some.
            async def one(p) -> str:
                async with openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0,
                                              timeout=120) as ac:
                    r = await ac.completions.create(model=name, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                                    extra_body={"ignore_eos": True})
                    return r.choices[0].text

            return list(await asyncio.gather(*(one(p) for p in prompts)))

        assert asyncio.run(concurrent()) == want
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
        stream = client.completions.create(model=name, prompt=prompts[3], max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want[3]

        per = _per_api_server(srv.url)
        served = [per[i]["api_server"]["num_requests"] for i in (0, 1)]
        assert sum(served) == len(prompts) + 1 and min(served) > 0, served
        assert {per[i]["api_server"]["pid"] for i in (0, 1)} == {p.pid for p in api}
        assert all(r["num_steps"] > 0 for r in per[0]["replicas"]), per[0]["replicas"]  # both replicas served
        # /metrics of either API server counts the requests of both.
        assert _metric(srv.url, "tandem:request_success_total") == len(prompts) + 1
        assert _metric(srv.url, "tandem:generation_tokens_total") == (len(prompts) + 1) * MAX_TOKENS

        # Streams cut after their first chunk, on new connections (both API servers): every
        # replica's KV blocks come back.
        s = cut_streams_and_wait_freed(srv.url, name, prompts)
        assert s["num_unfinished_seqs"] == 0 and s["num_seqs_with_blocks"] == 0, s
        assert all(r["num_free_blocks"] == r["num_usable_blocks"] for r in s["replicas"]), s
        assert all(st["num_live_requests"] == 0 for st in _per_api_server(srv.url).values())

        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
        assert _gone(children, 10) == []
    finally:
        srv.stop()


def _long_streams(url: str, count: int, results: list, started: threading.Semaphore) -> list[threading.Thread]:
    body = {"prompt": [11, 12, 13], "max_tokens": CONTEXT - 16, "ignore_eos": True, "temperature": 0, "stream": True}

    def stream() -> None:
        lines = []
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        if not lines:
                            started.release()
                        lines.append(line)
        finally:
            results.append(lines)

    threads = [threading.Thread(target=stream) for _ in range(count)]
    for t in threads:
        t.start()
    return threads


def _long_requests_on_both_api_servers(srv) -> tuple[list[threading.Thread], list, dict]:
    """Long streams (new connections until both API servers hold live requests) and one
    long non-streaming request; returns (threads, the streams' lines, {"plain": response})."""
    results: list = []
    started = threading.Semaphore(0)
    threads = []
    for _ in range(10):
        threads += _long_streams(srv.url, 2, results, started)
        for _ in range(2):
            assert started.acquire(timeout=60)
        if all(s["num_live_requests"] > 0 for s in _per_api_server(srv.url).values()):
            break
    else:
        pytest.fail("the streams never reached both API servers")
    plain: dict = {}
    body = {"prompt": [5, 6], "max_tokens": CONTEXT - 16, "ignore_eos": True}
    t = threading.Thread(target=lambda: plain.setdefault("plain", httpx.post(f"{srv.url}/v1/completions", json=body,
                                                                            timeout=60)))
    t.start()
    time.sleep(0.5)
    return [*threads, t], results, plain


def _assert_all_failed(threads, results, plain, message: str) -> None:
    for th in threads:
        th.join(60)
    assert len(results) == len(threads) - 1
    for lines in results:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        err = json.loads(lines[-2][len("data: "):])
        assert err["error"]["code"] == 500 and message in err["error"]["message"], err
    r = plain["plain"]
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError", r.text
    assert message in r.json()["error"]["message"]


def _long_context_server(tmp_path):
    # (the later flags win)
    return _start(_engine_args(_model(tmp_path, max_position_embeddings=CONTEXT)) +
                  ["--num-kv-blocks", "2048", "--max-model-len", str(CONTEXT)])


def test_killed_engine_core_fails_every_api_servers_requests(tmp_path):
    srv = _long_context_server(tmp_path)
    try:
        api, cores, children = _processes(srv)
        threads, results, plain = _long_requests_on_both_api_servers(srv)
        os.kill(cores[0].pid, signal.SIGKILL)
        _assert_all_failed(threads, results, plain, "engine")
        assert srv.proc.wait(15) != 0
        assert _gone(children, 10) == []
    finally:
        srv.stop()


def test_sigterm_ends_live_requests_and_everyone_exits_0(tmp_path):
    srv = _long_context_server(tmp_path)
    try:
        api, cores, children = _processes(srv)
        threads, results, plain = _long_requests_on_both_api_servers(srv)
        srv.proc.send_signal(signal.SIGTERM)
        _assert_all_failed(threads, results, plain, "stopping")
        assert srv.proc.wait(20) == 0
        assert _gone(children, 10) == []
    finally:
        srv.stop()


def test_killed_api_server_stops_the_whole_server(tmp_path):
    srv = _start(_engine_args(_model(tmp_path)))
    try:
        api, cores, children = _processes(srv)
        os.kill(api[1].pid, signal.SIGKILL)
        assert srv.proc.wait(45) == 1
        assert _gone(children, 10) == []
        assert "API server(s) exited: 1 (signal 9 (SIGKILL: " in srv.log()
    finally:
        srv.stop()


def test_sigkilled_launcher_leaves_no_process(tmp_path):
    srv = _start(_engine_args(_model(tmp_path)))
    try:
        _, _, children = _processes(srv)
        srv.proc.kill()
        srv.proc.wait(10)
        assert _gone(children, 15) == []
    finally:
        srv.stop()
