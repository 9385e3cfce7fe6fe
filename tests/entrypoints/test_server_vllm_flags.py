"""``tandem serve`` started as vLLM users start it: ``--api-key`` (twice) keeps the ``/v1``
routes closed without one of the keys and never logs them, ``--chat-template`` replaces the
tokenizer's template (and gets messages of any role, as vLLM passes them),
``--no-enable-auto-tool-choice`` refuses tool_choice auto as vLLM without
``--enable-auto-tool-choice``, ``--return-tokens-as-token-ids`` is the default of the request
field. One server for the module."""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL_NAME = "SmolLM2-135M-Instruct"

KEYS = ("sk-tandem-first-4c1e9b", "sk-tandem-second-77d0a2")
WRONG_KEY = "sk-tandem-wrong-0b5f3e"
# Renders a conversation in a form no model's template has, so that its use is seen in the prompt.
TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tandem.entrypoints.openai.testing import RemoteServer

    template = tmp_path_factory.mktemp("template") / "template.jinja"
    template.write_text(TEMPLATE)
    args = ["--max-model-len", "512", "--kv-cache-memory-gib", "0.1", "--dtype", "float32", "--device", "cpu",
            "--served-model-name", MODEL_NAME, "--api-key", KEYS[0], "--api-key", KEYS[1],
            "--chat-template", str(template), "--no-enable-auto-tool-choice", "--return-tokens-as-token-ids"]
    # A key in the environment is not one of the server's when --api-key is given (as vLLM).
    with RemoteServer(args, env={"TANDEM_API_KEY": WRONG_KEY}) as srv:
        yield srv


def _headers(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("key", [None, WRONG_KEY, f"{KEYS[0]}x", KEYS[0][:-1], " ".join(KEYS)])
@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                          ("POST", "/v1/chat/completions"), ("GET", "/v1/no-such-route")])
def test_v1_routes_answer_401_without_a_right_key(server, method, path, key):
    body = {"model": MODEL_NAME, "prompt": "Hi", "messages": MESSAGES, "max_tokens": 1}
    r = httpx.request(method, f"{server.url}{path}", headers={**_headers(key), "X-Request-Id": "rid-1"},
                      json=body if method == "POST" else None, timeout=30)
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert error["type"] == "AuthenticationError" and error["code"] == 401 and error["param"] is None
    assert "API key" in error["message"]
    assert r.headers["www-authenticate"] == "Bearer" and r.headers["x-request-id"] == "rid-1"


def test_other_schemes_are_refused(server):
    for value in (f"Basic {KEYS[0]}", KEYS[0], f"Bearer{KEYS[0]}"):
        assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": value}).status_code == 401


@pytest.mark.parametrize("key", KEYS)
def test_either_key_is_accepted(server, key):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    out = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=2,
                                    temperature=0.0)
    assert out.usage.completion_tokens >= 1
    r = httpx.get(f"{server.url}/v1/models", headers={"authorization": f"bearer {key}"})  # scheme in any case
    assert r.status_code == 200


def test_openai_client_without_the_key_gets_an_authentication_error(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=WRONG_KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
def test_health_metrics_version_stay_open(server, path):
    assert httpx.get(f"{server.url}{path}").status_code == 200


def test_chat_template_replaces_the_tokenizers(server):
    headers = _headers(KEYS[0])
    expected = "[USER] What is the capital of France?\n[ASSISTANT]"
    tok = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, headers=headers).json()
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == expected
    assert httpx.get(f"{server.url}/tokenizer_info").json()["chat_template"] == TEMPLATE
    # The chat endpoint's prompt is the same tokens.
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=headers, timeout=120, json={
        "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["prompt_tokens"] == len(tok["tokens"])
    assert [int(next(iter(p))) for p in out["prompt_logprobs"][1:]] == tok["tokens"][1:]


def test_custom_roles_reach_the_template(server):
    """vLLM hands any role to the template; this one prints it in capitals."""
    headers = _headers(KEYS[0])
    messages = [{"role": "observation", "content": [{"type": "text", "text": "21 C in Rome"}]}, *MESSAGES]
    expected = "[OBSERVATION] 21 C in Rome\n[USER] What is the capital of France?\n[ASSISTANT]"
    tok = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, headers=headers).json()
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == expected
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=headers, timeout=120, json={
        "model": MODEL_NAME, "messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tok["tokens"])


def test_return_tokens_as_token_ids_is_the_default(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[0], max_retries=0, timeout=120)
    kw = dict(model=MODEL_NAME, prompt="The capital of France is", max_tokens=3, temperature=0.0, logprobs=2)
    default = client.completions.create(**kw).choices[0].logprobs
    assert all(t.startswith("token_id:") for t in default.tokens), default.tokens
    assert all(t.startswith("token_id:") for top in default.top_logprobs for t in top)
    # A request that says false gets the tokens' text.
    text = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": False}).choices[0].logprobs
    assert "".join(text.tokens) == client.completions.create(**kw).choices[0].text
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, temperature=0.0,
                                          logprobs=True, top_logprobs=1)
    assert all(e.token.startswith("token_id:") for e in chat.choices[0].logprobs.content)


def test_tool_choice_auto_is_refused_when_turned_off(server):
    headers = _headers(KEYS[0])
    for choice in ({}, {"tool_choice": "auto"}):  # left out with tools: auto
        r = httpx.post(f"{server.url}/v1/chat/completions", headers=headers, timeout=30, json={
            "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1, "tools": TOOLS, **choice})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tool_choice" and "--enable-auto-tool-choice" in error["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=headers, timeout=120, json={
        "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200, r.text


def test_keys_are_never_logged(server):
    """Run last in the module, after the requests above; also the startup lines, which say that keys are
    required."""
    httpx.get(f"{server.url}/v1/models", headers=_headers(WRONG_KEY))
    httpx.get(f"{server.url}/v1/models", headers=_headers(KEYS[1]))
    log = server.log()
    assert "the /v1 routes require an API key (2 accepted)" in log, log
    assert '"GET /v1/models HTTP/1.1" 401' in log, log  # the access log ran
    for key in (*KEYS, WRONG_KEY):
        assert key not in log, log
