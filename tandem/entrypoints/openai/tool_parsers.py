"""Tool-call parsers: model output text -> content + OpenAI ``tool_calls``, whole or streamed.

Formats (vLLM's ``--tool-call-parser`` names):

* ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text outside the tags is
  the message content.
* ``llama3_json`` (Llama 3.1-3.3's JSON tool calling): the output is
  ``{"name": ..., "parameters": {...}}`` (several separated by ``;``), optionally after
  ``<|python_tag|>``; an output that does not start so is content, and so is what follows
  the leading calls.

And the output that ``tool_choice: "required"`` constrains (:class:`CallArrayParser`): a
JSON array of ``{"name": ..., "parameters": {...}}`` objects.

Every parser is incremental (``feed`` text deltas, then ``finish``), and a whole output is
parsed by feeding it at once, so streamed and whole results are equal by construction. A
call is returned as soon as its JSON object is complete (hermes: its closing tag, or the
end of an output cut after the object), so an output cut by ``max_tokens`` keeps every
complete call. Text that may still become a call (a partial ``<tool_call>`` tag, a JSON
object not yet closed) is held back until decided, and so is whitespace-only content:
beside calls it is no content (None), as a whole output's is.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

TOOL_CALL_PARSERS = ("hermes", "llama3_json")

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


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


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


class _JsonObjects:
    """Complete JSON objects at the front of a growing text (``json.JSONDecoder.raw_decode``).

    A JSON object can only end at a ``}``, so a decode is tried again only when one has
    arrived since the last failed try: a long unfinished object costs one decode per
    ``}``, not one per delta.
    """

    def __init__(self) -> None:
        self._tried_upto = 0

    def decode(self, text: str, pos: int) -> tuple[object, int] | None:
        """(value, end) of the object starting at ``text[pos]``, or None while it is not
        complete (or not valid JSON: only the end of the output tells the two apart)."""
        if text.find("}", max(pos, self._tried_upto)) < 0:
            return None
        try:
            found = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            self._tried_upto = len(text)
            return None
        self._tried_upto = 0  # the next object is new: its text may be moved
        return found


class _ContentGate:
    """Holds whitespace-only content back: sent once some non-whitespace content arrives
    (with the whitespace before it), dropped at the end beside calls."""

    def __init__(self) -> None:
        self._held = ""
        self._open = False

    def pass_(self, text: str) -> str:
        if self._open:
            return text
        self._held += text
        if not self._held.strip(_WS):
            return ""
        self._open, out, self._held = True, self._held, ""
        return out

    def flush(self, any_calls: bool) -> str:
        out, self._held = ("" if any_calls else self._held), ""
        return out


class StreamingToolParser:
    """Content and tool calls of a model output in ``parser``'s format, from text deltas.

    Args:
        parser: ``hermes`` or ``llama3_json``.

    Raises:
        ValueError: an unknown parser name.
    """

    def __init__(self, parser: str) -> None:
        if parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {parser!r}.")
        self.parser = parser
        self._buf = ""  # text not yet sent as content nor parsed as calls
        self._gate = _ContentGate()
        self._num_calls = 0
        # llama3_json: None (undecided), "calls" (leading calls) or "content" (the rest).
        self._llama_state: str | None = None
        self._prefix = ""  # llama3_json: the whitespace and python tag before the first call
        self._objects = _JsonObjects()

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Take the next text delta; returns (content to send now, calls completed now)."""
        self._buf += delta
        content, calls = self._feed_hermes() if self.parser == "hermes" else self._feed_llama3()
        self._num_calls += len(calls)
        return self._gate.pass_(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of output (finished or cut): the held-back content and the calls not yet sent."""
        content, calls = self._finish_hermes() if self.parser == "hermes" else self._finish_llama3()
        self._num_calls += len(calls)
        return self._gate.pass_(content) + self._gate.flush(self._num_calls > 0), calls

    # ----------------------------------------------------------------- hermes
    def _feed_hermes(self) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        while True:
            start = self._buf.find(_OPEN)
            if start < 0:
                keep = _partial_suffix(self._buf, _OPEN)
                content.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            content.append(self._buf[:start])
            self._buf = self._buf[start:]
            end = self._buf.find(_CLOSE)
            if end < 0:
                break
            section, self._buf = self._buf[:end + len(_CLOSE)], self._buf[end + len(_CLOSE):]
            call = _hermes_call(section[len(_OPEN):end], cut=False)
            if call is None:  # not a call after all: keep the text
                content.append(section)
            else:
                calls.append(call)
        return "".join(content), calls

    def _finish_hermes(self) -> tuple[str, list[ToolCall]]:
        buf, self._buf = self._buf, ""
        call = _hermes_call(buf[len(_OPEN):], cut=True) if buf.startswith(_OPEN) else None
        return ("", [call]) if call is not None else (buf, [])

    # ------------------------------------------------------------ llama3_json
    def _feed_llama3(self) -> tuple[str, list[ToolCall]]:
        if self._llama_state is None and not self._decide_llama3():
            return "", []
        calls = []
        while self._llama_state == "calls":
            if self._num_calls or calls:
                self._buf = self._buf[_skip(self._buf, 0, _WS + ";"):]
            if not self._buf:
                return "", calls
            if not self._buf.startswith("{"):
                self._to_content(bool(calls))
                break
            found = self._objects.decode(self._buf, 0)
            if found is None:
                return "", calls  # not complete yet
            call = _call_from_json(found[0], "parameters")
            if call is None:
                self._to_content(bool(calls))
                break
            calls.append(call)
            self._buf = self._buf[found[1]:]
        out, self._buf = self._buf, ""
        return out, calls

    def _decide_llama3(self) -> bool:
        """Whether the output starts with a call (``{`` after whitespace and the python tag)
        or is content; False while the start may still be the tag."""
        head = self._buf.lstrip(_WS)
        if head.startswith(_PYTHON_TAG):
            head = head[len(_PYTHON_TAG):].lstrip(_WS)
            if not head:
                return False
        elif not head or _PYTHON_TAG.startswith(head):
            return False
        if head.startswith("{"):
            self._llama_state, self._prefix, self._buf = "calls", self._buf[:len(self._buf) - len(head)], head
        else:
            self._llama_state = "content"
        return True

    def _to_content(self, any_calls: bool) -> None:
        """What follows the leading calls is content; without any, all of the output is."""
        self._llama_state = "content"
        if not (any_calls or self._num_calls):
            self._buf = self._prefix + self._buf

    def _finish_llama3(self) -> tuple[str, list[ToolCall]]:
        if self._llama_state == "calls" and self._buf:
            self._to_content(False)  # an object cut or invalid
        buf, self._buf = self._buf, ""
        return buf, []


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def _hermes_call(body: str, cut: bool) -> ToolCall | None:
    """The call in a ``<tool_call>`` tag's body; ``cut``: the output ended inside the tag,
    so what follows the JSON object may be the start of the closing tag."""
    try:
        obj, end = _DECODER.raw_decode(body, _skip(body, 0, _WS))
    except json.JSONDecodeError:
        return None
    rest = body[end:].strip(_WS)
    if rest and not (cut and _CLOSE.startswith(rest)):
        return None
    return _call_from_json(obj, "arguments")


def extract_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """Split a finished (or cut) output into (content, tool calls) in ``parser``'s format.

    Raises:
        ValueError: an unknown parser name.
    """
    return parse_whole(StreamingToolParser(parser), text)


def parse_whole(parser: "StreamingToolParser | CallArrayParser", text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output through a fresh incremental ``parser``: (content, calls); content
    is None when there are calls and the rest is whitespace (or nothing)."""
    content, calls = parser.feed(text)
    tail, more = parser.finish()
    content, calls = content + tail, calls + more
    return (content if content or not calls else None), calls


class CallArrayParser:
    """The calls of a ``tool_choice: "required"`` output, a JSON array of
    ``{"name": ..., "parameters": {...}}`` objects, from text deltas: each element is a
    call once it is complete, so a cut array keeps its complete calls. The array is never
    content (the whitespace around its elements neither)."""

    def __init__(self) -> None:
        self._buf = ""
        self._pos = 0  # the next element (or the ``[``) starts here, after whitespace
        self._state = "start"  # start (before ``[``), items, done (``]`` seen)
        self._objects = _JsonObjects()

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Take the next text delta; returns ("", calls completed now)."""
        self._buf += delta
        calls = []
        while self._state != "done":
            self._pos = _skip(self._buf, self._pos, _WS + ("," if self._state == "items" else ""))
            if self._pos >= len(self._buf):
                break
            ch = self._buf[self._pos]
            if self._state == "start":
                self._state = "items" if ch == "[" else "done"
                self._pos += 1
                continue
            if ch != "{":  # "]", or (without the grammar) anything else: the array ends
                self._state = "done"
                break
            found = self._objects.decode(self._buf, self._pos)
            if found is None:
                break
            call = _call_from_json(found[0], "parameters")
            if call is None:
                self._state = "done"
                break
            calls.append(call)
            self._pos = found[1]
        return "", calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of output: an element not complete by now is no call."""
        return "", []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
