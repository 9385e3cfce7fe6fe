"""``use_beam_search`` through ``tandem serve`` (the conftest's server, fp32), as vLLM's
clients send it: completions and chat answer with the beams of ``LLM.beam_search``, best
first; fields a beam search cannot honour get a 400 naming them."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tandem import BeamSearchParams
from tests.conftest import make_llm

MODEL_NAME = "SmolLM2-135M-Instruct"  # as served by the conftest fixture
PROMPTS = ["The capital of France is", "def add(a, b):"]
BEAM = {"model": MODEL_NAME, "use_beam_search": True, "n": 3, "max_tokens": 8, "ignore_eos": True,
        "length_penalty": 0.0}


@pytest.fixture(scope="module")
def offline():
    m = make_llm()
    yield m
    m.engine.shutdown()


def _post(server, endpoint: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=300)


def test_completions_answer_with_the_offline_beams(server, offline):
    r = _post(server, "completions", {**BEAM, "prompt": PROMPTS})
    assert r.status_code == 200, r.text
    body = r.json()
    want = offline.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True,
                                                         length_penalty=0.0))
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(6))
    assert [c["text"] for c in choices] == [s.text for o in want for s in o.sequences]
    assert {c["finish_reason"] for c in choices} == {"length"}
    assert body["usage"]["completion_tokens"] == 6 * 8


def test_chat_answers_with_the_best_beam_first_and_ends_at_eos(server, offline):
    messages = [{"role": "user", "content": "Say hi."}]
    r = _post(server, "chat/completions", {"model": MODEL_NAME, "messages": messages, "use_beam_search": True,
                                           "n": 2, "max_tokens": 24})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    tok = offline.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    (want,) = offline.beam_search({"prompt_token_ids": ids}, BeamSearchParams(beam_width=2, max_tokens=24))
    assert [c["message"]["content"] for c in choices] == [s.text for s in want.sequences]
    assert choices[0]["finish_reason"] == "stop" and choices[0]["message"]["content"]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_streamed_beam_search_sends_the_same_choices(server, endpoint):
    """Streamed, each choice comes whole once the search ends (as vLLM streams it), equal
    to the plain answer; the usage chunk counts the same tokens."""
    body = {**BEAM, "n": 2}
    body.update({"prompt": PROMPTS[0]} if endpoint == "completions" else
                {"messages": [{"role": "user", "content": "Name a color."}]})
    plain = _post(server, endpoint, body)
    assert plain.status_code == 200, plain.text
    r = _post(server, endpoint, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts, finish = {}, {}
    for ch in chunks[:-1]:
        for c in ch["choices"]:
            piece = c["text"] if "text" in c else c["delta"].get("content") or ""
            texts[c["index"]] = texts.get(c["index"], "") + piece
            if c.get("finish_reason"):
                finish[c["index"]] = c["finish_reason"]
    want = {c["index"]: c["text"] if "text" in c else c["message"]["content"] for c in plain.json()["choices"]}
    assert texts == want
    assert finish == {c["index"]: c["finish_reason"] for c in plain.json()["choices"]}
    assert chunks[-1]["usage"]["completion_tokens"] == plain.json()["usage"]["completion_tokens"]


@pytest.mark.parametrize("endpoint, extra, param", [
    ("completions", {"logprobs": 2}, "logprobs"),
    ("completions", {"stop": ["\n"]}, "stop"),
    ("completions", {"n": 11}, "n"),
    ("completions", {"max_tokens": 2048}, "max_tokens"),
    ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat/completions", {"presence_penalty": 0.5}, "presence_penalty"),
])
def test_what_beam_search_cannot_honour_is_a_400(server, endpoint, extra, param):
    body = {**BEAM, **extra}
    body.update({"prompt": PROMPTS[0]} if endpoint == "completions" else
                {"messages": [{"role": "user", "content": "Hi"}]})
    r = _post(server, endpoint, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError"
    assert err["param"] == param and err["message"].startswith(param), err


def test_a_client_that_leaves_aborts_the_beam_search(server):
    """The client drops a long beam search: no more rounds run, every request and KV block
    of it is freed."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={**BEAM, "prompt": PROMPTS[0], "max_tokens": 400}, timeout=2)
    deadline = time.monotonic() + 30
    while True:
        stats = httpx.get(f"{server.url}/debug/engine_stats", timeout=30).json()
        idle = stats["num_running"] == stats["num_waiting"] == stats["num_seqs_with_blocks"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, stats
    time.sleep(1.0)  # no later round starts: no sequence admitted since
    later = httpx.get(f"{server.url}/debug/engine_stats", timeout=30).json()
    assert later["prefix_cache_queries"] == stats["prefix_cache_queries"], (stats, later)
    assert later["num_running"] == later["num_waiting"] == 0 and later["kv_cache_usage"] == 0.0, later
