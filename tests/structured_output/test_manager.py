"""StructuredOutputManager with the embedded SmolLM2 tokenizer: compiles every kind of
constraint off the calling thread, caches equal ones, builds bitmask rows that allow a
valid continuation and forbid an invalid one, and ends at the stop token; its batched
accept and fill give what one xgrammar call per sequence gives."""

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
        manager.accept_tokens([req], [tok])
        assert not req.structured_output.finished
    eos = smol_tokenizer.eos_token_id
    assert _allowed(manager, req)[eos]
    manager.accept_tokens([req], [eos])
    assert req.structured_output.finished and req.structured_output.matcher.is_terminated()


def test_equal_constraints_share_one_compile(manager):
    a, b = _req(regex="[xy]+"), _req(regex="[xy]+")
    manager.init_request(a)
    manager.init_request(b)
    assert a.structured_output._compiled is b.structured_output._compiled
    assert a.structured_output.matcher is not b.structured_output.matcher  # own state per sequence


def test_compiled_grammars_kept_are_bounded(smol_tokenizer, monkeypatch):
    """A server sees a new schema in many requests: the manager keeps the last _CACHE_SIZE
    compiles, and xgrammar's compiler keeps none of its own (unbounded by default)."""
    import tandem.structured_output.manager as mod

    monkeypatch.setattr(mod, "_CACHE_SIZE", 2)
    m = StructuredOutputManager(smol_tokenizer, VOCAB, {smol_tokenizer.eos_token_id})
    try:
        for i in range(5):
            req = _req(json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]})
            m.init_request(req)
            req.structured_output._compiled.result(timeout=120)
        assert len(m._cache) == 2
        assert m._compiler.get_cache_size_bytes() == 0
    finally:
        m.shutdown()


def test_compiled_grammars_kept_are_bounded_in_bytes(smol_tokenizer, monkeypatch):
    """Beside the count, the bytes of the kept compiles are bounded (the oldest go first;
    the newest stays even alone over the bound)."""
    import tandem.structured_output.manager as mod

    m = StructuredOutputManager(smol_tokenizer, VOCAB, {smol_tokenizer.eos_token_id})
    try:
        reqs = []
        for i in range(4):
            req = _req(json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]})
            m.init_request(req)
            req.structured_output._compiled.result(timeout=120)
            reqs.append(req)
        one = reqs[0].structured_output._compiled.result().memory_size_bytes
        monkeypatch.setattr(mod, "_CACHE_BYTES", 2 * one)
        m._evict()
        assert list(m._cache.values()) == [r.structured_output._compiled for r in reqs[2:]]
        monkeypatch.setattr(mod, "_CACHE_BYTES", 1)
        m._evict()
        assert list(m._cache.values()) == [reqs[3].structured_output._compiled]
    finally:
        m.shutdown()


def test_missing_sequence_gets_an_all_allowed_row(manager):
    out = manager.grammar_bitmask([12345], {})
    assert out.seq_ids == [12345] and bool((out.bitmask == -1).all())


def test_all_allowed_rows_do_not_keep_an_earlier_step_s_bits(manager):
    """The buffer is reused: a row filled by one step's grammar, then given to a finished
    or missing sequence, is all-allowed again."""
    req = _ready(manager, regex="ab")
    first = manager.grammar_bitmask([req.seq_id, 777], {req.seq_id: req}).bitmask
    assert not bool((first[0] == -1).all())
    req.structured_output.finished = True
    again = manager.grammar_bitmask([req.seq_id, 777], {req.seq_id: req}).bitmask
    assert bool((again == -1).all())


def _ready(manager, **kwargs) -> Request:
    req = _req(**kwargs)
    manager.init_request(req)
    req.structured_output._compiled.result(timeout=120)
    return req


def test_a_refused_token_finishes_only_its_sequence(manager, smol_tokenizer, caplog):
    """One batched accept where one grammar refuses its token: that sequence is finished
    (with a warning naming it), its matcher unchanged; the others advanced."""
    enc = lambda t: smol_tokenizer.encode(t, add_special_tokens=False)[0]  # noqa: E731
    reqs = [_ready(manager, regex="[ab]+"), _ready(manager, regex="[ab]+"), _ready(manager, choice=["xy", "zz"])]
    reqs[1].request_id = "refuses"
    manager.accept_tokens(reqs, [enc("a"), enc("q"), enc("z")])
    assert [r.structured_output.finished for r in reqs] == [False, True, False]
    assert "request refuses: token" in caplog.text
    assert _allowed(manager, reqs[1])[enc("a")]  # still at its start
    assert _allowed(manager, reqs[2])[enc("z")] and not _allowed(manager, reqs[2])[enc("y")]


def test_batched_bitmask_equals_one_fill_per_sequence(manager, smol_tokenizer):
    """The one-call fill of a step's rows equals xgrammar's per-matcher fill row by row,
    for sequences in different states; rows of a missing sequence and of a finished
    grammar allow everything."""
    import xgrammar as xgr

    reqs = [_ready(manager, json={"type": "object", "properties": {"a": {"type": "integer"}}}),
            _ready(manager, regex="[a-c]{2}-[0-9]"), _ready(manager, json_object=True),
            _ready(manager, choice=["alpha", "beta"]), _ready(manager, regex="[a-c]{2}-[0-9]")]
    prefixes = ['{"a": 1', "ab", '{"k": [', "", "ab-1"]
    for req, text in zip(reqs, prefixes):
        for tok in smol_tokenizer.encode(text, add_special_tokens=False):
            manager.accept_tokens([req], [tok])
    manager.accept_tokens([reqs[4]], [smol_tokenizer.eos_token_id])
    assert reqs[4].structured_output.finished
    live = {r.seq_id: r for r in reqs}
    seq_ids = [reqs[2].seq_id, 999_999, reqs[0].seq_id, reqs[4].seq_id, reqs[3].seq_id, reqs[1].seq_id]
    got = manager.grammar_bitmask(seq_ids, live)
    assert got.seq_ids == seq_ids
    want = xgr.allocate_token_bitmask(len(seq_ids), VOCAB)
    for row, sid in enumerate(seq_ids):
        if sid in live and not live[sid].structured_output.finished:
            live[sid].structured_output.matcher.fill_next_token_bitmask(want, row)
    assert torch.equal(got.bitmask, want)
    assert bool((got.bitmask[1] == -1).all()) and bool((got.bitmask[3] == -1).all())
    assert not bool((got.bitmask[0] == -1).all())
