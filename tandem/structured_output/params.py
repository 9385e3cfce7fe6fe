"""What a request's output must match: vLLM's ``StructuredOutputsParams``.

Exactly one constraint per request: ``json`` (a JSON schema, dict or string),
``json_object`` (any JSON object), ``regex``, ``choice`` (one of some strings),
``grammar`` (EBNF/GBNF, xgrammar's dialect) or ``structural_tag`` (xgrammar's structural
tag JSON). The constraint is parsed when the params are built (xgrammar's tokenizer-free
parsers, plus a meta-schema check of a JSON schema: milliseconds for a nested schema,
once per process for equal constraints), so an invalid one is a ``ValueError`` naming the
field before anything reaches the engine; compiling it against the tokenizer happens
later, off the engine loop (:class:`tandem.structured_output.manager.StructuredOutputManager`).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar as xgr

_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: ".
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# Cache keys of the constraints parsed in this process (most recently used last).
_PARSED: OrderedDict[tuple, None] = OrderedDict()
_PARSED_SIZE = 256
_PARSED_LOCK = threading.Lock()


def xgrammar_error(e: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    return _CPP_PREFIX.sub("", str(e).strip())


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's ``StructuredOutputsParams``; also importable as
    ``GuidedDecodingParams``, its former name).

    Attributes:
        json: a JSON schema (dict or JSON text); the output is one JSON value valid for it.
        regex: the output matches this regular expression (xgrammar's regex dialect).
        choice: the output is exactly one of these strings.
        grammar: an EBNF (GBNF) grammar with a ``root`` rule.
        json_object: True: the output is one JSON object.
        structural_tag: xgrammar structural-tag JSON text.
        disable_any_whitespace: JSON without free whitespace (compact), which keeps
            small models from looping on whitespace.
        whitespace_pattern: accepted for vLLM compatibility; xgrammar has no such
            option, so it must be None.

    Raises:
        ValueError: not exactly one constraint, or the constraint does not parse; the
            message names the field (``structured_outputs.<kind>``).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_KINDS)}; got "
                             f"{given or 'none'}.")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend; "
                             "use disable_any_whitespace.")
        _parse_once(self)  # an invalid constraint fails here

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def schema_text(self) -> str:
        """The JSON schema as text (``json`` kind)."""
        return self.json if isinstance(self.json, str) else json.dumps(self.json)

    def choice_ebnf(self) -> str:
        """The EBNF grammar ``root ::= "a" | "b" | ...`` of a ``choice``."""
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)

    def cache_key(self) -> tuple:
        """Identifies the compiled grammar: equal keys compile to the same grammar."""
        kind = self.kind
        if kind == "json":
            spec = self.schema_text()
        elif kind == "choice":
            spec = self.choice_ebnf()
        else:
            spec = getattr(self, kind)
        return kind, spec, self.disable_any_whitespace

    def to_grammar(self) -> "xgr.Grammar":
        """Parse the constraint without a tokenizer (validation).

        Returns:
            the xgrammar ``Grammar``.

        Raises:
            ValueError: naming ``structured_outputs.<kind>``.
        """
        import xgrammar as xgr  # 1.3 s to import: only when structured outputs are used

        kind = self.kind
        field = f"structured_outputs.{kind}"
        try:
            if kind == "json":
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("a JSON schema must be an object or a boolean")
                _check_schema(schema)
                return xgr.Grammar.from_json_schema(self.schema_text(), any_whitespace=not self.disable_any_whitespace)
            if kind == "json_object":
                return xgr.Grammar.builtin_json_grammar()
            if kind == "regex":
                if not isinstance(self.regex, str) or not self.regex:
                    raise ValueError("must be a non-empty string")
                return xgr.Grammar.from_regex(self.regex)
            if kind == "choice":
                if not isinstance(self.choice, list) or not self.choice or \
                        not all(isinstance(c, str) and c for c in self.choice):
                    raise ValueError("must be a non-empty list of non-empty strings")
                return xgr.Grammar.from_ebnf(self.choice_ebnf())
            if kind == "grammar":
                if not isinstance(self.grammar, str) or not self.grammar.strip():
                    raise ValueError("must be a non-empty EBNF grammar with a root rule")
                return xgr.Grammar.from_ebnf(self.grammar)
            return xgr.Grammar.from_structural_tag(self.structural_tag)
        except ValueError as e:
            raise ValueError(f"{field} is invalid: {e}") from None
        except Exception as e:  # xgrammar's parse errors (RuntimeError, InvalidStructuralTagError, ...)
            raise ValueError(f"{field} is invalid: {xgrammar_error(e)}") from None


def _parse_once(params: StructuredOutputsParams) -> None:
    """``params.to_grammar()`` unless an equal constraint parsed in this process already.

    Every request's constraint is parsed twice: by the front end, and by the engine core
    when msgspec decodes the request (it runs ``__post_init__``), on the core's loop
    thread, ahead of the next step. For a schema like the bench's user profile that is
    milliseconds (meta-schema check and xgrammar's parse); requests sharing a schema pay
    it once per process. Invalid constraints are never remembered.
    """
    try:
        key = params.cache_key()
        hash(key)
    except (TypeError, ValueError):  # e.g. a schema JSON cannot encode: to_grammar names the field
        key = None
    if key is not None:
        with _PARSED_LOCK:
            if key in _PARSED:
                _PARSED.move_to_end(key)
                return
    params.to_grammar()
    if key is not None:
        with _PARSED_LOCK:
            _PARSED[key] = None
            while len(_PARSED) > _PARSED_SIZE:
                _PARSED.popitem(last=False)


def _check_schema(schema: dict | bool) -> None:
    """Check a schema against its JSON Schema meta-schema (draft from ``$schema``, else
    the latest), so that e.g. ``{"type": "foo"}`` is refused by name."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ValueError(f"{e.message}" + (f" (at {where})" if where else "")) from None


# vLLM's name for the same parameters before v0.10.2.
GuidedDecodingParams = StructuredOutputsParams
