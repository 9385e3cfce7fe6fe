"""Tool-call parsers: model output text -> content + OpenAI ``tool_calls``, whole or streamed.

Formats (vLLM's ``--tool-call-parser`` names):

* ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text outside the tags is
  the message content.
* ``llama3_json`` (Llama 3.1-3.3's JSON tool calling): the whole output is
  ``{"name": ..., "parameters": {...}}`` (several separated by ``;``), optionally after
  ``<|python_tag|>``; anything else is content.

Streaming: ``StreamingToolParser.feed`` takes text deltas and returns the content delta
and finished tool calls; a call is sent whole (name and arguments in one delta) once its
closing tag (hermes) or the end of the output (llama3_json) is seen. Text that may still
become a call (a partial ``<tool_call>`` tag) is held back until it is decided.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"chatcmpl-tool-{uuid.uuid4().hex}"

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parser_for_chat_template(template: str | None) -> str:
    """The parser a chat template's tool-call syntax needs (hermes unless the template
    is Llama 3's)."""
    if template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3_json"
    return "hermes"


def _call_from_json(obj, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def extract_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """Split a finished output into (content or None, tool calls).

    Raises:
        ValueError: an unknown parser name.
    """
    if parser == "hermes":
        return _extract_hermes(text)
    if parser == "llama3_json":
        return _extract_llama3(text)
    raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {parser!r}.")


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _extract_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls, content, pos = [], [], 0
    while (start := text.find(_OPEN, pos)) >= 0:
        end = text.find(_CLOSE, start)
        body = text[start + len(_OPEN):end if end >= 0 else len(text)]
        call = None
        try:
            call = _call_from_json(json.loads(body), "arguments")
        except json.JSONDecodeError:
            pass
        if call is None:  # not a call after all: keep the text
            content.append(text[pos:end + len(_CLOSE) if end >= 0 else len(text)])
        else:
            content.append(text[pos:start])
            calls.append(call)
        pos = len(text) if end < 0 else end + len(_CLOSE)
    content.append(text[pos:])
    rest = "".join(content)
    return (rest if rest.strip() or not calls else None), calls


_PYTHON_TAG = "<|python_tag|>"


def _extract_llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return text, []
    calls, dec, pos = [], json.JSONDecoder(), 0
    try:
        while pos < len(body):
            obj, end = dec.raw_decode(body, pos)
            call = _call_from_json(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\n;":
                pos += 1
    except json.JSONDecodeError:
        return text, []
    return None, calls


class StreamingToolParser:
    """Incremental :func:`extract_tool_calls` over text deltas.

    Args:
        parser: ``hermes`` or ``llama3_json``.
    """

    def __init__(self, parser: str) -> None:
        if parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {parser!r}.")
        self.parser = parser
        self._buf = ""  # text not yet sent as content nor parsed as calls
        self._llama_json: bool | None = None  # llama3_json: is the output a JSON call?

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Take the next text delta; returns (content to send now, completed calls)."""
        self._buf += delta
        if self.parser == "hermes":
            return self._feed_hermes()
        if self._llama_json is None:
            head = self._buf.lstrip()
            if not head:
                return "", []
            if head.startswith("{") or head.startswith(_PYTHON_TAG):
                self._llama_json = True
            elif _PYTHON_TAG.startswith(head):
                return "", []  # may still be the tag
            else:
                self._llama_json = False
        if self._llama_json:
            return "", []  # parsed whole at the end
        out, self._buf = self._buf, ""
        return out, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of output: the held-back content and the calls not yet sent."""
        buf, self._buf = self._buf, ""
        if not buf:
            return "", []
        content, calls = extract_tool_calls(self.parser, buf)
        return content or "", calls

    def _feed_hermes(self) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        while True:
            start = self._buf.find(_OPEN)
            if start < 0:
                keep = _partial_suffix(self._buf, _OPEN)
                content.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            end = self._buf.find(_CLOSE, start)
            if end < 0:
                content.append(self._buf[:start])
                self._buf = self._buf[start:]
                break
            text_out, found = _extract_hermes(self._buf[start:end + len(_CLOSE)])
            content.append(self._buf[:start] + (text_out or ""))
            calls += found
            self._buf = self._buf[end + len(_CLOSE):]
        return "".join(content), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
