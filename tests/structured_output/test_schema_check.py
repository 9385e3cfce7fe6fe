"""Schemas whose keywords xgrammar would not enforce are refused by keyword and location;
each probe first shows that xgrammar's grammar of the schema accepts a string breaking the
keyword (so the refusal is needed, and a newer xgrammar that enforces it fails here)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from tandem.structured_output import StructuredOutputsParams
from tandem.structured_output.schema_check import unenforced_keywords

P = {"a": {"type": "integer"}, "b": {"type": "integer"}}
# (schema, a string breaking it, the keyword refused, its location)
UNENFORCED = [
    ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}},
      "required": ["code"]}, '{"code":"code"}', "maxLength", "/properties/code"),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, '"a"', "minLength", ""),
    ({"type": "string", "format": "email", "maxLength": 5}, '"abcdef@g.com"', "maxLength", ""),
    ({"type": "string", "format": "date", "pattern": "^2"}, '"1999-01-01"', "pattern", ""),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]", "uniqueItems", ""),
    ({"type": "array", "items": {"not": {"type": "null"}}}, "[null]", "not", "/items"),
    ({"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 5}]}, "9", "allOf", ""),
    ({"type": "integer", "allOf": [{"maximum": 5}]}, "9", "type", ""),
    ({"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 0}]}, "1", "oneOf", ""),
    ({"type": "object", "properties": P, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "{}", "properties", ""),
    ({"$defs": {"a": {"type": "integer"}}, "type": "object", "required": ["x"],
      "properties": {"x": {"$ref": "#/$defs/a", "minimum": 2}}}, '{"x":1}', "minimum", "/properties/x"),
    ({"type": "number", "multipleOf": 0.5}, "1.3", "multipleOf", ""),
    ({"type": "number", "multipleOf": 2}, "3", "multipleOf", ""),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "[2]", "contains", ""),
    ({"type": "object", "properties": P, "dependentRequired": {"a": ["b"]}}, '{"a":1}', "dependentRequired", ""),
    ({"type": "object", "properties": P, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a":1}',
     "dependentSchemas", ""),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}}, "9", "if", ""),
    ({"type": "object", "required": ["a"], "additionalProperties": True}, "{}", "required", ""),
    ({"type": "string", "enum": ["a", "bb"], "maxLength": 1}, '"bb"', "maxLength", ""),
    ({"type": "string", "enum": ["a", 1]}, "1", "type", ""),
    ({"maxLength": 2}, '"abc"', "maxLength", ""),
    ({"maximum": 2}, "3", "maximum", ""),
    ({"minItems": 2}, "[1]", "minItems", ""),
]
ENFORCED = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer",
     "minimum": 0}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
     "required": ["name", "age", "tags"], "additionalProperties": False},
    {"type": "string", "pattern": "^[0-9]{5}$"},
    {"type": "string", "format": "date", "title": "day", "description": "a day"},
    {"type": "integer", "multipleOf": 3, "minimum": 0},
    {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "X"},
    {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "v": {"type": "integer"}}, "required": ["k", "v"]},
               {"type": "object", "properties": {"k": {"const": "b"}, "v": {"type": "string"}}, "required": ["k", "v"]}]},
    {"type": "string", "enum": ["a", "bb"]},
    {"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                     "required": ["c"]}}, "$ref": "#/$defs/n"},
    {"type": ["integer", "null"], "maximum": 3},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "uniqueItems": False},
]


@pytest.mark.parametrize("schema, breaking, keyword, location", UNENFORCED)
def test_unenforced_keyword_is_refused_by_name(schema, breaking, keyword, location):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(breaking), schema)
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True)
    assert _is_grammar_accept_string(grammar, breaking)  # what a 200 would have returned
    assert (keyword, location) in unenforced_keywords(schema)
    with pytest.raises(ValueError, match=f"structured_outputs.json.*'{keyword}' at {location or '/'}"):
        StructuredOutputsParams(json=schema)


@pytest.mark.parametrize("schema", ENFORCED)
def test_enforced_schemas_pass(schema):
    assert unenforced_keywords(schema) == []
    StructuredOutputsParams(json=schema)
