"""Chat messages checked as OpenAI's API checks them, then rendered by the model's chat template.

One rule for the server (``/v1/chat/completions``, ``/tokenize``) and the offline API
(``LLM.chat``, ``LLM.stream_chat``): an error names the field as OpenAI's ``param`` does
(``messages[1].content``), and nothing malformed reaches the template, whose own errors
(jinja2's ``UndefinedError``, ``TypeError``) would not say what is wrong with the request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

# OpenAI's roles ("function": its deprecated function-calling one), whose messages are checked
# by OpenAI's rules. Any other non-empty role string is passed to the template as vLLM passes it
# (templates written for e.g. "ipython" or "observation" turns read it); OpenAI would answer 400.
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_ROLE_LIST = ", ".join(repr(r) for r in ROLES)


class ChatMessageError(ValueError):
    """A malformed chat message. ``param``: the field it names, as OpenAI's error body names it
    (``messages[0].content``); the message starts with it."""

    def __init__(self, param: str, problem: str) -> None:
        super().__init__(f"{param}: {problem}")
        self.param = param


def _kind(value: Any) -> str:
    """``value``'s type in JSON's words, as OpenAI's errors name it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        return "an array"
    return type(value).__name__


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def _text_parts(parts: Sequence, where: str) -> str:
    """The text of a content-part list, joined with newlines as vLLM joins them for
    templates that read a string.

    Only ``{"type": "text", "text": ...}`` parts: the served models read text alone, so an
    image, audio, file or refusal part is refused rather than dropped.
    """
    if not parts:
        raise ChatMessageError(where, "empty array; give a string or at least one content part.")
    texts = []
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        if not isinstance(part, Mapping):
            raise ChatMessageError(at, f"expected a content part object ({{'type': 'text', 'text': ...}}), "
                                       f"got {_kind(part)}.")
        kind = part.get("type")
        if kind is None:
            raise ChatMessageError(f"{at}.type", "missing; give 'text'.")
        if kind != "text":
            raise ChatMessageError(f"{at}.type", f"{kind!r} content parts are not supported (the model reads "
                                                 f"text only); only 'text' parts are.")
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatMessageError(f"{at}.text", f"expected a string, got {_kind(text)}.")
        texts.append(text)
    return "\n".join(texts)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as templates read them: the arguments as an
    object (Qwen2.5's and Llama 3's templates serialize them with ``tojson``).

    The arguments are a JSON string as OpenAI sends them, or already an object as
    transformers' chat-template documentation writes them.
    """
    if not _is_list(calls):
        raise ChatMessageError(where, f"expected an array of tool calls, got {_kind(calls)}.")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, Mapping):
            raise ChatMessageError(at, f"expected a tool call object, got {_kind(call)}.")
        if not isinstance(call.get("id"), str):
            raise ChatMessageError(f"{at}.id", f"expected a string, got {_kind(call.get('id'))}.")
        if call.get("type") != "function":
            raise ChatMessageError(f"{at}.type", f"expected 'function', got {call.get('type')!r}.")
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            raise ChatMessageError(f"{at}.function", f"expected an object with 'name' and 'arguments', "
                                                     f"got {_kind(fn)}.")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatMessageError(f"{at}.function.name", f"expected a non-empty string, got {_kind(fn.get('name'))}.")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass  # passed on as the string: a template can still print it
        elif not isinstance(args, Mapping):
            raise ChatMessageError(f"{at}.function.arguments", f"expected a JSON string, got {_kind(args)}.")
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, Mapping):
        raise ChatMessageError(where, f"expected a message object ({{'role': ..., 'content': ...}}), got {_kind(m)}.")
    role = m.get("role")
    if role is None:
        raise ChatMessageError(f"{where}.role", f"missing; give one of {_ROLE_LIST} or a role your chat "
                                                f"template knows.")
    if not isinstance(role, str) or not role:
        raise ChatMessageError(f"{where}.role", f"expected a non-empty string (one of {_ROLE_LIST} or a role "
                                                f"your chat template knows), got {role!r}.")
    # A null key is an unset one: templates test keys with ``is defined`` / ``in message``
    # (Llama 3.1's ``'tool_calls' in message``), as an echoed response message holds
    # ``"tool_calls": null`` or ``[]``.
    out = {k: v for k, v in m.items() if v is not None}
    if m.get("name") is not None and not isinstance(m["name"], str):
        raise ChatMessageError(f"{where}.name", f"expected a string, got {_kind(m['name'])}.")
    if role == "function" and not isinstance(m.get("name"), str):
        raise ChatMessageError(f"{where}.name", "missing; a function message names its function.")
    if role == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise ChatMessageError(f"{where}.tool_call_id", f"expected the id of the tool call this message answers "
                                                        f"(a string), got {_kind(m.get('tool_call_id'))}.")
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise ChatMessageError(f"{where}.tool_calls", "only an assistant message has tool calls.")
        out["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        if not calls:
            del out["tool_calls"]
    content = m.get("content")
    at = f"{where}.content"
    if isinstance(content, str):
        pass
    elif _is_list(content):
        if role == "function":
            raise ChatMessageError(at, f"expected a string or null, got {_kind(content)}.")
        content = _text_parts(content, at)
    elif content is None:
        present = "content" in m
        # OpenAI: null (or no) content only where something else is the message.
        if (role == "assistant" and calls) or (role == "function" and present):
            content = ""
        else:
            need = {"assistant": "an assistant message without tool_calls needs a string or a list of text parts",
                    "function": "a function message needs a string or null"}.get(
                        role, f"a {role} message needs a string or a list of text parts")
            raise ChatMessageError(at, f"{'null' if present else 'missing'}; {need}.")
    else:
        raise ChatMessageError(at, f"expected a string or an array of content parts, got {_kind(content)}.")
    # Templates print the content: null becomes "" rather than "None" or an error.
    out["content"] = content
    return out


def parse_chat_messages(messages: Any, field: str = "messages") -> list[dict[str, Any]]:
    """Check one conversation as OpenAI's chat API checks ``messages``, and return it as chat
    templates read it: each content a string (text parts joined with newlines), a null
    content ``""``, tool-call arguments as objects, null keys and empty ``tool_calls`` left
    out; other keys of a message are passed on (templates may read e.g.
    ``reasoning_content``).

    Args:
        messages: a non-empty list of message objects.
        field: the conversation's name in errors (``messages``, ``messages[2]`` for one of a
            list of conversations).

    Raises:
        ChatMessageError: (a ValueError) the first malformed part, its ``param`` the field
            (``messages[0].content``): not a non-empty list, a message that is not an object,
            a role that is not a non-empty string, content of the wrong type or missing where
            OpenAI requires it (a custom role's message needs content, as a user message), a
            content part that is not text, a tool message without ``tool_call_id``, a
            malformed ``tool_calls``.
    """
    if not _is_list(messages) or not messages:
        raise ChatMessageError(field, f"expected a non-empty array of messages, got "
                                      f"{'an empty array' if _is_list(messages) else _kind(messages)}.")
    return [_message(m, f"{field}[{i}]") for i, m in enumerate(messages)]


def render_chat(tokenizer: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
                continue_final_message: bool = False, field: str = "messages", **template_kwargs: Any) -> str:
    """The chat template of ``tokenizer`` applied to a conversation that
    :func:`parse_chat_messages` returned, as text.

    Raises:
        ChatMessageError: (a ValueError) ``param`` ``field``: the template refused the
            conversation (e.g. roles that do not alternate) or failed on it, or the
            tokenizer has no chat template.
    """
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **template_kwargs)
    # Whatever the template raises (jinja2's TemplateError and raise_exception, or a
    # TypeError in its code) is about these messages: the template is the model's.
    except Exception as e:  # noqa: BLE001
        raise ChatMessageError(field, f"the chat template could not be applied to these messages: {e}") from None
