"""StructuredOutputManager with the embedded SmolLM2 tokenizer: compiles every kind of
constraint off the calling thread, caches equal ones, builds bitmask rows that allow a
valid continuation and forbid an invalid one, and ends at the stop token."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.request import Request
from tandem.sampling_params import SamplingParams
from tandem.structured_output import StructuredOutputsParams
from tandem.structured_output.manager import StructuredOutputManager

VOCAB = 49152


@pytest.fixture(scope="module")
def manager(smol_tokenizer):
    m = StructuredOutputManager(smol_tokenizer, VOCAB, {smol_tokenizer.eos_token_id})
    yield m
    m.shutdown()


def _req(**kwargs) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs)), 0.0)


def _allowed(manager, req) -> torch.Tensor:
    mask = manager.grammar_bitmask([req.seq_id], {req.seq_id: req}).bitmask[0]
    bits = (mask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:VOCAB].bool()


@pytest.mark.parametrize("kwargs, text, bad", [
    ({"json": {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}}, '{"a": 2}', "["),
    ({"json_object": True}, '{"k": [1, true]}', "x"),
    ({"regex": "[a-c]{2}-[0-9]"}, "ab-7", "z"),
    ({"choice": ["alpha", "beta"]}, "beta", "gamma"),
    ({"grammar": 'root ::= "ok" [!?]'}, "ok!", "no"),
    ({"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<v>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
        "end": "</v>"}})}, "<v>42</v>", "x"),
])
def test_walk_a_valid_output(manager, smol_tokenizer, kwargs, text, bad):
    req = _req(**kwargs)
    manager.init_request(req)
    req.structured_output._compiled.result(timeout=120)
    assert req.structured_output.is_ready() and manager.take_failed() == []
    bad_id = smol_tokenizer.encode(bad, add_special_tokens=False)[0]
    assert not _allowed(manager, req)[bad_id]
    for tok in smol_tokenizer.encode(text, add_special_tokens=False):
        assert _allowed(manager, req)[tok], (text, tok)
        assert req.structured_output.accept_token(tok)
    eos = smol_tokenizer.eos_token_id
    assert _allowed(manager, req)[eos]
    assert req.structured_output.accept_token(eos) and req.structured_output.is_terminated()


def test_equal_constraints_share_one_compile(manager):
    a, b = _req(regex="[xy]+"), _req(regex="[xy]+")
    manager.init_request(a)
    manager.init_request(b)
    assert a.structured_output._compiled is b.structured_output._compiled
    assert a.structured_output.matcher is not b.structured_output.matcher  # own state per sequence


def test_missing_sequence_gets_an_all_allowed_row(manager):
    out = manager.grammar_bitmask([12345], {})
    assert out.seq_ids == [12345] and bool((out.bitmask == -1).all())
