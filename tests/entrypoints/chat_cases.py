"""Chat ``messages`` for the validation tests of the offline API and the server: one table, as
the rule (``tandem.entrypoints.chat_utils``) is one."""

from __future__ import annotations

USER = {"role": "user", "content": "Hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [CALL]}


def _call(**changes) -> dict:
    return {**CALL, **changes}


# case -> (messages, the field the error names). Every malformed shape of OpenAI's schema.
BAD_MESSAGES = {
    "empty list": ([], "messages"),
    "one message, not a list": (USER, "messages"),
    "message not an object": (["Hi"], "messages[0]"),
    "no role": ([{"content": "Hi"}], "messages[0].role"),
    "empty role": ([{"role": "", "content": "Hi"}], "messages[0].role"),
    "role not a string": ([{"role": 5, "content": "Hi"}], "messages[0].role"),
    "custom role without content": ([{"role": "observation"}, USER], "messages[0].content"),
    "tool_calls on a custom role's message": ([{"role": "planner", "content": "Hi", "tool_calls": [CALL]}],
                                              "messages[0].tool_calls"),
    "no content": ([{"role": "user"}], "messages[0].content"),
    "null content": ([{"role": "user", "content": None}], "messages[0].content"),
    "integer content": ([{"role": "user", "content": 42}], "messages[0].content"),
    "object content": ([{"role": "user", "content": {"type": "text", "text": "Hi"}}], "messages[0].content"),
    "empty parts": ([{"role": "user", "content": []}], "messages[0].content"),
    "part not an object": ([{"role": "user", "content": ["Hi"]}], "messages[0].content[0]"),
    "part without type": ([{"role": "user", "content": [{"text": "Hi"}]}], "messages[0].content[0].type"),
    "image part": ([{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                  {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}],
                   "messages[0].content[1].type"),
    "audio part": ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}],
                   "messages[0].content[0].type"),
    "part text not a string": ([{"role": "user", "content": [{"type": "text", "text": 7}]}],
                               "messages[0].content[0].text"),
    "system without content": ([{"role": "system"}, USER], "messages[0].content"),
    "assistant without content or tool_calls": ([USER, {"role": "assistant"}], "messages[1].content"),
    "assistant null content, empty tool_calls": ([USER, {"role": "assistant", "content": None, "tool_calls": []}],
                                                 "messages[1].content"),
    "tool without tool_call_id": ([USER, ASSISTANT_CALL, {"role": "tool", "content": "21 C"}],
                                  "messages[2].tool_call_id"),
    "tool without content": ([USER, ASSISTANT_CALL, {"role": "tool", "tool_call_id": "call_1"}],
                             "messages[2].content"),
    "tool_calls not a list": ([USER, {"role": "assistant", "tool_calls": CALL}], "messages[1].tool_calls"),
    "tool call not an object": ([USER, {"role": "assistant", "tool_calls": ["get_weather"]}],
                                "messages[1].tool_calls[0]"),
    "tool call without id": ([USER, {"role": "assistant", "tool_calls": [_call(id=None)]}],
                             "messages[1].tool_calls[0].id"),
    "tool call of another type": ([USER, {"role": "assistant", "tool_calls": [_call(type="custom")]}],
                                  "messages[1].tool_calls[0].type"),
    "tool call without function": ([USER, {"role": "assistant", "tool_calls": [_call(function=None)]}],
                                   "messages[1].tool_calls[0].function"),
    "tool call without name": ([USER, {"role": "assistant", "tool_calls": [_call(function={"arguments": "{}"})]}],
                               "messages[1].tool_calls[0].function.name"),
    "tool call arguments a number": ([USER, {"role": "assistant", "tool_calls": [
        _call(function={"name": "get_weather", "arguments": 3})]}], "messages[1].tool_calls[0].function.arguments"),
    "tool_calls on a user message": ([{"role": "user", "content": "Hi", "tool_calls": [CALL]}],
                                     "messages[0].tool_calls"),
    "name not a string": ([{"role": "user", "content": "Hi", "name": 3}], "messages[0].name"),
    "function message without name": ([USER, {"role": "function", "content": "21 C"}], "messages[1].name"),
}

# case -> (messages, the same conversation as the chat template reads it).
GOOD_MESSAGES = {
    # vLLM passes any role to the template (its own message checks: a user message's).
    "custom role": ([{"role": "observation", "content": [{"type": "text", "text": "21 C"}]}, USER],
                    [{"role": "observation", "content": "21 C"}, USER]),
    "string content": ([USER], [USER]),
    "text parts": ([{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
                   [{"role": "user", "content": "Hi\nthere"}]),
    "system and developer": ([{"role": "system", "content": "Be brief."},
                              {"role": "developer", "content": [{"type": "text", "text": "Answer in French."}]}, USER],
                             [{"role": "system", "content": "Be brief."},
                              {"role": "developer", "content": "Answer in French."}, USER]),
    "assistant tool_calls with null content, then the tool's answer": (
        [USER, ASSISTANT_CALL, {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}],
        [USER, {"role": "assistant", "content": "",
                "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]),
}
