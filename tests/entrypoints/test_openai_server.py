"""``tandem serve`` through the real ``openai`` client: streamed == non-streamed, n, stop,
logprobs (also several tokens in one chunk, and batches mixing logprobs and none), usage,
request ids, tokenize/detokenize, metrics."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

MODEL_NAME = "SmolLM2-135M-Instruct"  # as served by the conftest fixture

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]
MAX_TOKENS = 10
LP_TOL = 2e-3  # batch composition may change fp32 reductions slightly


def _stream_completion(client, **kw):
    """Join a streamed completion per choice index: text, finish reason, logprobs, usage."""
    texts, finish, lps, usage, chunk_sizes = {}, {}, {}, None, []
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
            continue
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                assert c.index not in finish, "two finish reasons for one choice"
                finish[c.index] = c.finish_reason
            if c.logprobs is not None:
                d = lps.setdefault(c.index, {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})
                for k in d:
                    d[k] += getattr(c.logprobs, k)
                chunk_sizes.append(len(c.logprobs.tokens))
    return texts, finish, lps, usage, chunk_sizes


def _assert_lps_equal(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
        else:
            assert x == pytest.approx(y, abs=LP_TOL)


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    card = client.models.retrieve(MODEL_NAME)
    assert card.model_dump(exclude={"created"}) == models.data[0].model_dump(exclude={"created"})
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    r = httpx.get(f"{server.url}/v1/models/org/gpt-17")  # ids may hold slashes
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "The model `org/gpt-17` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_streamed_equals_non_streamed(client, prompt):
    ref = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    assert ref.object == "text_completion"
    (choice,) = ref.choices
    assert choice.index == 0 and choice.finish_reason in ("stop", "length")
    texts, finish, _, usage, _ = _stream_completion(client, model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                                    temperature=0.0)
    assert texts == {0: choice.text}
    assert finish == {0: choice.finish_reason}
    assert usage.prompt_tokens == ref.usage.prompt_tokens > 0
    assert usage.completion_tokens == ref.usage.completion_tokens > 0
    assert usage.total_tokens == ref.usage.total_tokens


def test_chat_streamed_equals_non_streamed(client):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Name three colors."}]
    ref = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0.0)
    assert ref.object == "chat.completion"
    (choice,) = ref.choices
    assert choice.message.role == "assistant" and choice.message.content
    text, roles, finish, usage = "", [], None, None
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0.0,
                                                stream=True, stream_options={"include_usage": True}):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        (c,) = chunk.choices
        if c.delta.role:
            roles.append(c.delta.role)
        text += c.delta.content or ""
        if c.finish_reason:
            finish = c.finish_reason
    assert roles == ["assistant"]
    assert text == choice.message.content
    assert finish == choice.finish_reason
    assert (usage.prompt_tokens, usage.completion_tokens) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)


def test_n4_with_stop_string(client):
    kw = dict(model=MODEL_NAME, prompt="List of fruits: apple, banana,", n=4, max_tokens=24, temperature=1.0,
              seed=1234, stop=[","])
    ref = client.completions.create(**kw)
    assert sorted(c.index for c in ref.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in ref.choices)
    assert any(c.finish_reason == "stop" for c in ref.choices)
    assert all("," not in c.text for c in ref.choices)
    texts, finish, _, usage, _ = _stream_completion(client, **kw)
    assert texts == {c.index: c.text for c in ref.choices}
    assert finish == {c.index: c.finish_reason for c in ref.choices}
    assert usage.completion_tokens == ref.usage.completion_tokens


def test_chat_n4_streamed_equals_non_streamed(client):
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Say something short."}], n=4, max_tokens=12,
              temperature=0.9, seed=7, stop=["."])
    ref = client.chat.completions.create(**kw)
    assert sorted(c.index for c in ref.choices) == [0, 1, 2, 3]
    texts, finish = {}, {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in ref.choices}
    assert finish == {c.index: c.finish_reason for c in ref.choices}


def test_completion_logprobs_streamed_equals_non_streamed(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, logprobs=3)
    ref = client.completions.create(**kw)
    (c,) = ref.choices
    n = ref.usage.completion_tokens
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs) == n
    assert "".join(c.logprobs.tokens) == c.text or c.finish_reason == "stop"
    for tok, lp, top in zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs):
        assert 3 <= len(top) <= 4 and top[tok] == lp  # greedy: the sampled token is the top one
        assert lp == pytest.approx(max(top.values()))
    texts, _, lps, _, _ = _stream_completion(client, **kw)
    assert texts[0] == c.text
    assert lps[0]["tokens"] == c.logprobs.tokens
    assert lps[0]["text_offset"] == c.logprobs.text_offset
    _assert_lps_equal(lps[0]["token_logprobs"], c.logprobs.token_logprobs)
    for a, b in zip(lps[0]["top_logprobs"], c.logprobs.top_logprobs):
        assert a.keys() == b.keys()
        _assert_lps_equal(list(a.values()), [b[k] for k in a])


def test_echo_logprobs_several_tokens_in_one_chunk(client):
    """With echo, the first chunk carries the prompt's tokens and the first sampled token."""
    prompt = "The quick brown fox jumps over the lazy dog"
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0.0, logprobs=1, echo=True)
    ref = client.completions.create(**kw)
    (c,) = ref.choices
    n_prompt = ref.usage.prompt_tokens
    assert c.text.startswith(prompt)
    assert len(c.logprobs.tokens) == n_prompt + ref.usage.completion_tokens
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(lp is not None for lp in c.logprobs.token_logprobs[1:])
    texts, _, lps, _, sizes = _stream_completion(client, **kw)
    assert sizes[0] > 1  # several tokens in one chunk
    assert texts[0] == c.text
    assert lps[0]["tokens"] == c.logprobs.tokens
    _assert_lps_equal(lps[0]["token_logprobs"], c.logprobs.token_logprobs)
    # echo + max_tokens 0 scores the prompt only (what lm-eval style loglikelihood needs)
    only = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    _assert_lps_equal(only.choices[0].logprobs.token_logprobs, c.logprobs.token_logprobs[:n_prompt])


