"""JSON-schema keywords the xgrammar backend does not enforce.

xgrammar turns a schema into a grammar and silently drops what it cannot express, so an
output it allows may break the schema. Which keywords it drops was found by compiling a
schema per keyword with xgrammar 0.2.9 and checking that a string breaking the keyword is
refused (tests/structured_output/test_schema_check.py keeps those probes): a schema using
one is refused up front by name (the server answers 400) instead of a 200 whose output
breaks it. Keywords that only annotate (``title``, ``format`` alone, ``contentEncoding``,
...) are not assertions and pass.
"""

from __future__ import annotations

from typing import Any

# Never enforced wherever they appear.
_IGNORED = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
            "dependentSchemas", "dependencies")
# Keywords that neither assert nor change the grammar.
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly", "$schema",
    "$id", "$anchor", "$dynamicAnchor", "$vocabulary", "$defs", "definitions", "contentMediaType", "contentEncoding",
    "contentSchema",
})
# Assertions xgrammar applies only when the schema's "type" names their type.
_STRING_KEYWORDS = ("minLength", "maxLength", "pattern")
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# Subschema positions: keyword -> how its value holds subschemas.
_ONE = ("additionalProperties", "items", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
        "additionalItems", "not", "if", "then", "else", "contains")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def unenforced_keywords(schema: Any) -> list[tuple[str, str]]:
    """The keywords of ``schema`` an xgrammar grammar would not enforce.

    Args:
        schema: a JSON schema (dict or bool) that passed its meta-schema check.

    Returns:
        ``(keyword, location)`` pairs, ``location`` a JSON pointer to the subschema
        holding the keyword (``""`` for the root); empty when every assertion is enforced.
    """
    found: list[tuple[str, str]] = []
    _walk(schema, "", schema, found)
    return found


def _walk(s: Any, at: str, root: Any, found: list[tuple[str, str]]) -> None:
    if not isinstance(s, dict):
        return
    for kw in _problems(s, root):
        found.append((kw, at))
    for kw in _ONE:
        if kw in s:
            _walk(s[kw], f"{at}/{kw}", root, found)
    for kw in _LIST:
        if isinstance(s.get(kw), list):
            for i, sub in enumerate(s[kw]):
                _walk(sub, f"{at}/{kw}/{i}", root, found)
    for kw in _MAP:
        if isinstance(s.get(kw), dict):
            for name, sub in s[kw].items():
                _walk(sub, f"{at}/{kw}/{_escape(name)}", root, found)


def _problems(s: dict, root: Any) -> list[str]:
    """The unenforced keywords of one subschema (its own keywords, not its children's)."""
    out = [kw for kw in _IGNORED if kw in s]
    if s.get("uniqueItems") is True:
        out.append("uniqueItems")
    types = s.get("type")
    types = {types} if isinstance(types, str) else set(types or ())
    if "format" in s or "pattern" in s:  # the format's or pattern's regex wins over the rest
        out += [kw for kw in ("minLength", "maxLength") if kw in s]
        if "format" in s and "pattern" in s:
            out.append("pattern")
    fixed = "enum" in s or "const" in s  # its values are checked against the rest instead
    if "string" not in types and not fixed:
        out += [kw for kw in _STRING_KEYWORDS if kw in s and kw not in out]
    if not types & {"integer", "number"}:
        out += [kw for kw in _NUMBER_KEYWORDS if kw in s and not fixed]
    elif "multipleOf" in s and (not isinstance(s["multipleOf"], int) or "number" in types):
        out.append("multipleOf")  # only an integer multiple of an integer is enforced
    if "minItems" in s or "maxItems" in s:
        if "array" not in types and "items" not in s and "prefixItems" not in s and not fixed:
            out += [kw for kw in ("minItems", "maxItems") if kw in s]
    if isinstance(s.get("required"), list):
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        if any(name not in props for name in s["required"]):
            out.append("required")  # a required name with no property schema
    out += _combinator_problems(s, root)
    return out


def _combinator_problems(s: dict, root: Any) -> list[str]:
    """What a combinator, ``$ref``, ``enum`` or ``const`` makes xgrammar drop: their
    sibling assertions (it uses the combinator alone), ``allOf`` of several schemas,
    ``oneOf`` whose schemas may overlap (matched as ``anyOf``), enum values that break
    their siblings."""
    out = []
    siblings = [kw for kw in s if kw not in _ANNOTATIONS]
    for comb in ("$ref", "anyOf", "oneOf", "allOf"):
        if comb in s:
            out += [kw for kw in siblings if kw != comb and kw not in out]
            break
    if isinstance(s.get("allOf"), list) and len(s["allOf"]) > 1:
        out.append("allOf")
    if isinstance(s.get("oneOf"), list) and not _exclusive(s["oneOf"]):
        out.append("oneOf")
    if ("enum" in s or "const" in s) and not any(c in s for c in ("$ref", "anyOf", "oneOf", "allOf")):
        values = s["enum"] if isinstance(s.get("enum"), list) else []
        values = values + ([s["const"]] if "const" in s else [])
        if any(kw not in ("enum", "const") for kw in siblings) and not _all_valid(values, s, root):
            out += [kw for kw in siblings if kw not in ("enum", "const")]
    return out


def _all_valid(values: list, s: dict, root: Any) -> bool:
    """Every value valid against ``s`` (``$ref`` resolved against ``root``)."""
    import jsonschema

    validator = jsonschema.validators.validator_for(root)(root).evolve(schema=s)
    return all(validator.is_valid(v) for v in values)


def _exclusive(branches: list) -> bool:
    """No JSON value can match two of ``branches``: each pair differs in a single type
    (integer within number counts as overlap) or in the const of a property both require."""
    for i, a in enumerate(branches):
        for b in branches[i + 1:]:
            if not (isinstance(a, dict) and isinstance(b, dict)) or not (_types_disjoint(a, b) or _tags_differ(a, b)):
                return False
    return True


def _types_disjoint(a: dict, b: dict) -> bool:
    ta, tb = a.get("type"), b.get("type")
    if not isinstance(ta, str) or not isinstance(tb, str):
        return False
    return ta != tb and {ta, tb} != {"integer", "number"}


def _tags_differ(a: dict, b: dict) -> bool:
    pa, pb = a.get("properties") or {}, b.get("properties") or {}
    both = set(a.get("required") or ()) & set(b.get("required") or ()) & set(pa) & set(pb)
    return any(isinstance(pa[k], dict) and isinstance(pb[k], dict) and "const" in pa[k] and "const" in pb[k]
               and pa[k]["const"] != pb[k]["const"] for k in both)


def _escape(name: str) -> str:
    """A JSON-pointer reference token (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")
