"""N-gram speculative decoding through the whole engine (stage 1 of issue 46: synchronous),
on the embedded model in fp32: greedy outputs equal those without speculation, stops and
lengths end exactly where they would, seeds reproduce, preemption and abort free every
block."""

from __future__ import annotations

import pytest

from tandem.request import Request
from tandem.sampling_params import SamplingParams
from tandem.structured_output.params import StructuredOutputsParams
from tests.conftest import PROMPTS, assert_all_blocks_free, make_llm
from tests.structured_output.matcher_faults import FAULTS, expected_error, inject_matcher_fault

# Speculating at every batch size, so that batched steps verify drafts too.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "disable_by_batch_size": None}
REPETITIVE = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32)


@pytest.fixture(scope="module")
def spec_llm():
    return make_llm(speculative_config=SPEC)


@pytest.fixture(scope="module")
def reference(spec_llm):
    """Greedy token ids without speculation, by prompt."""
    llm = make_llm()
    prompts = REPETITIVE + PROMPTS[:4]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    del llm
    return {p: o.outputs[0] for p, o in zip(prompts, outs)}


def _stats(llm):
    return llm.engine.core.debug_stats()


def test_greedy_equals_no_speculation_and_drafts_get_accepted(spec_llm, reference):
    before = _stats(spec_llm)["spec_decode_num_accepted_tokens"]
    outs = spec_llm.generate(list(reference), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in reference.values()]
    stats = _stats(spec_llm)
    assert stats["spec_decode_num_accepted_tokens"] > before  # not vacuous: drafts were verified
    assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"]
    assert_all_blocks_free(spec_llm.engine)


def test_async_output_processing_on_and_off_give_the_same_tokens_and_acceptance(spec_llm, reference):
    """With async on (the default) a step with drafts is taken in before the next is
    scheduled; the others run one step ahead. Tokens and every draft decision are those of
    the fully synchronous loop (public engines shipped acceptance collapses with async on)."""
    assert spec_llm.engine.config.scheduler_config.async_output_proc
    sync = make_llm(speculative_config=SPEC, async_output_proc=False)
    prompts = list(reference)
    runs = []
    for llm in (spec_llm, sync):
        before = _stats(llm)
        ids = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        after = _stats(llm)
        runs.append((ids, [after[k] - before[k] for k in ("spec_decode_num_draft_tokens",
                                                           "spec_decode_num_accepted_tokens", "spec_decode_num_drafts")]))
    assert runs[0] == runs[1] and runs[0][1][1] > 0


def test_above_the_batch_size_limit_steps_run_without_drafts_one_step_ahead(reference):
    """``disable_by_batch_size=2``: while more than two sequences run, no drafts (and the
    steps overlap); once two are left, they speculate. Greedy output is unchanged."""
    llm = make_llm(speculative_config={**SPEC, "disable_by_batch_size": 2})
    core = llm.engine.core
    seen = []
    schedule = core.scheduler.schedule

    def spy():
        so = schedule()
        seen.append((len(core.scheduler.running), sum(len(s.spec_token_ids) for s in so.scheduled),
                     core._inflight is not None))
        return so

    core.scheduler.schedule = spy
    prompts = list(reference)[:4]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (8, 12, 32, 32)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[p].token_ids[:n] for p, n in zip(prompts, (8, 12, 32, 32))]
    assert all(drafts == 0 for running, drafts, _ in seen if running > 2)
    assert any(drafts > 0 for running, drafts, _ in seen if running <= 2)
    assert any(inflight for running, _, inflight in seen if running > 2)  # one step ahead above the limit
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("max_tokens", [5, 13])
def test_max_tokens_is_exact(spec_llm, reference, max_tokens):
    prompt = REPETITIVE[0]
    (out,) = spec_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    assert out.outputs[0].token_ids == reference[prompt].token_ids[:max_tokens]
    assert out.outputs[0].finish_reason == "length"


def test_stop_token_inside_an_accepted_run_ends_there(spec_llm, reference):
    prompt = REPETITIVE[0]
    ref = reference[prompt].token_ids
    stop = ref[10]
    cut = ref.index(stop) + 1
    params = SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop])
    before = _stats(spec_llm)["spec_decode_num_accepted_tokens"]
    (out,) = spec_llm.generate(prompt, params, use_tqdm=False)
    assert out.outputs[0].token_ids == ref[:cut]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert _stats(spec_llm)["spec_decode_num_accepted_tokens"] > before
    assert_all_blocks_free(spec_llm.engine)


