"""``tool_plan``: the schema and call limit that ``tool_choice`` / ``parallel_tool_calls``
give, and ``ToolPlan.split`` of whole (or cut) outputs."""

from __future__ import annotations

import json

import pytest

from tandem.entrypoints.openai import protocol as P
from tandem.entrypoints.openai.structured_outputs import tool_plan

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}} for n in ("f", "g")]
USER = [{"role": "user", "content": "Hi"}]
TWO_CALLS = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {"x": 2}}]'


def _plan(**kw):
    return tool_plan(P.ChatCompletionRequest(messages=USER, tools=TOOLS, **kw))


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parallel, max_items", [(None, None), (True, None), (False, 1)])
def test_required_schema(parallel, max_items):
    """vLLM's schema: an array of at least one call; at most one without parallel calls."""
    plan = _plan(tool_choice="required", parallel_tool_calls=parallel)
    schema = plan.constraint.json
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema.get("maxItems") == max_items and plan.max_calls == max_items
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [["f"], ["g"]]


def test_required_split_keeps_complete_calls_of_a_cut_array():
    plan = _plan(tool_choice="required")
    assert _calls(plan.split(TWO_CALLS, "hermes")[1]) == [("f", {"x": 1}), ("g", {"x": 2})]
    cut = TWO_CALLS[:TWO_CALLS.index('{"name": "g"') + 15]
    assert plan.split(cut, "hermes")[0] is None
    assert _calls(plan.split(cut, "hermes")[1]) == [("f", {"x": 1})]
    assert plan.split("[\n\n\n", "hermes") == (None, [])


def test_auto_without_parallel_calls_keeps_the_first():
    text = ('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {"x": 2}}</tool_call>')
    assert len(_plan(tool_choice="auto").split(text, "hermes")[1]) == 2
    content, calls = _plan(tool_choice="auto", parallel_tool_calls=False).split(text, "hermes")
    assert content is None and _calls(calls) == [("f", {"x": 1})]


def test_named_and_none():
    plan = _plan(tool_choice={"type": "function", "function": {"name": "g"}})
    assert plan.max_calls == 1 and plan.constraint.json == TOOLS[1]["function"]["parameters"]
    content, (call,) = plan.split('{"x": 3}', "hermes")
    assert content is None and (call.name, call.arguments) == ("g", '{"x": 3}')
    assert _plan(tool_choice="none").split("\n text", "hermes") == ("\n text", [])
