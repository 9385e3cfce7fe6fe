"""Structured outputs and tool calls through ``tandem serve`` and the real ``openai``
client: response_format and vLLM's guided_* / structured_outputs fields on both endpoints
(streamed == non-streamed, outputs validate), tool_choice named / required / auto with
tool_calls in the message and in stream deltas, and HTTP 400 naming the field for invalid
constraints, with nothing reaching the engine."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tandem.entrypoints.openai import protocol as P
from tandem.entrypoints.openai.structured_outputs import tool_plan

MODEL_NAME = "SmolLM2-135M-Instruct"  # as served by the conftest fixture

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
                   "sights": {"type": "array", "items": {"enum": ["museum", "tower", "park"]}, "minItems": 1,
                              "maxItems": 2}},
    "required": ["city", "population", "sights"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Local time of a timezone.",
    "parameters": {"type": "object", "properties": {"tz": {"enum": ["CET", "UTC", "PST"]}}, "required": ["tz"],
                   "additionalProperties": False}}}
USER = [{"role": "user", "content": "Tell me about Paris as JSON."}]


def _chat(client, stream: bool, max_tokens: int = 96, arrivals: list | None = None, **kw):
    """(content, tool_calls as [(name, arguments, id)], finish_reason) of choice 0.
    ``arrivals`` (streamed): gets (chunk number, that chunk's finish_reason) per call."""
    kw.update(model=MODEL_NAME, temperature=0, max_tokens=max_tokens)
    if not stream:
        r = client.chat.completions.create(stream=False, **kw)
        m = r.choices[0].message
        calls = [(t.function.name, t.function.arguments, t.id) for t in m.tool_calls or []]
        return m.content, calls, r.choices[0].finish_reason
    content, calls, finish = None, {}, None
    for n, chunk in enumerate(client.chat.completions.create(stream=True, **kw)):
        for c in chunk.choices:
            if c.delta.content:
                content = (content or "") + c.delta.content
            for t in c.delta.tool_calls or []:
                if t.index not in calls and arrivals is not None:
                    arrivals.append((n, c.finish_reason))
                entry = calls.setdefault(t.index, ["", "", None])
                if t.function and t.function.name:
                    entry[0] = t.function.name
                if t.function and t.function.arguments:
                    entry[1] += t.function.arguments
                entry[2] = entry[2] or t.id
            finish = c.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("fmt", ["json_schema", "json_schema_extra_body", "json_object"])
def test_chat_response_format(client, fmt):
    if fmt == "json_schema":
        kw = {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}}
    elif fmt == "json_schema_extra_body":
        kw = {"extra_body": {"structured_outputs": {"json": CITY, "disable_any_whitespace": True}}}
    else:
        kw = {"response_format": {"type": "json_object"}, "max_tokens": 160}
    whole = _chat(client, False, messages=USER, **kw)
    streamed = _chat(client, True, messages=USER, **kw)
    assert whole == streamed
    content, calls, finish = whole
    assert calls == []
    if finish == "stop" or fmt != "json_object":
        assert finish == "stop"
        value = json.loads(content)
        if fmt == "json_object":
            assert isinstance(value, dict)
        else:
            jsonschema.validate(value, CITY)


@pytest.mark.parametrize("field, value, check", [
    ("guided_regex", r"[0-9]{3}-[A-Z]{2}", lambda t: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", t)),
    ("guided_choice", ["red", "green", "blue"], lambda t: t in ("red", "green", "blue")),
    ("guided_json", CITY, lambda t: jsonschema.validate(json.loads(t), CITY) is None),
    ("guided_json", json.dumps(CITY), lambda t: jsonschema.validate(json.loads(t), CITY) is None),
    ("guided_grammar", 'root ::= "The answer is " [0-9]+ "."', lambda t: re.fullmatch(r"The answer is [0-9]+\.", t)),
    ("structured_outputs", {"regex": "(yes|no), because [a-z ]{1,20}\\."},
     lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", t)),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}},
     lambda t: jsonschema.validate(json.loads(t), CITY) is None),
])
def test_completions_constraints(client, field, value, check):
    kw = dict(model=MODEL_NAME, prompt="Question: a fact about Paris.\nAnswer:", max_tokens=96, temperature=0)
    extra = {field: value}
    r = client.completions.create(extra_body=extra, **kw)
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "stop", text
    assert check(text), text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, extra_body=extra, **kw)
                       if c.choices)
    assert streamed == text