def test_stop_string_ends_the_text_exactly(spec_llm, reference):
    prompt = REPETITIVE[0]
    text = reference[prompt].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=32, stop=[stop])
    (out,) = spec_llm.generate(prompt, params, use_tqdm=False)
    assert out.outputs[0].text == text[:text.index(stop)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert_all_blocks_free(spec_llm.engine)


def test_seeded_sampling_reproduces_and_n_completions(spec_llm, reference):
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, min_p=0.02, seed=7, n=2, max_tokens=24)
    prompts = REPETITIVE[:1]
    first = spec_llm.generate(prompts, params, use_tqdm=False)[0].outputs
    # Again, next to other requests: a seeded sequence depends on nothing else in the batch.
    again = spec_llm.generate(prompts + PROMPTS[:2], params, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len(first) == 2 and all(len(c.token_ids) == 24 for c in first)
    greedy = spec_llm.generate(prompts, SamplingParams(temperature=0, n=2, max_tokens=32), use_tqdm=False)
    assert all(c.token_ids == reference[prompts[0]].token_ids for c in greedy[0].outputs)
    assert_all_blocks_free(spec_llm.engine)


def test_prompt_logprobs_leave_the_output_unchanged(spec_llm, reference):
    prompt = REPETITIVE[1]
    params = SamplingParams(temperature=0, max_tokens=32, prompt_logprobs=1)
    (out,) = spec_llm.generate(prompt, params, use_tqdm=False)
    assert out.outputs[0].token_ids == reference[prompt].token_ids
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None


def test_logprobs_of_accepted_tokens_equal_those_without_speculation(spec_llm, reference):
    """Each emitted token's logprob, top logprobs and rank come from the target's logits of
    its position: the same as one token per step gives (fp32, tolerance for the GEMM's
    row count)."""
    prompt = REPETITIVE[0]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
    before = _stats(spec_llm)["spec_decode_num_accepted_tokens"]
    (out,) = spec_llm.generate(prompt, params, use_tqdm=False)
    assert _stats(spec_llm)["spec_decode_num_accepted_tokens"] > before
    plain = make_llm()
    (ref,) = plain.generate(prompt, params, use_tqdm=False)
    got, want = out.outputs[0], ref.outputs[0]
    assert got.token_ids == want.token_ids and len(got.logprobs) == len(got.token_ids)
    for tok, pos_got, pos_want in zip(got.token_ids, got.logprobs, want.logprobs):
        assert list(pos_got) == list(pos_want)  # the token, then the same top 3 in order
        assert pos_got[tok].rank == pos_want[tok].rank == 1
        for t in pos_want:
            assert pos_got[t].logprob == pytest.approx(pos_want[t].logprob, abs=1e-4)
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)


def test_logit_bias_and_allowed_token_ids_hold_at_every_verified_position(spec_llm):
    """Greedy with a bias or an allowed set: the same tokens as without speculation."""
    prompt = REPETITIVE[0]
    plain = make_llm()
    (first,) = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    ids = first.outputs[0].token_ids
    banned = ids[3]
    for params in (SamplingParams(temperature=0, max_tokens=24, logit_bias={banned: -100.0}),
                   SamplingParams(temperature=0, max_tokens=24, allowed_token_ids=sorted(set(ids) - {banned}))):
        (want,) = plain.generate(prompt, params, use_tqdm=False)
        (got,) = spec_llm.generate(prompt, params, use_tqdm=False)
        assert banned not in want.outputs[0].token_ids
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert_all_blocks_free(spec_llm.engine)


@pytest.mark.parametrize("penalty", [dict(presence_penalty=0.8), dict(frequency_penalty=0.6),
                                     dict(repetition_penalty=1.3)])
