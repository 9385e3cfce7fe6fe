"""StructuredOutputsParams: one constraint, parsed up front (once per process for equal
constraints, the engine core's decode of a request included), errors naming the field."""

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


@pytest.fixture
def parses(monkeypatch):
    """Counts the parses of constraints, starting from an empty per-process memory."""
    from tandem.structured_output import params

    monkeypatch.setattr(params, "_PARSED", params.OrderedDict())
    calls = []
    to_grammar = params.StructuredOutputsParams.to_grammar
    monkeypatch.setattr(params.StructuredOutputsParams, "to_grammar", lambda self: calls.append(self.kind) or
                        to_grammar(self))
    return calls


def test_equal_constraints_parse_once_per_process(parses):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    StructuredOutputsParams(json=schema)
    StructuredOutputsParams(json=dict(schema))
    StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    StructuredOutputsParams(regex="[ab]+")
    assert parses == ["json", "regex"]
    for _ in range(2):  # an invalid constraint is never remembered
        with pytest.raises(ValueError, match="structured_outputs.regex"):
            StructuredOutputsParams(regex="(")
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        StructuredOutputsParams(regex=["unhashable"])
    assert parses == ["json", "regex", "regex", "regex", "regex"]


def test_engine_core_decode_of_a_request_does_not_parse_again(parses):
    """The core decodes every request (msgspec runs __post_init__) on its loop thread: a
    constraint the process parsed already costs no second parse."""
    from tandem.engine.messages import EngineCoreRequest, MsgpackDecoder, MsgpackEncoder

    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}}))
    msg = MsgpackEncoder().encode(EngineCoreRequest("r", [1, 2], params, 4, 0.0))
    decoder = MsgpackDecoder(EngineCoreRequest)
    for _ in range(3):
        assert decoder.decode(msg).sampling_params.structured_outputs == params.structured_outputs
    assert parses == ["json"]


def _accepts(params: StructuredOutputsParams, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(params.to_grammar(), text)


NAME_AGE_TAGS = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                  "tags": {"type": "array", "items": {"type": "string"}}},
                 "required": ["name", "age", "tags"]}


@pytest.mark.parametrize("kwargs", [{"json": NAME_AGE_TAGS}, {"json_object": True}])
def test_json_whitespace_is_bounded(kwargs):
    from tandem.structured_output.params import MAX_WHITESPACE

    p = StructuredOutputsParams(**kwargs)
    gap = "\n" * MAX_WHITESPACE
    assert _accepts(p, f'{{{gap}"name"{gap}:{gap}"x",{gap}"age": 1, "tags": [{gap}"a" ]{gap}}}')
    assert _accepts(p, '{"name": "x", "age": 1, "tags": []}')
    assert not _accepts(p, '{"name":' + "\n" * (MAX_WHITESPACE + 1) + '"x", "age": 1, "tags": []}')


@pytest.mark.parametrize("kwargs", [{"json": NAME_AGE_TAGS}, {"json_object": True}])
def test_disable_any_whitespace_is_compact(kwargs):
    p = StructuredOutputsParams(disable_any_whitespace=True, **kwargs)
    assert _accepts(p, '{"name":"x","age":1,"tags":["a","b"]}')
    for spaced in ('{"name": "x","age":1,"tags":[]}', '{"name":"x", "age":1,"tags":[]}',
                   '{"name":"x","age":1,"tags":["a", "b"]}', '{ "name":"x","age":1,"tags":[]}'):
        assert not _accepts(p, spaced), spaced


@pytest.mark.parametrize("ws", [False, True])
def test_json_object_is_an_object(ws):
    p = StructuredOutputsParams(json_object=True, disable_any_whitespace=ws)
    assert _accepts(p, '{"a":[1,{"b":null}],"c":"d"}')
    for other in ("[1]", "1", '"s"', "null", "true", "[]"):
        assert not _accepts(p, other), other


def test_engine_decoders_do_not_parse_constraints(monkeypatch):
    """A constraint decoded by the engine's message decoder (the engine core's loop) is
    not parsed again: neither xgrammar's parse nor the schema checks run."""
    from tandem.engine.messages import EngineCoreRequest, MsgpackDecoder, MsgpackEncoder
    from tandem.structured_output import params as params_mod

    schema = {"type": "object", "properties": {"decoded_only": {"type": "integer"}}}
    sp = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema))
    data = MsgpackEncoder().encode(EngineCoreRequest("r", [1, 2], sp, 4, 0.0))
    calls = []
    for name in ("_check_schema", "_check_enforced", "_parse_once"):
        monkeypatch.setattr(params_mod, name, lambda *a, name=name: calls.append(name))
    monkeypatch.setattr(StructuredOutputsParams, "to_grammar", lambda self: calls.append("to_grammar"))
    req = MsgpackDecoder(EngineCoreRequest).decode(data)
    assert req.sampling_params.structured_outputs.json == schema
    assert calls == []
    StructuredOutputsParams(json=schema)  # outside the decoder: parsed as ever
    assert calls == ["_parse_once"]


def test_a_schema_nested_too_deeply_is_a_value_error_naming_the_field():
    schema: dict = {"type": "string"}
    for _ in range(3000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match=r"structured_outputs.json is invalid: nested too deeply"):
        StructuredOutputsParams(json=schema)
