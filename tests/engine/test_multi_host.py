"""Two hosts behind one endpoint, on one machine: a head ``tandem serve`` and a
``--headless`` one, separate process trees (sessions) over loopback TCP on distinct ports;
tiny random MoE models, data parallelism + expert parallelism + dual-batch overlap over
gloo.

* Through the ``openai`` client: 16 concurrent greedy requests give the single-process
  offline tokens; streaming and n=2 too; a third of the streams cut mid-way give every
  replica's KV blocks back on both hosts; ``/metrics`` has every replica, by host.
* Faults: a ``kill -9`` of the headless tree fails the requests in flight (HTTP 500 / a
  stream error event, then ``[DONE]``), ``/health`` answers 503, the head exits non-zero
  within 10 s; a ``kill -9`` of the head takes the headless host down within 10 s. No process
  of either tree is left behind.
* A host whose configuration differs is refused with one line naming the field; ranks
  whose host never joins make the head exit with one line.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest

from tandem.distributed.launch import free_port
from tests.distributed.conftest import CONFIGS, ENGINE, make_llm
from tests.hosts import Host, wait_healthy

MAX_TOKENS = 10
PROMPTS = [list(range(7 + i, 7 + i + n)) for i, n in enumerate([5, 23, 11, 2, 37, 8, 14, 3])] * 2  # 16
DBO = ["--enable-dbo", "--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "8"]
EXIT_WITHIN_S = 10.0


def _engine_args(model: str, rpc_port: int, dp: int, local: int) -> list[str]:
    from tandem.config import embedded_default_model

    return [model, "--tokenizer", embedded_default_model(), "--load-format", "dummy", "--block-size", "8",
            "--num-kv-blocks", "256", "--max-model-len", str(ENGINE["max_model_len"]), "--dtype", "float32",
            "--device", "cpu", "--data-parallel-size", str(dp), "--data-parallel-size-local", str(local),
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
            "--enable-expert-parallel", "--all2all-backend", "all_to_all"]


@pytest.fixture
def two_hosts(tmp_path):
    """``start(family, dp, local, extra)``: a head with ``local`` replicas and a headless host
    with the rest; returns (url, head, headless)."""
    trees: list[Host] = []
    shm = set(os.listdir("/dev/shm"))

    def start(family: str, dp: int = 4, local: int = 2, extra: list[str] = ()):
        model = tmp_path / family
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps(CONFIGS[family]))
        port, rpc = free_port(), free_port()
        args = [*_engine_args(str(model), rpc, dp, local), *extra]
        head = Host([*args, "--host", "127.0.0.1", "--port", str(port)])
        headless = Host([*args, "--headless", "--data-parallel-start-rank", str(local)])
        trees.extend([head, headless])
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, [head, headless])
        return url, head, headless, str(model)

    yield start
    for t in trees:
        t.close()
    assert not set(os.listdir("/dev/shm")) - shm  # no shared-memory file left behind on either host


def _offline(model: str, prompts, n: int = 1) -> list[list[str]]:
    from tandem.sampling_params import SamplingParams

    llm = make_llm(model, num_kv_blocks=256)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n),
                            use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [[c.text for c in o.outputs] for o in outs]


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/debug/engine_stats", timeout=30).json()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_two_hosts_serve_the_single_process_tokens(two_hosts, family):
    from tests.entrypoints.test_server_parallel import cut_streams_and_wait_freed

    url, head, headless, model = two_hosts(family, extra=DBO)
    want = _offline(model, PROMPTS)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    extra = {"ignore_eos": True}

    async def concurrent() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
        res = await asyncio.gather(*(ac.completions.create(model=name, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                                           extra_body=extra) for p in PROMPTS))
        return [r.choices[0].text for r in res]

    assert asyncio.run(concurrent()) == [w[0] for w in want]
    replicas = _stats(url)["replicas"]
    assert len(replicas) == 4 and all(r["num_steps"] > 0 for r in replicas), replicas
    assert sum(r["num_dbo_steps"] for r in replicas) > 0, replicas  # steps were split

    stream = client.completions.create(model=name, prompt=PROMPTS[4], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, extra_body=extra)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want[4][0]
    two = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, n=2,
                                    extra_body=extra)
    assert [c.text for c in two.choices] == _offline(model, [PROMPTS[1]], n=2)[0]

    s = cut_streams_and_wait_freed(url, name, PROMPTS[::3])
    assert s["num_unfinished_seqs"] == 0 and s["num_seqs_with_blocks"] == 0, s
    assert all(r["num_free_blocks"] == r["num_usable_blocks"] for r in s["replicas"]), s

    metrics = httpx.get(f"{url}/metrics").text
    series = [line for line in metrics.splitlines() if line.startswith("tandem:kv_cache_usage_perc{")]
    assert sorted(line.split('engine="')[1].split('"')[0] for line in series) == ["0", "1", "2", "3"], series
    assert all('host="' in line and 'host=""' not in line for line in series), series


def _start_long_streams(url: str, model: str, n: int) -> tuple[list[threading.Thread], list[tuple[int, list[str]]]]:
    """``n`` streamed completions of 120 tokens, running once this returns (one has sent a
    first line); their threads, and each one's (HTTP status, SSE lines) once it ends."""
    started = threading.Event()
    results: list[tuple[int, list[str]]] = []

    def long_stream() -> None:
        body = {"prompt": [7, 8, 9], "max_tokens": 120, "stream": True, "ignore_eos": True, "model": model}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                started.set()
            results.append((r.status_code, lines))

    threads = [threading.Thread(target=long_stream) for _ in range(n)]
    for t in threads:
        t.start()
    assert started.wait(60)
    return threads, results


