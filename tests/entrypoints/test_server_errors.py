"""Bad input gets HTTP 400 with an OpenAI-style body naming the field (never a 500), unknown
models and routes 404, and the server keeps serving afterwards."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.chat_cases import BAD_MESSAGES, GOOD_MESSAGES

MODEL_NAME = "SmolLM2-135M-Instruct"  # as served by the conftest fixture
EIGHT_TOKENS = [504, 3458, 282, 4649, 314, 1345, 30, 216]

BAD_COMPLETIONS = {
    "temperature < 0": {"prompt": "Hi", "temperature": -0.5},
    "top_p > 1": {"prompt": "Hi", "top_p": 1.5},
    "top_p = 0": {"prompt": "Hi", "top_p": 0},
    "top_k < -1": {"prompt": "Hi", "top_k": -5},
    "min_p > 1": {"prompt": "Hi", "min_p": 2.0},
    "n = 0": {"prompt": "Hi", "n": 0},
    "max_tokens < 0": {"prompt": "Hi", "max_tokens": -1},
    "max_tokens not an int": {"prompt": "Hi", "max_tokens": "many"},
    "presence_penalty > 2": {"prompt": "Hi", "presence_penalty": 3},
    "frequency_penalty < -2": {"prompt": "Hi", "frequency_penalty": -2.5},
    "repetition_penalty <= 0": {"prompt": "Hi", "repetition_penalty": 0},
    "logprobs < 0": {"prompt": "Hi", "logprobs": -1},
    "logprobs > 20": {"prompt": "Hi", "logprobs": 21},
    "min_tokens > max_tokens": {"prompt": "Hi", "max_tokens": 2, "min_tokens": 5},
    "logit_bias id >= vocab": {"prompt": "Hi", "logit_bias": {"49152": 5}},
    "logit_bias id < 0": {"prompt": "Hi", "logit_bias": {"-1": 5}},
    "logit_bias not an id": {"prompt": "Hi", "logit_bias": {"hello": 5}},
    "logit_bias value > 100": {"prompt": "Hi", "logit_bias": {"42": 500}},
    "stop_token_ids outside vocab": {"prompt": "Hi", "stop_token_ids": [10**7]},
    "prompt token outside vocab": {"prompt": [1, 2, 10**6]},
    "negative prompt token": {"prompt": [1, -2]},
    "empty prompt list": {"prompt": []},
    "empty prompt string": {"prompt": ""},
    "missing prompt": {"max_tokens": 3},
    "empty stop string": {"prompt": "Hi", "stop": [""]},
    "best_of > n": {"prompt": "Hi", "best_of": 3},
    "stream_options without stream": {"prompt": "Hi", "stream_options": {"include_usage": True}},
    "suffix": {"prompt": "Hi", "suffix": "tail"},
    "prompt too long for max_tokens": {"prompt": EIGHT_TOKENS, "max_tokens": 2045},
    "prompt over the context": {"prompt": [42] * 2048},
}

BAD_CHAT = {
    "no messages": {"messages": []},
    "empty role": {"messages": [{"role": "", "content": "Hi"}]},  # any other role string is the template's
    # Without max_tokens, which once generated to the end of the context.
    "message without content": {"messages": [{"role": "user"}]},
    "image part": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    "top_logprobs without logprobs": {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 3},
    "top_logprobs > 20": {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 50},
    "temperature < 0": {"messages": [{"role": "user", "content": "Hi"}], "temperature": -1},
    "max_completion_tokens over the context": {"messages": [{"role": "user", "content": "Hi"}],
                                               "max_completion_tokens": 4096},
    "logit_bias outside vocab": {"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"999999": 1}},
    "tools": {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]},
}


def _assert_400(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert isinstance(err["message"], str) and err["message"]
    assert "param" in err
    return err


def _assert_alive(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("case", sorted(BAD_COMPLETIONS))
def test_bad_completion_requests(server, case):
    body = BAD_COMPLETIONS[case]
    for stream in (False,) if "without stream" in case else (False, True):
        _assert_400(httpx.post(f"{server.url}/v1/completions", json={**body, "stream": stream}, timeout=60))


@pytest.mark.parametrize("case", sorted(BAD_CHAT))
def test_bad_chat_requests(server, case):
    for stream in (False, True):
        _assert_400(httpx.post(f"{server.url}/v1/chat/completions", json={**BAD_CHAT[case], "stream": stream},
                               timeout=60))


# The whole-list cases (empty, not a list) are BAD_CHAT's; these name a field inside it.
MESSAGE_FIELD_CASES = sorted(case for case, (_, field) in BAD_MESSAGES.items() if field != "messages")


@pytest.mark.parametrize("case", MESSAGE_FIELD_CASES)
def test_malformed_messages_name_the_field(server, case):
    """The offline API's rule (``chat_utils``), as OpenAI answers: 400, ``param`` the field,
    on the chat endpoint (streaming or not) and ``/tokenize``."""
    messages, field = BAD_MESSAGES[case]
    for stream in (False, True):
        err = _assert_400(httpx.post(f"{server.url}/v1/chat/completions",
                                     json={"messages": messages, "max_tokens": 2, "stream": stream}, timeout=60))
        assert err["param"] == field and err["message"].startswith(f"{field}: "), err
    err = _assert_400(httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=60))
    assert err["param"] == field, err


def test_accepted_message_forms(server):
    """Each accepted form is the conversation as the template reads it (text parts joined with
    newlines, as vLLM joins them), and is answered."""
    def tokens(messages: list) -> list[int]:
        r = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    for case, (messages, want) in GOOD_MESSAGES.items():
        ids = tokens(messages)
        assert ids == tokens(want), case
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200, (case, r.text)
        assert r.json()["usage"] == {**r.json()["usage"], "prompt_tokens": len(ids), "completion_tokens": 1}, case


def test_invalid_json_and_bodies(server):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for content in (b"{not json", b"", b"[1, 2]", b"null", b'"text"', b"\xff\xfe",
                        b'{"prompt": "Hi", "temperature": Infinity}', b'{"prompt": "Hi", "top_p": NaN}',
                        b'{"prompt": "Hi", "logit_bias": ' + b"[" * 100000 + b"]" * 100000 + b"}"):
            _assert_400(httpx.post(f"{server.url}{path}", content=content,
                                   headers={"Content-Type": "application/json"}))
    _assert_400(httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]}))
    _assert_400(httpx.post(f"{server.url}/tokenize", json={}))
    _assert_alive(server.url)


def _assert_model_not_found(r: httpx.Response, name: str) -> None:
    assert r.status_code == 404, r.text
    assert r.json() == {"error": {"message": f"The model `{name}` does not exist.", "type": "NotFoundError",
                                  "param": "model", "code": 404}}


def test_unknown_model_is_404_on_every_endpoint(server):
    """As OpenAI and vLLM: 404 NotFoundError naming ``model``, streaming or not."""
    bodies = {"/v1/completions": {"prompt": "Hi", "max_tokens": 2},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
              "/tokenize": {"prompt": "Hi"}, "/detokenize": {"tokens": [42]}}
    for path, body in bodies.items():
        for stream in (False, True) if "completions" in path else (None,):
            extra = {} if stream is None else {"stream": stream}
            _assert_model_not_found(httpx.post(f"{server.url}{path}", json={**body, **extra, "model": "gpt-17"},
                                               timeout=60), "gpt-17")
    _assert_alive(server.url)


def test_errors_name_the_field(server):
    """Prompt errors name the field that holds the prompt (chat: ``messages``) and word the
    message with it; a prompt that fits alone but not with its budget, and a bad budget, name
    the budget field that was sent."""
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi " * 2100}]}
    for stream in (False, True):
        err = _assert_400(httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "stream": stream}, timeout=60))
        assert err["param"] == "messages" and "maximum context length" in err["message"], err
        err = _assert_400(httpx.post(f"{server.url}/v1/completions",
                                     json={"prompt": EIGHT_TOKENS, "max_tokens": 2045, "stream": stream}))
        assert err["param"] == "max_tokens" and err["message"].startswith("max_tokens is too large: "), err
        assert "8 tokens in the prompt" in err["message"] and "length of the prompt" in err["message"], err
        assert "messages" not in err["message"], err
        err = _assert_400(httpx.post(f"{server.url}/v1/completions", json={"prompt": [42] * 2048, "stream": stream}))
        assert err["param"] == "prompt" and "your prompt" in err["message"], err
        err = _assert_400(httpx.post(f"{server.url}/v1/chat/completions",
                                     json={**chat, "messages": [{"role": "user", "content": "Hi"}],
                                           "max_completion_tokens": 4096, "stream": stream}))
        assert err["param"] == "max_completion_tokens" and "in the messages" in err["message"], err
        assert err["message"].startswith("max_completion_tokens is too large: "), err
        assert "reduce max_completion_tokens" in err["message"] and "max_tokens " not in err["message"], err
    err = _assert_400(httpx.post(f"{server.url}/v1/completions", json={"prompt": ""}))
    assert err == {**err, "param": "prompt", "message": "prompt must contain at least one token."}, err
    for field in ("max_completion_tokens", "max_tokens"):
        err = _assert_400(httpx.post(f"{server.url}/v1/chat/completions",
                                     json={**chat, "messages": [{"role": "user", "content": "Hi"}], field: -1}))
        assert err["param"] == field and err["message"].startswith(f"{field} must be at least 1"), err


def test_context_length_message_numbers(server):
    err = _assert_400(httpx.post(f"{server.url}/v1/completions",
                                 json={"model": MODEL_NAME, "prompt": EIGHT_TOKENS, "max_tokens": 2045}))
    for number in ("2048", "8", "2045", "2053"):
        assert number in err["message"], err["message"]
    assert "This model's maximum context length is 2048 tokens" in err["message"]


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    assert e.value.status_code == 404
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                       temperature=-3.0)


def test_unknown_route_is_404(server):
    for method, path in (("GET", "/v2/nothing"), ("POST", "/v1/embeddings"), ("GET", "/")):
        r = httpx.request(method, f"{server.url}{path}")
        assert r.status_code == 404
        assert r.json()["error"]["code"] == 404


def test_server_still_answers(server):
    _assert_alive(server.url)
    assert httpx.get(f"{server.url}/health").status_code == 200
    stats = httpx.get(f"{server.url}/debug/engine_stats").json()
    assert stats["num_live_requests"] == 0 and stats["num_seqs_with_blocks"] == 0