def test_chat_logprobs_streamed_equals_non_streamed(client):
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=8,
              temperature=0.0, logprobs=True, top_logprobs=2)
    ref = client.chat.completions.create(**kw)
    content = ref.choices[0].logprobs.content
    assert len(content) == ref.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    _assert_lps_equal([e.logprob for e in streamed], [e.logprob for e in content])
    for a, b in zip(streamed, content):
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]


def test_batch_mixing_logprobs_and_none(server):
    """Concurrent requests, some with logprobs and some without, streamed and not: each equals
    its result when run alone."""

    async def run_one(c: openai.AsyncOpenAI, prompt: str, logprobs: int | None, stream: bool):
        kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=logprobs)
        if not stream:
            r = await c.completions.create(**kw)
            lp = r.choices[0].logprobs
            return r.choices[0].text, (lp.tokens, lp.token_logprobs) if lp else None
        text, toks, lps = "", [], []
        async for chunk in await c.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                text += ch.text
                if ch.logprobs is not None:
                    toks += ch.logprobs.tokens
                    lps += ch.logprobs.token_logprobs
        return text, (toks, lps) if logprobs is not None else None

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0) as c:
            solo = [await run_one(c, p, 2, False) for p in PROMPTS]
            jobs = [(i % len(PROMPTS), [None, 2, 0][i % 3], i % 2 == 0) for i in range(12)]
            mixed = await asyncio.gather(*(run_one(c, PROMPTS[p], lp, st) for p, lp, st in jobs))
            return solo, jobs, mixed

    solo, jobs, mixed = asyncio.run(main())
    for (p, lp, _), (text, lps) in zip(jobs, mixed):
        assert text == solo[p][0]
        if lp is None:
            assert lps is None
        else:
            assert lps[0] == solo[p][1][0]
            _assert_lps_equal(lps[1], solo[p][1][1])


def test_request_id_header(server):
    r = httpx.post(f"{server.url}/v1/completions", headers={"X-Request-Id": "my-req-42"},
                   json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "my-req-42"
    assert r.json()["id"] == "cmpl-my-req-42"
    # the same id again (even concurrently) is fine: engine ids are made unique
    r2 = httpx.post(f"{server.url}/v1/chat/completions", headers={"X-Request-Id": "my-req-42"},
                    json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r2.status_code == 200 and r2.json()["id"] == "chatcmpl-my-req-42"


def test_tokenize_detokenize(server):
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 2048
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"] == "Hello world"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > r["count"]
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] and info["chat_template"]


def test_metrics(server, client):
    client.completions.create(model=MODEL_NAME, prompt="Count: 1, 2, 3,", max_tokens=4, temperature=0.0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ["tandem:time_to_first_token_seconds_count", "tandem:time_per_output_token_seconds_count",
                 "tandem:inter_token_latency_seconds_count", "tandem:e2e_request_latency_seconds_count",
                 "tandem:num_requests_running", "tandem:num_requests_waiting", "tandem:kv_cache_usage_perc",
                 "tandem:prefix_cache_hit_rate", "tandem:prompt_tokens_total", "tandem:generation_tokens_total"]:
        assert name in text, name
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("tandem:") and "{" in line and "_bucket" not in line}
    assert values["tandem:e2e_request_latency_seconds_count"] >= 1
    assert values["tandem:generation_tokens_total"] >= 4
    assert values["tandem:prompt_tokens_total"] > 0
    assert values["tandem:deterministic"] == 0.0  # the server runs in the default mode


def test_prompt_logprobs_extension(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "One two three four",
                                                         "max_tokens": 2, "temperature": 0.0, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    plp = body["choices"][0]["prompt_logprobs"]
    assert len(plp) == body["usage"]["prompt_tokens"] and plp[0] is None
    for pos in plp[1:]:
        assert 1 <= len(pos) <= 2 and all(v["logprob"] <= 0.0 and v["rank"] >= 1 for v in pos.values())


# -------------------------------------------- OpenAI / vLLM semantics of unset fields
def test_empty_model_is_the_served_model(server, client):
    """The OpenAI SDK requires ``model``: ``""`` is how its users defer to the server."""
    r = client.completions.create(model="", prompt="Hi", max_tokens=2)
    assert r.model == MODEL_NAME and r.usage.completion_tokens == 2
    r = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.model == MODEL_NAME
    for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
        assert httpx.post(f"{server.url}{path}", json={"model": "", **body}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="Hi", max_tokens=2)


# 40 digits, one token each at least, and the grammar's end: a stop after more than 16 tokens.
FORTY_DIGITS = {"guided_regex": "([0-9] ){40}", "temperature": 0.0}


def test_completions_max_tokens_default_is_16(server):
    body = {"model": MODEL_NAME, "prompt": "Digits:", **FORTY_DIGITS}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"
    # An explicit null: up to the end of the context (vLLM).
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": None}, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] > 16


def test_chat_max_tokens_default_is_the_context(server):
    """Chat without max_tokens is bounded by the context only (vLLM's default)."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Digits, please."}], **FORTY_DIGITS}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] > 16