def _assert_each_ended_in_error(results: list[tuple[int, list[str]]]) -> None:
    """A stream: its error event (one line, saying that a rank or host is gone, without the
    transport's source text), then [DONE]; a request not yet streaming: HTTP 500."""
    for status, lines in results:
        if status == 200:
            events = [line for line in lines if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and '"error"' in events[-2], events[-3:]
            assert "\\n" not in events[-2], events[-2]
            assert re.search("lost the connection to another rank|is gone: no heartbeat", events[-2]), events[-2]
            assert ".cc:" not in events[-2], events[-2]
        else:
            assert status == 500 and '"error"' in lines[0], (status, lines)


def test_a_lost_headless_host_fails_requests_and_stops_the_head(two_hosts):
    url, head, headless, _ = two_hosts("deepseek_v2", dp=2, local=1, extra=DBO)
    name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    threads, results = _start_long_streams(url, name, 4)
    headless.kill9()
    t0 = time.monotonic()
    health = []
    while head.proc.poll() is None and time.monotonic() - t0 < EXIT_WITHIN_S + 5:
        try:
            health.append(httpx.get(f"{url}/health", timeout=1).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    for t in threads:
        t.join(30)
    assert head.wait_gone(EXIT_WITHIN_S + 5) <= EXIT_WITHIN_S + 5
    assert time.monotonic() - t0 <= EXIT_WITHIN_S + 1, head.text()[-3000:]
    assert head.proc.returncode != 0
    assert 503 in health, health
    assert len(results) == len(threads)
    assert any(status == 200 for status, _ in results), results  # in flight when the host was lost
    _assert_each_ended_in_error(results)
    headless.wait_gone(5)


def test_a_lost_head_stops_the_headless_host(two_hosts):
    url, head, headless, _ = two_hosts("qwen3_moe", dp=2, local=1)
    head.kill9()
    assert headless.wait_gone(EXIT_WITHIN_S) <= EXIT_WITHIN_S
    assert headless.proc.returncode != 0
    assert "stopping this host" in headless.text()


def test_a_differing_host_is_refused_and_missing_ranks_stop_the_head(tmp_path):
    model = tmp_path / "qwen3_moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIGS["qwen3_moe"]))
    rpc = free_port()
    args = _engine_args(str(model), rpc, 2, 1)
    head = Host([*args, "--host", "127.0.0.1", "--port", str(free_port())], env={"TANDEM_HOST_JOIN_TIMEOUT_S": "20"})
    bad = Host([*args, "--max-model-len", "64", "--headless", "--data-parallel-start-rank", "1"])
    try:
        assert bad.proc.wait(120) == 2
        last = bad.text().strip().splitlines()[-1]
        assert "refused this host: engine configuration differs: --max-model-len 128 (head) vs 64 (this host)" in last
        assert head.proc.wait(120) != 0
        assert "data-parallel ranks [1] did not join within 20 s" in head.text()
        head.wait_gone(10)
    finally:
        head.close()
        bad.close()


def test_sigterm_of_the_head_stops_every_host_cleanly(two_hosts):
    url, head, headless, _ = two_hosts("qwen3_moe", dp=2, local=1)
    head.proc.send_signal(signal.SIGTERM)
    assert head.wait_gone(EXIT_WITHIN_S) <= EXIT_WITHIN_S
    assert headless.wait_gone(EXIT_WITHIN_S) <= EXIT_WITHIN_S
    assert (head.proc.returncode, headless.proc.returncode) == (0, 0), headless.text()[-2000:]


def test_a_core_that_dies_while_the_head_waits_for_hosts_is_reported(tmp_path):
    model = tmp_path / "qwen3_moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIGS["qwen3_moe"]))
    head = Host([*_engine_args(str(model), free_port(), 2, 1), "--host", "127.0.0.1", "--port", str(free_port())],
                env={"TANDEM_HOST_JOIN_TIMEOUT_S": "300"})
    try:
        deadline = time.monotonic() + 120
        while "waiting up to" not in head.text() and time.monotonic() < deadline:
            time.sleep(0.2)
        head.record()
        cores = [pid for pid in head.pids if pid != head.proc.pid and "spawn_main" in " ".join(
            psutil.Process(pid).cmdline())]
        assert cores, head.text()[-2000:]
        os.kill(cores[0], signal.SIGKILL)
        assert head.wait_gone(EXIT_WITHIN_S) <= EXIT_WITHIN_S
        assert head.proc.returncode != 0 and "engine core process" in head.text(), head.text()[-2000:]
    finally:
        head.close()


def test_pipeline_stages_on_two_hosts_serve_the_single_process_tokens_and_a_lost_stage_host_stops_the_head(tmp_path):
    """``-pp 2`` with stage 0 on the head and stage 1 on a ``--headless`` host: concurrent
    requests give the single-process tokens, with batches in flight on both stages; a
    ``kill -9`` of the stage host fails the requests in flight and brings the head down
    non-zero, with no process of either tree left."""
    from tandem.config import embedded_default_model

    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIGS["llama"]))
    port, rpc = free_port(), free_port()
    args = [str(model), "--tokenizer", embedded_default_model(), "--load-format", "dummy", "--block-size", "8",
            "--num-kv-blocks", "256", "--max-model-len", str(ENGINE["max_model_len"]), "--dtype", "float32",
            "--device", "cpu", "--pipeline-parallel-size", "2", "--pipeline-parallel-size-local", "1",
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc)]
    head = Host([*args, "--host", "127.0.0.1", "--port", str(port)])
    headless = Host([*args, "--headless", "--pipeline-parallel-start-rank", "1"])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, [head, headless])
        want = [w[0] for w in _offline(str(model), PROMPTS)]
        name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]

        async def concurrent() -> list[str]:
            ac = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
            res = await asyncio.gather(*(ac.completions.create(model=name, prompt=p, max_tokens=MAX_TOKENS,
                                                               temperature=0, extra_body={"ignore_eos": True})
                                         for p in PROMPTS))
            return [r.choices[0].text for r in res]

        assert asyncio.run(concurrent()) == want
        (replica,) = _stats(url)["replicas"]
        assert replica["num_overlapped_steps"] > 0 and len(replica["pp_stage_busy_s"]) == 2, replica

        threads, results = _start_long_streams(url, name, 8)
        headless.kill9()
        for t in threads:
            t.join(60)
        assert head.wait_gone(EXIT_WITHIN_S + 5) <= EXIT_WITHIN_S + 5, head.text()[-3000:]
        assert head.proc.returncode != 0
        assert len(results) == len(threads)
        _assert_each_ended_in_error(results)
        headless.wait_gone(5)
    finally:
        head.close()
        headless.close()
