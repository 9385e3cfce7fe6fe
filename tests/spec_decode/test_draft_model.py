"""Draft-model speculative decoding (stage 3 of issue 46): greedy output equal
to no speculation whether the draft agrees (the embedded model as its own draft: nearly every
draft accepted) or mostly not (a smaller random draft of a random target), stops and lengths
exact, preemption and abort freeing every block, and the draft models refused with one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tandem.entrypoints.llm import LLM
from tandem.model_loader.loader import load_hf_config, load_tokenizer
from tandem.sampling_params import SamplingParams
from tandem.spec_decode.draft_model import check_draft_model
from tests.conftest import PROMPTS, assert_all_blocks_free, make_llm

LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6)
# A smaller model over the same vocabulary: the target's first layer alone (dummy weights are
# drawn in order from one seed), so it agrees with the target on some tokens only.
DRAFT = {**LLAMA, "num_hidden_layers": 1}
TOKEN_PROMPTS = [[5, 17, 99, 23, 41, 7, 7, 8, 250, 3, 11], [5, 17, 99, 23, 41, 7, 7, 8, 12], list(range(1, 30)),
                 [300, 301, 302] * 6]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _folder(tmp_path_factory, name: str, config: dict) -> str:
    d = tmp_path_factory.mktemp(name)
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _folder(tmp_path_factory, "target", LLAMA), _folder(tmp_path_factory, "draft", DRAFT)


def _tiny_llm(target: str, tokenizer: str, draft: str | None, **kw) -> LLM:
    spec = None if draft is None else {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                                       "disable_by_batch_size": None}
    args = dict(tokenizer=tokenizer, load_format="dummy", block_size=8, num_kv_blocks=64, max_model_len=128,
                dtype="float32", speculative_config=spec)
    return LLM(target, **{**args, **kw})


def _ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _stats(llm: LLM) -> dict:
    return llm.engine.core.debug_stats()


@pytest.fixture(scope="module")
def tiny_reference(tiny, embedded_model_path):
    llm = _tiny_llm(tiny[0], embedded_model_path, None)
    ids = _ids(llm, TOKEN_PROMPTS)
    llm.engine.shutdown()
    return ids


def test_a_disagreeing_draft_leaves_greedy_output_unchanged(tiny, embedded_model_path, tiny_reference):
    llm = _tiny_llm(tiny[0], embedded_model_path, tiny[1])
    assert _ids(llm, TOKEN_PROMPTS) == tiny_reference
    solo = [_ids(llm, [p])[0] for p in TOKEN_PROMPTS]
    assert solo == tiny_reference
    stats = _stats(llm)
    # Not vacuous: drafts were verified, and some were rejected (KV slots written again).
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert len(llm.engine.core.runner.drafter.kv_caches) == DRAFT["num_hidden_layers"]
    assert_all_blocks_free(llm.engine)
    llm.engine.shutdown()


def test_preemption_keeps_greedy_output_and_frees_every_block(tiny, embedded_model_path, tiny_reference):
    llm = _tiny_llm(tiny[0], embedded_model_path, tiny[1], num_kv_blocks=9, max_num_seqs=4)
    assert _ids(llm, TOKEN_PROMPTS) == tiny_reference
    assert _stats(llm)["num_preemptions"] > 0
    assert_all_blocks_free(llm.engine)
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def self_draft(embedded_model_path):
    """The embedded model (fp32) drafting for itself."""
    llm = make_llm(speculative_config={"method": "draft_model", "model": embedded_model_path,
                                       "num_speculative_tokens": 4, "disable_by_batch_size": None})
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def reference():
    llm = make_llm()
    params = SamplingParams(temperature=0, max_tokens=32)
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    llm.engine.shutdown()
    return {p: o.outputs[0] for p, o in zip(PROMPTS[:4], outs)}


def test_the_model_as_its_own_draft_gets_its_drafts_accepted(self_draft, reference):
    before = _stats(self_draft)
    outs = self_draft.generate(list(reference), SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in reference.values()]
    after = _stats(self_draft)
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    # The same weights propose what they verify; a near-tie may round otherwise in a
    # forward of one row than of five.
    assert drafted > 0 and accepted >= 0.95 * drafted, (accepted, drafted)
    assert_all_blocks_free(self_draft.engine)


def test_the_catch_up_after_a_verified_step_leaves_out_what_the_proposal_wrote(self_draft, reference):
    """After a verified step the draft model computes only the K/V its proposal did not write
    (the last draft when all were accepted, and the emitted token): one or two rows per
    sequence, with its drafts still accepted; a finished request's record goes."""
    drafter = self_draft.engine.core.runner.drafter
    rows, inner = [], drafter._catch_up

    def catch_up(inputs, ids):
        rows.append(np.diff(inputs.query_start_loc).tolist())
        return inner(inputs, ids)

    drafter._catch_up = catch_up
    try:
        before = _stats(self_draft)
        outs = self_draft.generate(list(reference)[:2], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    finally:
        del drafter._catch_up
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in list(reference.values())[:2]]
    after = _stats(self_draft)
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert drafted > 0 and accepted >= 0.95 * drafted, (accepted, drafted)
    later = [r for r in rows if max(r) <= 2]
    assert len(later) >= 5 and len(later) >= len(rows) - 2, rows  # all but the prompts' catch-ups
    finished = set(drafter._written)  # told to the runner with the next step
    self_draft.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert not finished & set(drafter._written)


