"""Tool-call parsers: whole outputs, and streamed ones (any split of the text into
deltas gives the same content and calls)."""

from __future__ import annotations

import json

import pytest

from tandem.entrypoints.openai.tool_parsers import (CallArrayParser, StreamingToolParser, extract_tool_calls,
                                                    parse_whole, parser_for_chat_template)

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


# ---------------------------------------------------------------- cut outputs, whitespace
ARRAY = ('[\n  {"name": "get_weather", "parameters": {"city": "Paris", "note": "a}b"}},\n'
         '  {"name": "get_time", "parameters": {"tz": "CET"}}\n]')
ARRAY_CALLS = [("get_weather", {"city": "Paris", "note": "a}b"}), ("get_time", {"tz": "CET"})]


def _feed_all(parser, text, size):
    """(joined content, calls, index in ``text`` where each call was returned)."""
    content, calls, at = "", [], []
    for i in range(0, len(text), size):
        c, k = parser.feed(text[i:i + size])
        content += c
        calls += k
        at += [min(i + size, len(text))] * len(k)
    c, k = parser.finish()
    return content + c, _calls(calls + k), at + [None] * len(k)


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_call_array_streams_each_element_when_complete(size):
    content, calls, at = _feed_all(CallArrayParser(), ARRAY, size)
    assert content == "" and calls == ARRAY_CALLS
    first_end = ARRAY.index("}},") + 2
    assert at[0] is not None and at[0] < first_end + size  # not held to the end of the array
    assert _calls(parse_whole(CallArrayParser(), ARRAY)[1]) == ARRAY_CALLS


@pytest.mark.parametrize("cut", range(len(ARRAY) + 1))
def test_call_array_cut_anywhere_keeps_the_complete_calls(cut):
    """An array cut by max_tokens after k complete elements gives those k calls, streamed
    (one character at a time) and whole alike; never content."""
    text = ARRAY[:cut]
    complete = sum(1 for end in (ARRAY.index("}},") + 2, ARRAY.rindex("}}") + 2) if end <= cut)
    content, calls = parse_whole(CallArrayParser(), text)
    assert content is None or (content == "" and not calls)
    assert _calls(calls) == ARRAY_CALLS[:complete]
    assert _feed_all(CallArrayParser(), text, 1)[1] == ARRAY_CALLS[:complete]


@pytest.mark.parametrize("parser, text, calls", [
    ("hermes", HERMES, [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"tz": "CET"})]),
    ("llama3_json", LLAMA, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
])
@pytest.mark.parametrize("size", [1, 4])
def test_cut_outputs_keep_their_complete_calls(parser, text, calls, size):
    """Cut anywhere, an auto output keeps every call whose JSON object is complete, whole
    and streamed alike, and the streamed content equals the whole one."""
    first_done = text.index("}}") + 2
    for cut in range(len(text) + 1):
        whole_content, whole = extract_tool_calls(parser, text[:cut])
        s_content, streamed, _ = _feed_all(StreamingToolParser(parser), text[:cut], size)
        assert streamed == _calls(whole), cut
        assert s_content == (whole_content or ""), cut
        if cut >= first_done:
            assert _calls(whole)[:1] == calls[:1], (cut, text[:cut])
    assert _calls(extract_tool_calls(parser, text)[1]) == calls


def test_hermes_cut_inside_the_closing_tag_is_a_call():
    content, calls = extract_tool_calls("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_')
    assert content is None and _calls(calls) == [("f", {"a": 1})]


def test_llama3_text_after_the_calls_is_content():
    content, calls = extract_tool_calls("llama3_json", '{"name": "f", "parameters": {}}; and then some words')
    assert _calls(calls) == [("f", {})] and content == "and then some words"
    cut = '{"name": "f", "parameters": {}}; {"name": "g", "param'
    content, calls = extract_tool_calls("llama3_json", cut)
    assert _calls(calls) == [("f", {})] and content == '{"name": "g", "param'
    assert extract_tool_calls("llama3_json", '  <|python_tag|> {"nam": 1}') == ('  <|python_tag|> {"nam": 1}', [])


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\n<tool_call>{"name": "g", "arguments": {}}'
               '</tool_call>\n'),
    ("hermes", '\n <tool_call>{"name": "f", "arguments": {}}</tool_call>'),
    ("llama3_json", '\n{"name": "f", "parameters": {}}\n;\n{"name": "g", "parameters": {}}\n\n'),
])
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_whitespace_beside_calls_is_never_content(parser, text, size):
    assert extract_tool_calls(parser, text)[0] is None
    p = StreamingToolParser(parser)
    deltas = [p.feed(text[i:i + size])[0] for i in range(0, len(text), size)] + [p.finish()[0]]
    assert all(d == "" for d in deltas), deltas


def test_whitespace_before_content_goes_with_it():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\nDone.'
    assert extract_tool_calls("hermes", text)[0] == "\n\nDone."
    assert _stream("hermes", text, 1)[0] == "\n\nDone."
    assert extract_tool_calls("hermes", "\n\n") == ("\n\n", [])  # no calls: the text as it is
    assert _stream("hermes", "\n\n", 1) == ("\n\n", [])
