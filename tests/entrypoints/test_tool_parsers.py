"""Tool-call parsers: whole outputs, and streamed ones (any split of the text into
deltas gives the same content and calls)."""

from __future__ import annotations

import json

import pytest

from tandem.entrypoints.openai.tool_parsers import StreamingToolParser, extract_tool_calls, parser_for_chat_template

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes():
    content, calls = extract_tool_calls("hermes", HERMES)
    assert content.strip() == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"tz": "CET"})]
    assert len({c.id for c in calls}) == 2


def test_hermes_plain_and_broken():
    assert extract_tool_calls("hermes", "Just text.") == ("Just text.", [])
    text = "<tool_call>{not json}</tool_call> rest"
    assert extract_tool_calls("hermes", text) == (text, [])
    # Cut by max_tokens inside a call: no call, the text stays content.
    content, calls = extract_tool_calls("hermes", 'a <tool_call>{"name": "f", "argu')
    assert calls == [] and content == 'a <tool_call>{"name": "f", "argu'


def test_llama3_json():
    content, calls = extract_tool_calls("llama3_json", LLAMA)
    assert content is None
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert extract_tool_calls("llama3_json", '{"name": "f", "parameters": {"x": 1}}')[1][0].arguments == '{"x": 1}'
    assert extract_tool_calls("llama3_json", "Hello {there}") == ("Hello {there}", [])
    assert extract_tool_calls("llama3_json", '{"nam": 1}') == ('{"nam": 1}', [])


def test_unknown_parser():
    with pytest.raises(ValueError, match="tool_call_parser"):
        extract_tool_calls("mistral", "")


def _stream(parser, text, size):
    p = StreamingToolParser(parser)
    content, calls = "", []
    for i in range(0, len(text), size):
        c, k = p.feed(text[i:i + size])
        content += c
        calls += k
    c, k = p.finish()
    return content + c, _calls(calls + k)


@pytest.mark.parametrize("parser, text", [("hermes", HERMES), ("llama3_json", LLAMA),
                                          ("hermes", "no calls here <tool"), ("llama3_json", "plain <|python answer"),
                                          ("hermes", 'x <tool_call>{"name": "f", "arguments": {}}</tool_call> y')])
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streaming_equals_whole(parser, text, size):
    content, calls = extract_tool_calls(parser, text)
    s_content, s_calls = _stream(parser, text, size)
    assert s_calls == _calls(calls)
    assert s_content == (content or "")


def test_hermes_streams_content_before_the_call():
    p = StreamingToolParser("hermes")
    assert p.feed("Hello <tool") == ("Hello ", [])  # a possible tag is held back
    assert p.feed("_call>{\"name\": \"f\", ") == ("", [])
    content, calls = p.feed('"arguments": {"a": 1}}</tool_call>')
    assert content == "" and _calls(calls) == [("f", {"a": 1})]


def test_parser_for_chat_template():
    assert parser_for_chat_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_chat_template("<tool_call>") == "hermes"
    assert parser_for_chat_template(None) == "hermes"