def test_completions_n_and_batch_mixed_with_free(client):
    """Several prompts and n > 1 with a constraint; a free request alongside is unchanged."""
    kw = dict(model=MODEL_NAME, max_tokens=12, temperature=0)
    free_alone = client.completions.create(prompt="The capital of France is", **kw).choices[0].text
    r = client.completions.create(prompt=["Code A:", "Code B:"], n=2, temperature=1.0, seed=5, max_tokens=20,
                                  model=MODEL_NAME, extra_body={"guided_regex": "[A-Z]{3}[0-9]{2}"})
    assert len(r.choices) == 4
    assert all(re.fullmatch("[A-Z]{3}[0-9]{2}", c.text) for c in r.choices), [c.text for c in r.choices]
    assert client.completions.create(prompt="The capital of France is", **kw).choices[0].text == free_alone


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_named(client, stream):
    content, calls, finish = _chat(client, stream, messages=[{"role": "user", "content": "Weather in Rome?"}],
                                   tools=[WEATHER_TOOL, TIME_TOOL],
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert not content
    ((name, args, call_id),) = calls
    assert name == "get_weather" and call_id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(args), WEATHER_TOOL["function"]["parameters"])
    assert finish == "stop"


NOW_TOOL = {"type": "function", "function": {"name": "now", "description": "The current time.",
                                            "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL, NOW_TOOL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ROME_TOKYO = [{"role": "user", "content": "Weather in Rome and the time in Tokyo?"}]  # several calls, cut
OSLO = [{"role": "user", "content": "Call get_time for UTC and get_weather for Oslo."}]
# auto (hermes): two calls with a newline between them, forced by a regex.
TWO_HERMES_CALLS = r'(<tool_call>\{"name": "now", "arguments": \{\}\}</tool_call>\n){2}'
CALL_CASES = {
    "required, several calls": dict(messages=ROME_TOKYO, tool_choice="required", max_tokens=64),
    "required, one call then cut": dict(messages=OSLO, tool_choice="required", max_tokens=40),
    "required, parallel_tool_calls false": dict(messages=ROME_TOKYO, tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=48),
    "named": dict(messages=ROME_TOKYO, tool_choice={"type": "function", "function": {"name": "get_time"}},
                  max_tokens=32),
    "auto, two calls": dict(messages=ROME_TOKYO, extra_body={"guided_regex": TWO_HERMES_CALLS}, max_tokens=110),
}


def _complete_elements(text: str) -> list[tuple[str, dict]]:
    """The complete elements of a (possibly cut) JSON array: the longest prefix that,
    closed with ``]``, is a JSON array."""
    for end in sorted((i + 1 for i, ch in enumerate(text) if ch == "}"), reverse=True):
        try:
            return [(e["name"], e["parameters"]) for e in json.loads(text[:end] + "]")]
        except json.JSONDecodeError:
            continue
    return []


@pytest.mark.parametrize("case", sorted(CALL_CASES))
def test_tool_calls_streamed_equal_whole(client, case):
    """Every complete call is returned even when the output is cut, streamed as a delta
    once it completes (not at the end), whitespace around and between calls is no
    content, at most one call without parallel calls; streamed == non-streamed."""
    kw = dict(CALL_CASES[case], tools=TOOLS)
    content, calls, finish = _chat(client, False, **kw)
    arrivals = []
    s_content, s_calls, s_finish = _chat(client, True, arrivals=arrivals, **kw)
    assert content is None and s_content is None, (content, s_content)
    assert [c[:2] for c in s_calls] == [c[:2] for c in calls] and s_finish == finish
    assert calls, "tool_choice required / named / a call in the output: at least one call"
    for name, args, call_id in calls:
        jsonschema.validate(json.loads(args), SCHEMAS[name])
        assert call_id.startswith("chatcmpl-tool-")
    if kw.get("parallel_tool_calls") is False or isinstance(kw.get("tool_choice"), dict):
        assert len(calls) == 1
    assert arrivals[0][1] is None, "the first call arrived only with the finish"
    assert len({n for n, _ in arrivals}) == len(arrivals)  # each call in the chunk that completed it
    if kw.get("tool_choice") == "required":
        # The same constrained output as plain content: the calls are its complete elements.
        constraint = tool_plan(P.ChatCompletionRequest(**{k: v for k, v in kw.items() if k != "max_tokens"})).constraint
        raw = client.chat.completions.create(
            model=MODEL_NAME, temperature=0, max_tokens=kw["max_tokens"], messages=kw["messages"], tools=TOOLS,
            tool_choice="none", extra_body={"structured_outputs": {"json": constraint.json}}).choices[0]
        assert raw.finish_reason == ("stop" if finish == "tool_calls" else finish)
        assert [(n, json.loads(a)) for n, a, _ in calls] == _complete_elements(raw.message.content)
    if case == "required, several calls":
        assert len(calls) >= 2


def test_required_n2_each_choice_streamed_equal_whole(client):
    """n > 1: each choice its own calls (sampled, seeded), streamed == non-streamed."""
    kw = dict(model=MODEL_NAME, messages=OSLO, tools=TOOLS, tool_choice="required", n=2, temperature=0.8, seed=7,
              max_tokens=40)
    ref = client.chat.completions.create(**kw)
    whole = {c.index: [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
             for c in ref.choices}
    streamed: dict[int, dict[int, list]] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            assert not c.delta.content
            for t in c.delta.tool_calls or []:
                entry = streamed.setdefault(c.index, {}).setdefault(t.index, ["", ""])
                entry[0] += t.function.name or ""
                entry[1] += t.function.arguments or ""
    assert {i: [tuple(v) for _, v in sorted(calls.items())] for i, calls in streamed.items()} == whole
    assert sorted(whole) == [0, 1] and all(whole.values())


def test_tool_round_trip(client):
    """The call goes back as an assistant message with tool_calls, then a tool result."""
    first = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=64, messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = first.choices[0].message
    call = msg.tool_calls[0]
    second = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=16, tools=[WEATHER_TOOL],
        messages=[{"role": "user", "content": "Weather in Rome?"},
                  {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}])
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_auto_plain_answer(client):
    """auto with a model that answers in text: content, no calls (hermes parser)."""
    content, calls, finish = _chat(client, False, messages=[{"role": "user", "content": "Say hello."}],
                                   tools=[WEATHER_TOOL], max_tokens=12)
    if "<tool_call>" not in (content or ""):
        assert calls == [] and content


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


BAD = {
    "invalid json schema": ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    "json_schema without schema": ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),
    "unknown response_format": ("chat", {"response_format": {"type": "yaml"}}, "response_format"),
    "invalid regex": ("completion", {"guided_regex": "([a-z"}, "guided_regex"),
    "invalid guided_json text": ("completion", {"guided_json": "{nope"}, "guided_json"),
    "schema with a bad $ref": ("completion", {"guided_json": {"$ref": "#/$defs/none"}}, "guided_json"),
    "empty choice": ("completion", {"guided_choice": []}, "guided_choice"),
    "invalid grammar": ("chat", {"guided_grammar": "root ::= missing"}, "guided_grammar"),
    "two constraints": ("completion", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    "structured_outputs unknown key": ("chat", {"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    "structured_outputs bad regex": ("completion", {"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    "whitespace pattern": ("completion", {"guided_whitespace_pattern": " *", "guided_regex": "a"},
                           "guided_whitespace_pattern"),
    "other backend": ("completion", {"guided_decoding_backend": "outlines", "guided_regex": "a"},
                      "guided_decoding_backend"),
    "tool_choice unknown function": ("chat", {"tools": [WEATHER_TOOL], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    "tool_choice without tools": ("chat", {"tool_choice": "required"}, "tool_choice"),
    "tool with invalid parameters": ("chat", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": 5}}}]}, "tools"),
    "tool_choice and response_format": ("chat", {"tools": [WEATHER_TOOL], "tool_choice": "required",
                                                 "response_format": {"type": "json_object"}}, "tool_choice"),
    "bad tool_choice string": ("chat", {"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_constraints_are_400_naming_the_field(server, case):
    endpoint, extra, param = BAD[case]
    body = {"model": MODEL_NAME, "max_tokens": 4, **extra}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "Hi"}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = "Hi"
        path = "/v1/completions"
    before = _metric(server.url, "tandem:prompt_tokens_total")
    for stream in (False, True):
        r = httpx.post(f"{server.url}{path}", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param, err
        assert err["type"] == "BadRequestError" and err["code"] == 400
    assert _metric(server.url, "tandem:prompt_tokens_total") == before  # nothing reached the engine
