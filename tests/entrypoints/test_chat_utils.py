"""Chat messages checked as OpenAI's API checks them (``tandem.entrypoints.chat_utils``),
without a model: each malformed shape names its field, the accepted ones reach the template
as it reads them, and a template's own failure is a ValueError naming ``messages``."""

from __future__ import annotations

import copy

import jinja2
import pytest

from tandem.entrypoints.chat_utils import ChatMessageError, parse_chat_messages, render_chat
from tests.entrypoints.chat_cases import BAD_MESSAGES, GOOD_MESSAGES


@pytest.mark.parametrize("case", sorted(BAD_MESSAGES))
def test_bad_messages_name_the_field(case):
    messages, field = BAD_MESSAGES[case]
    with pytest.raises(ChatMessageError) as e:
        parse_chat_messages(messages)
    assert isinstance(e.value, ValueError)
    assert e.value.param == field and str(e.value).startswith(f"{field}: "), str(e.value)


def test_field_prefix_names_the_conversation():
    with pytest.raises(ChatMessageError) as e:
        parse_chat_messages([{"role": "user"}], "messages[3]")
    assert e.value.param == "messages[3][0].content"


@pytest.mark.parametrize("case", sorted(GOOD_MESSAGES))
def test_good_messages_as_the_template_reads_them(case):
    messages, want = GOOD_MESSAGES[case]
    before = copy.deepcopy(messages)
    assert parse_chat_messages(messages) == want
    assert messages == before  # the caller's messages are left as they were


def test_other_keys_reach_the_template():
    """As in vLLM, e.g. ``reasoning_content`` for templates that print it."""
    msg = {"role": "assistant", "content": "4", "reasoning_content": "2 + 2"}
    assert parse_chat_messages([{"role": "user", "content": "2 + 2?"}, msg])[1] == msg


def test_echoed_response_message_has_no_null_keys():
    """A response message sent back (``tool_calls`` empty or null, ``refusal`` null) reaches
    the template without them: Llama 3.1's tests ``'tool_calls' in message``."""
    msg = {"role": "assistant", "content": "Hello", "tool_calls": [], "refusal": None, "name": None}
    assert parse_chat_messages([msg]) == [{"role": "assistant", "content": "Hello"}]
    assert parse_chat_messages([{**msg, "tool_calls": None}]) == [{"role": "assistant", "content": "Hello"}]


def test_unparsable_arguments_are_passed_on_as_text():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
    (msg,) = parse_chat_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert msg["tool_calls"] == [call]


class _Tokenizer:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.seen: list = []

    def apply_chat_template(self, conversation, **kwargs) -> str:
        self.seen.append((conversation, kwargs))
        if self.error is not None:
            raise self.error
        return "|".join(f"{m['role']}:{m['content']}" for m in conversation)


def test_render_passes_the_conversation_and_options():
    tok = _Tokenizer()
    conv = parse_chat_messages([{"role": "user", "content": "Hi"}])
    assert render_chat(tok, conv, add_generation_prompt=False, tools=[{"type": "function"}]) == "user:Hi"
    assert tok.seen == [(conv, {"tokenize": False, "add_generation_prompt": False, "continue_final_message": False,
                                "tools": [{"type": "function"}]})]


@pytest.mark.parametrize("error", [jinja2.exceptions.TemplateError("Conversation roles must alternate"),
                                   jinja2.exceptions.UndefinedError("'dict object' has no attribute 'content'"),
                                   TypeError("can only concatenate str"),
                                   ValueError("tokenizer.chat_template is not set")])
def test_template_failures_are_value_errors_naming_messages(error):
    conv = parse_chat_messages([{"role": "user", "content": "Hi"}])
    with pytest.raises(ChatMessageError) as e:
        render_chat(_Tokenizer(error), conv, field="messages[1]")
    assert e.value.param == "messages[1]"
    assert str(e.value).startswith("messages[1]: the chat template could not be applied") and str(error) in str(e.value)
