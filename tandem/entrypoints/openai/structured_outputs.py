"""Request fields -> one ``StructuredOutputsParams``; tools and ``tool_choice`` -> a plan.

Sources of a constraint (at most one per request, as in vLLM): OpenAI's
``response_format`` (``json_object``, ``json_schema``, ``structural_tag``), vLLM's
``structured_outputs`` object and its older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` fields, SGLang's ``regex`` and ``ebnf`` (vLLM's
``regex`` and ``grammar``: SGLang's grammar backend is xgrammar too), and for chat
``tool_choice`` ``required`` or a named function (vLLM's schemas: the named function's
parameters; for ``required`` an array of at least one ``{"name", "parameters"}`` object,
one ``anyOf`` branch per tool, and at most one with ``parallel_tool_calls: false``). The
array's grammar ends the output once it closes; cut before that (``max_tokens``), its
complete elements are still the calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from tandem.entrypoints.openai import protocol as P
from tandem.entrypoints.openai.tool_parsers import CallArrayParser, StreamingToolParser, ToolCall, parse_whole
from tandem.structured_output import StructuredOutputsParams

_PARAM_FIELDS = {f.name for f in fields(StructuredOutputsParams)}


class FieldError(ValueError):
    """A request field is invalid; ``param`` names it (HTTP 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _build(param: str, **kwargs) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise FieldError(f"{param}: {e}", param) from None


def _from_response_format(rf: P.ResponseFormat) -> StructuredOutputsParams | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return _build("response_format", json_object=True)
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise FieldError("response_format: type json_schema needs json_schema.schema.", "response_format")
        return _build("response_format", json=rf.json_schema.json_schema)
    tag = {k: v for k, v in rf.model_dump(by_alias=True).items() if k != "json_schema" or v is not None}
    return _build("response_format", structural_tag=json.dumps(tag))


def _from_guided(req: P._SamplingFields) -> list[tuple[str, StructuredOutputsParams]]:
    found = []
    if req.guided_whitespace_pattern is not None:
        raise FieldError("guided_whitespace_pattern is not supported (xgrammar backend).", "guided_whitespace_pattern")
    if req.guided_decoding_backend not in (None, "auto", "xgrammar"):
        raise FieldError(f"guided_decoding_backend must be xgrammar, got {req.guided_decoding_backend!r}.",
                         "guided_decoding_backend")
    for name, kw in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                     ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            if kw == "json" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise FieldError(f"{name} is not valid JSON: {e}", name) from None
            found.append((name, _build(name, **{kw: value})))
    return found


def _from_sglang(req: P._SamplingFields) -> list[tuple[str, StructuredOutputsParams]]:
    """SGLang's ``regex`` and ``ebnf`` fields as (field, constraint) pairs."""
    found = []
    for name, kw in (("regex", "regex"), ("ebnf", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, _build(name, **{kw: value})))
    return found


def _from_structured_outputs(so: dict[str, Any]) -> StructuredOutputsParams:
    unknown = sorted(set(so) - _PARAM_FIELDS - {"backend", "_backend"})
    if unknown:
        raise FieldError(f"structured_outputs: unknown fields {unknown}; known: {sorted(_PARAM_FIELDS)}.",
                         "structured_outputs")
    return _build("structured_outputs", **{k: v for k, v in so.items() if k in _PARAM_FIELDS})


def structured_outputs_of(req: P._SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint, or None.

    Raises:
        FieldError: an invalid constraint, or more than one; ``param`` names the field.
    """
    found = []
    if req.response_format is not None:
        so = _from_response_format(req.response_format)
        if so is not None:
            found.append(("response_format", so))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(req.structured_outputs)))
    found += _from_guided(req)
    found += _from_sglang(req)
    if len(found) > 1:
        names = [n for n, _ in found]
        raise FieldError(f"only one structured output constraint may be given, got {names}.", names[1])
    return found[0][1] if found else None


# ------------------------------------------------------------------------ tools
@dataclass
class ToolPlan:
    """How a chat request uses its tools.

    ``mode``: ``none`` (no tools, or tool_choice none: plain output), ``auto`` (free
    output, parsed for calls), ``required`` (a JSON array of at least one call), ``named``
    (the arguments of ``name``). ``constraint``: the grammar that ``required``/``named``
    impose. ``max_calls``: 1 with ``parallel_tool_calls: false`` (and for ``named``),
    else None (any number).
    """

    mode: str
    tools: list[dict]
    name: str | None = None
    constraint: StructuredOutputsParams | None = None
    max_calls: int | None = None

    def parser(self, tool_call_parser: str) -> StreamingToolParser | CallArrayParser | None:
        """A fresh incremental parser of one output's calls (``auto``: in
        ``tool_call_parser``'s format; ``required``: the array), None for ``none`` and
        ``named`` (whose whole output is content, or the arguments)."""
        if self.mode == "auto":
            return StreamingToolParser(tool_call_parser)
        if self.mode == "required":
            return CallArrayParser()
        return None

    def split(self, text: str, tool_call_parser: str) -> tuple[str | None, list[ToolCall]]:
        """A finished (or cut) output's (content, calls), at most ``max_calls`` of them."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            return None, [ToolCall(self.name, text)]
        content, calls = parse_whole(self.parser(tool_call_parser), text)
        return (content if self.mode == "auto" else None), calls[:self.max_calls]


def _check_tools(tools: list[dict]) -> dict[str, dict]:
    by_name = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise FieldError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             f"\"parameters\": {{...}}}}}}.", "tools")
        params = fn.get("parameters")
        if params is not None:
            _build("tools", json=params)  # a parameters schema must itself be valid
        by_name[fn["name"]] = fn
    return by_name


def tool_plan(req: P.ChatCompletionRequest) -> ToolPlan:
    """Resolve ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (OpenAI semantics:
    ``auto`` when tools are given and no choice is; parallel calls unless false; vLLM's
    schemas, ``maxItems`` 1 for ``required`` without parallel calls).

    Raises:
        FieldError: malformed tools, an unknown tool_choice or function name, or
            tool_choice together with another output constraint.
    """
    tools = req.tools or []
    by_name = _check_tools(tools)
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none" or (choice == "auto" and not tools):
        return ToolPlan("none", tools)
    if not tools:
        raise FieldError("tool_choice requires tools.", "tool_choice")
    max_calls = 1 if req.parallel_tool_calls is False else None
    if choice == "auto":
        return ToolPlan("auto", tools, max_calls=max_calls)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]},
                                                   "parameters": fn.get("parameters") or {"type": "object"}},
                  "required": ["name", "parameters"]} for n, fn in by_name.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if max_calls is not None:
            schema["maxItems"] = max_calls
        return ToolPlan("required", tools, constraint=_build("tool_choice", json=schema), max_calls=max_calls)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if name is None:
        raise FieldError(f"tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": "
                         f"{{\"name\": ...}}}}, got {choice!r}.", "tool_choice")
    if name not in by_name:
        raise FieldError(f"tool_choice names the function {name!r}, which is not among the tools "
                         f"{sorted(by_name)}.", "tool_choice")
    schema = by_name[name].get("parameters") or {"type": "object"}
    return ToolPlan("named", tools, name=name, constraint=_build("tool_choice", json=schema), max_calls=1)
