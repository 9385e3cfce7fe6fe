"""StructuredOutputsParams: one constraint, parsed up front, errors naming the field."""

from __future__ import annotations

import pytest

from tandem.sampling_params import SamplingParams
from tandem.structured_output import GuidedDecodingParams, StructuredOutputsParams


@pytest.mark.parametrize("kwargs", [
    {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    {"json": '{"type": "array", "items": {"enum": [1, 2]}, "maxItems": 3}'},
    {"json_object": True},
    {"regex": r"\d{3}-[a-z]+"},
    {"choice": ["yes", 'say "no"', "żółw"]},
    {"grammar": 'root ::= "a" b\nb ::= [0-9]+'},
    {"structural_tag": '{"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"], '
                       '"tags": [{"begin": "<f>", "content": {"type": "json_schema", "json_schema": {}}, "end": "</f>"}]}}'},
])
def test_valid(kwargs):
    p = StructuredOutputsParams(**kwargs)
    assert p.kind == next(iter(kwargs))
    assert p.cache_key() == StructuredOutputsParams(**kwargs).cache_key()


@pytest.mark.parametrize("kwargs, field", [
    ({"json": {"type": "foo"}}, "structured_outputs.json"),
    ({"json": {"type": "string", "minLength": "x"}}, "structured_outputs.json"),
    ({"json": {"$ref": "#/$defs/missing"}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": [1, 2]}, "structured_outputs.json"),
    ({"regex": "(unclosed"}, "structured_outputs.regex"),
    ({"regex": "[a-"}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 3]}, "structured_outputs.choice"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
    ({"grammar": 'start ::= "a"'}, "structured_outputs.grammar"),
    ({"structural_tag": '{"type": "structural_tag", "format": {"type": "nope"}}'}, "structured_outputs.structural_tag"),
    ({"structural_tag": "{not json"}, "structured_outputs.structural_tag"),
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json_object": True, "whitespace_pattern": " "}, "whitespace_pattern"),
])
def test_invalid_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as e:
        StructuredOutputsParams(**kwargs)
    assert "/project/cpp" not in str(e.value)  # xgrammar's C++ location is stripped


def test_sampling_params_field():
    p = SamplingParams(structured_outputs={"regex": "[ab]+"})
    assert isinstance(p.structured_outputs, StructuredOutputsParams) and p.structured_outputs.regex == "[ab]+"
    assert p.clone(n=2).structured_outputs is p.structured_outputs
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        SamplingParams(structured_outputs={"regex": "("})
    assert GuidedDecodingParams is StructuredOutputsParams


def test_json_schema_cache_key_ignores_dict_vs_text():
    schema = {"type": "object"}
    a = StructuredOutputsParams(json=schema)
    b = StructuredOutputsParams(json='{"type": "object"}')
    assert a.cache_key() == b.cache_key()
    assert a.cache_key() != StructuredOutputsParams(json=schema, disable_any_whitespace=True).cache_key()
