"""200 concurrent streaming requests, a third of them disconnected mid-stream: the others
complete, the disconnected ones are aborted, and afterwards every KV block is free."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

MODEL_NAME = "SmolLM2-135M-Instruct"  # as served by the conftest fixture
NUM_REQUESTS = 200
MAX_TOKENS = 8
DISCONNECTED_MAX_TOKENS = 512  # would take minutes if disconnects did not abort


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def _one(c: httpx.AsyncClient, url: str, i: int) -> tuple[str, int, str | None]:
    disconnect = i % 3 == 0
    body = {"model": MODEL_NAME, "prompt": f"Request {i}: tell me a story about the number {i}.",
            "max_tokens": DISCONNECTED_MAX_TOKENS if disconnect else MAX_TOKENS, "temperature": 0.8, "seed": i,
            "ignore_eos": True, "stream": True}
    if i % 2:
        body["stream_options"] = {"include_usage": True}
    chunks, finish = 0, None
    async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return "done", chunks, finish
            obj = json.loads(data)
            assert "error" not in obj, obj
            for ch in obj["choices"]:
                chunks += 1
                finish = ch["finish_reason"] or finish
            if disconnect and chunks >= 2:
                return "disconnected", chunks, finish  # leaving the block closes the connection
    return "eof", chunks, finish


def test_200_concurrent_streams_with_disconnects(server):
    url = server.url
    before = httpx.get(f"{url}/metrics").text
    gen_before = _metric(before, "tandem:generation_tokens_total")

    async def main():
        limits = httpx.Limits(max_connections=NUM_REQUESTS + 10, max_keepalive_connections=NUM_REQUESTS + 10)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300.0)) as c:
            return await asyncio.gather(*(_one(c, url, i) for i in range(NUM_REQUESTS)))

    results = asyncio.run(main())
    for i, (state, chunks, finish) in enumerate(results):
        if i % 3 == 0:
            assert state == "disconnected", (i, state)
        else:
            assert state == "done" and finish == "length" and chunks == MAX_TOKENS, (i, state, chunks, finish)

    # The engine drains: no live request, no sequence holding blocks, every block free.
    deadline = time.monotonic() + 60
    while True:
        stats = httpx.get(f"{url}/debug/engine_stats").json()
        idle = (stats["num_live_requests"] == 0 and stats["num_unfinished_seqs"] == 0
                and stats["num_running"] == 0 and stats["num_waiting"] == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, stats
    assert stats["num_seqs_with_blocks"] == 0
    assert stats["num_free_blocks"] == stats["num_usable_blocks"]
    after = httpx.get(f"{url}/metrics").text
    assert _metric(after, "tandem:kv_cache_usage_perc") == 0.0
    assert _metric(after, "tandem:num_requests_running") == 0
    assert _metric(after, "tandem:num_requests_waiting") == 0
    # The disconnected requests stopped early instead of running to DISCONNECTED_MAX_TOKENS.
    num_kept = sum(1 for i in range(NUM_REQUESTS) if i % 3)
    generated = _metric(after, "tandem:generation_tokens_total") - gen_before
    assert generated < num_kept * MAX_TOKENS + (NUM_REQUESTS - num_kept) * 32, generated
    # ... and the server still serves.
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200


def test_non_streaming_disconnect_aborts(server):
    """A client that gives up on a non-streaming request aborts it too."""
    url = server.url

    async def main():
        async with httpx.AsyncClient(timeout=httpx.Timeout(1.5)) as c:
            body = {"model": MODEL_NAME, "prompt": "Write a very long essay.", "max_tokens": 2000, "ignore_eos": True}
            res = await asyncio.gather(*(c.post(f"{url}/v1/completions", json=body) for _ in range(4)),
                                       return_exceptions=True)
            assert all(isinstance(r, httpx.TimeoutException) for r in res), res

    asyncio.run(main())
    deadline = time.monotonic() + 15  # the four requests would need minutes to finish
    while True:
        stats = httpx.get(f"{url}/debug/engine_stats").json()
        if stats["num_live_requests"] == 0 and stats["num_seqs_with_blocks"] == 0:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    assert stats["num_free_blocks"] == stats["num_usable_blocks"]