def test_penalties_count_the_drafts_before_each_verified_position(spec_llm, penalty):
    """Greedy with a penalty: the same tokens as without speculation (each position is
    penalised for the accepted drafts before it), and the repetitive prompt still gets
    drafts accepted."""
    prompt = REPETITIVE[0]
    params = SamplingParams(temperature=0, max_tokens=24, **penalty)
    plain = make_llm()
    (want,) = plain.generate(prompt, params, use_tqdm=False)
    before = _stats(spec_llm)["spec_decode_num_draft_tokens"]
    (got,) = spec_llm.generate(prompt, params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert _stats(spec_llm)["spec_decode_num_draft_tokens"] > before
    assert_all_blocks_free(spec_llm.engine)


@pytest.mark.parametrize("constraint", [
    {"regex": r"( [0-9]+,){12}"},
    {"json": {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"},
                                                           "minItems": 6, "maxItems": 6}},
              "required": ["numbers"]}},
])
def test_structured_outputs_mask_every_verified_position(spec_llm, constraint):
    """Drafts are cut to what the grammar accepts and every verified position gets its
    grammar's mask: greedy constrained output equals the one without speculation, and
    drafts are accepted."""
    prompt = REPETITIVE[0]
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=constraint)
    plain = make_llm()
    (want,) = plain.generate(prompt, params, use_tqdm=False)
    before = _stats(spec_llm)["spec_decode_num_accepted_tokens"]
    (got,) = spec_llm.generate(prompt, params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].finish_reason == want.outputs[0].finish_reason == "stop"
    assert _stats(spec_llm)["spec_decode_num_accepted_tokens"] > before
    assert_all_blocks_free(spec_llm.engine)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_failing_matcher_with_drafts_finishes_only_its_request(spec_llm, monkeypatch, fault):
    """A grammar matcher that fails while its drafts are cut, masked or accepted ends its
    request alone ("abort" with the error); a constrained request verifying drafts in the
    same steps gives what it gives without it, and every block is freed."""
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs={"regex": r"( [0-9]+,){12}"})
    (want,) = spec_llm.generate(REPETITIVE[0], params, use_tqdm=False)
    bad_prompt = spec_llm.get_tokenizer().encode(REPETITIVE[0] + " 4, 5,")
    inject_matcher_fault(monkeypatch, spec_llm.engine.core.structured_output, bad_prompt, fault, after=6)
    got = spec_llm.generate([REPETITIVE[0], {"prompt_token_ids": bad_prompt}], params, use_tqdm=False)
    assert got[1].error == expected_error(fault) and got[1].outputs[0].finish_reason == "abort"
    assert got[0].outputs[0].token_ids == want.outputs[0].token_ids and got[0].error is None
    assert_all_blocks_free(spec_llm.engine)


def test_bad_words_are_banned_at_every_verified_position(spec_llm, reference):
    """A two-token bad word whose first token the drafts supply: each verified position
    checks the sequence's tokens with the drafts before it, as one token per step does."""
    prompt = REPETITIVE[0]
    plain = make_llm()
    text = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    words = [text[2:6], " 9"]  # a piece of the answer, and a word the counting reaches
    params = SamplingParams(temperature=0, max_tokens=24, bad_words=words)
    (want,) = plain.generate(prompt, params, use_tqdm=False)
    before = _stats(spec_llm)["spec_decode_num_accepted_tokens"]
    (got,) = spec_llm.generate(prompt, params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert want.outputs[0].text != text  # not vacuous: the words changed the answer
    assert _stats(spec_llm)["spec_decode_num_accepted_tokens"] > before
    assert_all_blocks_free(spec_llm.engine)


def test_abort_frees_every_block(spec_llm):
    engine = spec_llm.engine
    engine.add_request("a", REPETITIVE[0], SamplingParams(temperature=0, max_tokens=64))
    for _ in range(4):
        engine.step()
    assert engine.core.scheduler.num_draft_tokens > 0
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


def test_preemption_keeps_greedy_output_and_frees_every_block(reference):
    llm = make_llm(speculative_config=SPEC, num_kv_blocks=9, block_size=16, max_num_seqs=4)
    prompts = list(reference)[:4]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = _stats(llm)
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [reference[p].token_ids for p in prompts]
    assert_all_blocks_free(llm.engine)


def test_a_draft_that_would_end_the_grammar_is_cut_before_it(spec_llm):
    """A chat prompt ends with the model's end-of-turn token, so prompt lookup proposes it
    after an output that repeats the prompt's end: the grammar's stop token is never a
    draft (a verified position after an ended grammar has no mask); the step emits it."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    messages = [{"role": "user", "content": 'Give a person as JSON with name and age. Example:\n{\n"name": "John",\n'
                                            '"age": 25\n}'}]
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs={"json": schema})
    for _ in range(2):
        (out,) = spec_llm.chat(messages, params, use_tqdm=False)
        assert out.outputs[0].finish_reason == "stop"
    manager = spec_llm.engine.core.structured_output
    stop = min(manager._grammar_stop_ids)
    r = Request("g", [1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(regex="ab")), 0.0,
                max_tokens=8)
    manager.init_request(r)
    while not r.structured_output.is_ready():
        pass
    ids = spec_llm.get_tokenizer().encode("ab", add_special_tokens=False)
    assert manager.valid_draft_prefix(r, ids + [stop, 5]) == ids  # the stop token is left to the step
    assert_all_blocks_free(spec_llm.engine)
