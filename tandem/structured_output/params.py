"""What a request's output must match: vLLM's ``StructuredOutputsParams``.

Exactly one constraint per request: ``json`` (a JSON schema, dict or string),
``json_object`` (any JSON object), ``regex``, ``choice`` (one of some strings),
``grammar`` (EBNF/GBNF, xgrammar's dialect) or ``structural_tag`` (xgrammar's structural
tag JSON). The constraint is parsed when the params are built (xgrammar's tokenizer-free
parsers, plus a meta-schema check of a JSON schema and a check that xgrammar enforces
every keyword it uses: milliseconds for a nested schema, once per process for equal
constraints), so an invalid one is a ``ValueError`` naming the field before anything
reaches the engine. A message decoder of the engine (:func:`validated_elsewhere`) builds
them without that parse: the front end did it, and the engine core's loop must not.
Compiling against the tokenizer happens off the engine loop
(:class:`tandem.structured_output.manager.StructuredOutputManager`).

JSON whitespace: free whitespace between tokens is bounded to
:data:`MAX_WHITESPACE` characters per gap (unbounded, a small model at temperature 0.7
fills ``max_tokens`` with newlines); ``disable_any_whitespace`` gives compact JSON.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
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
# Most whitespace characters xgrammar allows between two JSON tokens: a newline or a space,
# not a run (benchmarks/RESULTS.md, "structured outputs: bounded whitespace": the embedded
# SmolLM2 at temperature 0.7 on name/age/tags takes 45 tokens at 1, 69 at 2, where it puts
# "\n\n" in every gap and overruns max_tokens 80 in half the seeds; unbounded, half of the
# outputs run to max_tokens on newlines).
MAX_WHITESPACE = 1
# The schema of ``json_object``: any object (xgrammar's builtin JSON grammar also allows
# arrays and scalars).
ANY_OBJECT = '{"type": "object"}'
# Set while a message decoder of the engine builds params the front end validated.
_TRUSTED = threading.local()


@contextmanager
def validated_elsewhere() -> Iterator[None]:
    """Params built in this block (on this thread) skip the parse: for the engine's
    message decoders, whose params a front end already validated. A constraint that does
    not compile still fails, on the compile thread, as that request's error."""
    prev = getattr(_TRUSTED, "on", False)
    _TRUSTED.on = True
    try:
        yield
    finally:
        _TRUSTED.on = prev


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
        disable_any_whitespace: JSON without free whitespace: compact separators
            (``,`` and ``:``); else at most :data:`MAX_WHITESPACE` whitespace characters
            between two tokens.
        whitespace_pattern: accepted for vLLM compatibility; xgrammar has no such
            option, so it must be None.

    Raises:
        ValueError: not exactly one constraint, the constraint does not parse, or a JSON
            schema uses a keyword the grammar cannot enforce; the message names the
            field (``structured_outputs.<kind>``), and the keyword and its location.
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
        if not getattr(_TRUSTED, "on", False):
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

    def json_options(self) -> dict[str, Any]:
        """xgrammar's JSON-schema options for this constraint's whitespace."""
        if self.disable_any_whitespace:
            return {"any_whitespace": False, "separators": (",", ":")}
        return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE}

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
                _check_enforced(schema)
                return xgr.Grammar.from_json_schema(self.schema_text(), **self.json_options())
            if kind == "json_object":
                return xgr.Grammar.from_json_schema(ANY_OBJECT, strict_mode=False, **self.json_options())
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
        except RecursionError:
            raise ValueError(f"{field} is invalid: nested too deeply") from None
        except Exception as e:  # xgrammar's parse errors (RuntimeError, InvalidStructuralTagError, ...)
            raise ValueError(f"{field} is invalid: {xgrammar_error(e)}") from None


def _parse_once(params: StructuredOutputsParams) -> None:
    """``params.to_grammar()`` unless an equal constraint parsed in this process already.

    For a schema like the bench's user profile the parse is milliseconds (meta-schema
    check, keyword check and xgrammar's parse); requests sharing a schema pay it once per
    process. Invalid constraints are never remembered.
    """
    try:
        key = params.cache_key()
        hash(key)
    except (TypeError, ValueError, RecursionError):  # a schema JSON cannot encode: to_grammar names the field
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


def _check_enforced(schema: dict | bool) -> None:
    """Refuse a schema the grammar would not enforce, naming the keyword(s) and where."""
    from tandem.structured_output.schema_check import unenforced_keywords

    found = unenforced_keywords(schema)
    if found:
        where = ", ".join(f"{kw!r} at {at or '/'}" for kw, at in found)
        raise ValueError(f"the grammar backend cannot enforce {where}; remove or rewrite "
                         f"{'it' if len(found) == 1 else 'them'} (the output would not be checked against "
                         f"{'it' if len(found) == 1 else 'them'})")


# vLLM's name for the same parameters before v0.10.2.
GuidedDecodingParams = StructuredOutputsParams