def test_stop_token_and_max_tokens_inside_an_accepted_run(self_draft, reference):
    prompt = PROMPTS[2]
    ref = reference[prompt].token_ids
    stop = ref[9]
    params = SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop])
    (out,) = self_draft.generate(prompt, params, use_tqdm=False)
    assert out.outputs[0].token_ids == ref[:ref.index(stop) + 1] and out.outputs[0].stop_reason == stop
    (out,) = self_draft.generate(prompt, SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)
    assert out.outputs[0].token_ids == ref[:7] and out.outputs[0].finish_reason == "length"
    assert_all_blocks_free(self_draft.engine)


def test_seeded_sampling_reproduces_beside_other_requests(self_draft):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, n=2, max_tokens=20)
    first = self_draft.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs
    again = self_draft.generate(PROMPTS[:3], params, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert all(len(c.token_ids) == 20 for c in first)
    assert_all_blocks_free(self_draft.engine)


def test_abort_frees_every_block(self_draft):
    engine = self_draft.engine
    engine.add_request("a", PROMPTS[3], SamplingParams(temperature=0, max_tokens=64))
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


def test_drafts_get_lookahead_slots_for_their_kv(self_draft):
    engine = self_draft.engine
    engine.add_request("b", PROMPTS[0], SamplingParams(temperature=0, max_tokens=40))
    engine.step()  # the prompt, its first token, and the drafts after it (in flight)
    engine.step()  # taken in; a step verifying them, taken in at once
    req = next(iter(engine.core.scheduler.requests.values()))
    blocks = engine.core.kv_manager.req_blocks[req.seq_id]
    assert len(req.draft_token_ids) == 4
    # The draft model wrote its drafts' K/V at positions up to prompt + 4 - 1.
    assert len(blocks) * 16 >= req.num_tokens + 3
    engine.abort_request("b")
    engine.step()
    assert_all_blocks_free(engine)


# ----------------------------------------------------------------- refusals
def test_a_draft_of_another_vocabulary_or_a_shorter_context_is_refused(tiny, tmp_path, embedded_model_path):
    target_hf = load_hf_config(tiny[0])
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**DRAFT, "vocab_size": 300}))
    with pytest.raises(ValueError, match="vocabulary of 300 tokens, the target 512"):
        _tiny_llm(tiny[0], embedded_model_path, str(other))
    short = tmp_path / "short"
    short.mkdir()
    (short / "config.json").write_text(json.dumps({**DRAFT, "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match=r"context of 64 tokens, below max_model_len \(128\)"):
        check_draft_model(target_hf, load_hf_config(str(short)), embedded_model_path, str(short), 128)
    empty = tmp_path / "empty"  # a folder that is no model: the error names the field
    empty.mkdir()
    with pytest.raises(ValueError, match="speculative_config.model: model folder .* has no config.json"):
        _tiny_llm(tiny[0], embedded_model_path, str(empty))


def test_a_draft_with_other_tokens_is_refused(tmp_path, embedded_model_path):
    """Same vocabulary size, two tokens swapped: not the target's tokenizer."""
    target_hf = load_hf_config(embedded_model_path)
    # The tokenizer the check loads for the target (the session fixture's may differ by
    # what earlier tests added to it).
    target_tokenizer = load_tokenizer(embedded_model_path)

    def draft_folder(name: str, swap: bool) -> str:
        data = json.loads(target_tokenizer.backend_tokenizer.to_str())
        vocab = data["model"]["vocab"]
        if swap:
            vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
        d = tmp_path / name
        d.mkdir()
        (d / "tokenizer.json").write_text(json.dumps(data))
        (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        (d / "config.json").write_text(json.dumps({**DRAFT, "vocab_size": target_hf.vocab_size}))
        return str(d)

    swapped, same = draft_folder("swapped", True), draft_folder("same", False)
    with pytest.raises(ValueError, match="another tokenizer than the target"):
        check_draft_model(target_hf, load_hf_config(swapped), embedded_model_path, swapped, 128)
    check_draft_model(target_hf, load_hf_config(same), embedded_model_path, same, 128)
