"""End-to-end engine behaviour on the embedded SmolLM2-135M (CPU)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tandem.sampling_params import SamplingParams
from tests.conftest import PROMPTS, assert_all_blocks_free, make_llm

GREEDY32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    m = make_llm()
    yield m
    m.engine.shutdown()


@pytest.fixture(scope="module")
def solo_greedy(llm):
    """Each prompt's greedy ids, run alone."""
    return [llm.generate([p], GREEDY32, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def test_greedy_matches_transformers(llm, embedded_model_path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(embedded_model_path),
                                               gguf_file=os.path.basename(embedded_model_path)).eval()
    # Like ignore_eos: generate through EOS without suppressing it.
    ref.generation_config.eos_token_id = None
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, GREEDY32, use_tqdm=False)
    assert len({len(o.prompt_token_ids) for o in outs}) >= 6  # prompts of different lengths
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids])
        with torch.no_grad():
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                do_sample=False, pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
        assert o.outputs[0].token_ids == want, o.prompt
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("config", [
    dict(enable_prefix_caching=True),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=16),
    dict(max_num_batched_tokens=64),
    dict(enable_chunked_prefill=False, max_num_batched_tokens=1024),
    dict(num_kv_blocks=12, block_size=16),  # 11 usable blocks for 8 sequences: preemption
])
def test_batch_invariance(config, solo_greedy):
    m = make_llm(**config)
    outs = m.generate(PROMPTS + PROMPTS[:2], GREEDY32, use_tqdm=False)
    for i, o in enumerate(outs):
        assert o.outputs[0].token_ids == solo_greedy[i % len(PROMPTS)], (config, o.prompt)
    if config.get("num_kv_blocks") == 12:
        assert m.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(m.engine)
    m.engine.shutdown()


def test_stop_strings_never_leak(llm):
    prompt = "Here is the English alphabet: ABC"
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert base.text.startswith("DEFGHIJ")
    for stop in ("DE", "DEFGHIJ"):
        p = SamplingParams(temperature=0, max_tokens=12, stop=[stop], output_kind=SamplingParams().output_kind.DELTA)
        llm.engine.add_request("stop-" + stop, prompt, p)
        streamed = ""
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                delta = out.outputs[0].text if out.outputs else ""
                streamed += delta
                assert not any(ch in streamed for ch in stop), (stop, streamed)
        assert streamed == ""
        final = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert final.text == "" and final.finish_reason == "stop" and final.stop_reason == stop
        incl = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop=[stop], include_stop_str_in_output=True),
                            use_tqdm=False)[0].outputs[0]
        assert incl.text == stop
    assert_all_blocks_free(llm.engine)


def test_min_tokens_beats_stop(llm):
    p = SamplingParams(temperature=0, min_tokens=20, max_tokens=20, stop=["\n"])
    outs = llm.generate(["Write three short lines:\n1."], p, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) >= 20


def test_seeded_request_is_batch_independent(llm):
    seeded = SamplingParams(temperature=0.8, seed=42, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPTS[3]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30), SamplingParams(temperature=0.5, top_k=5, max_tokens=10),
              SamplingParams(temperature=0, max_tokens=20)]
    batch = llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[2]], [others[0], seeded, others[1], others[2]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate([PROMPTS[3]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone


@pytest.mark.parametrize("params", [
    dict(temperature=0.9, top_k=1),
    dict(temperature=1e-4),
    dict(temperature=1.0, top_p=1e-9),
    dict(temperature=1.0, min_p=1.0),
])
def test_degenerate_sampling_is_greedy(llm, solo_greedy, params):
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=32, ignore_eos=True, logprobs=1, **params), use_tqdm=False)
    for o, want in zip(outs, solo_greedy):
        c = o.outputs[0]
        assert c.token_ids == want
        assert all(not math.isnan(lp.logprob) for pos in c.logprobs for lp in pos.values())


def test_deterministic_modes_agree_on_bf16_ties():
    """Issue 22 kind 1: in bf16, greedy and top_k=1 parted at token 15 on two equal logits.
    Every deterministic mode picks greedy's token on exact ties, batched (n=4 rows each,
    several random draws) and alone, with async output processing on and off."""
    m = make_llm(dtype="bfloat16", max_model_len=256, num_kv_blocks=64)
    base = dict(max_tokens=24, ignore_eos=True)
    modes = [dict(temperature=1.0, top_k=1), dict(temperature=1.0, top_p=1e-9), dict(temperature=1.0, min_p=1.0),
             dict(temperature=1e-4), dict(temperature=0.5, top_k=1, top_p=0.5)]
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0, **base)
    for async_output_proc in (True, False):
        m.engine.async_output_proc = async_output_proc  # read per step; the engine is idle here
        outs = m.generate([prompt] * (len(modes) + 1), [greedy] + [SamplingParams(n=4, **base, **p) for p in modes],
                          use_tqdm=False)
        want = outs[0].outputs[0].token_ids
        for p, o in zip(modes, outs[1:]):
            assert [c.token_ids for c in o.outputs] == [want] * 4, (async_output_proc, p)
    alone = m.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    for p in modes[:3]:
        assert m.generate([prompt], SamplingParams(**base, **p), use_tqdm=False)[0].outputs[0].token_ids == alone, p
    m.engine.shutdown()


def test_prefix_caching_with_prompt_logprobs():
    prompt_ids = list(range(1000, 1033))  # 33 tokens, block size 32
    p = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1, logprobs=2)
    results = {}
    for caching in (True, False):
        m = make_llm(enable_prefix_caching=caching, block_size=32, num_kv_blocks=32)
        a = m.generate([prompt_ids], p, use_tqdm=False)[0]
        b = m.generate([prompt_ids], p, use_tqdm=False)[0]
        assert a.prompt_logprobs == b.prompt_logprobs and a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.prompt_logprobs) == 33 and a.prompt_logprobs[0] is None
        results[caching] = (a.prompt_logprobs, a.outputs[0].token_ids, a.outputs[0].logprobs)
        assert_all_blocks_free(m.engine)
        m.engine.shutdown()
    assert results[True] == results[False]


def test_prompt_logprobs_survive_preemption():
    m = make_llm(num_kv_blocks=6, block_size=16)  # 5 usable blocks for 3 sequences: preemption
    p = SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=1, ignore_eos=True)
    outs = m.generate(PROMPTS[3:6], p, use_tqdm=False)
    assert m.engine.scheduler.num_preemptions > 0
    for o in outs:
        assert len(o.prompt_logprobs) == len(o.prompt_token_ids)
    assert_all_blocks_free(m.engine)
    m.engine.shutdown()


def test_prefix_cache_hits_are_counted(llm):
    prompt = "A long shared system prompt. " * 8
    llm.generate([prompt + "First question?"], SamplingParams(max_tokens=2), use_tqdm=False)
    before = llm.engine.kv_manager.prefix_queries
    out = llm.generate([prompt + "Second question?"], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.num_cached_tokens >= 32
    # One lookup counted per admitted sequence.
    assert llm.engine.kv_manager.prefix_queries - before == len(out.prompt_token_ids)


def test_logprobs_are_consistent(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, pos in zip(out.token_ids, out.logprobs):
        assert tok in pos and pos[tok].rank == 1  # greedy picks the top token
        assert len(pos) == 3
        assert max(lp.logprob for lp in pos.values()) == pos[tok].logprob
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs)))


def test_n_completions(llm):
    out = llm.generate([PROMPTS[3]], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("min_p", 1.5), ("presence_penalty", 3.0),
    ("frequency_penalty", -3.0), ("repetition_penalty", 0.0), ("max_tokens", 0), ("min_tokens", -1), ("n", 0),
    ("logprobs", -1), ("prompt_logprobs", -1), ("stop", [""]), ("seed", 2**63), ("seed", -(2**63) - 1),
    ("temperature", float("inf")), ("repetition_penalty", float("inf")), ("top_p", float("nan")),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("bad_words", [""]), ("bad_words", [3]),
])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bad_requests_leave_engine_clean(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["hi"], SamplingParams(logit_bias={10**7: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length is 1024"):
        llm.generate(["hi"], SamplingParams(max_tokens=5000), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs must be at most 20"):
        llm.generate(["hi"], SamplingParams(logprobs=10**6), use_tqdm=False)
    with pytest.raises(ValueError, match="at least one token"):
        llm.generate([[]], SamplingParams(), use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    assert llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_vllm_prompt_dicts_equal_plain_prompts(llm):
    """{"prompt": text} and {"prompt_token_ids": ids}, alone or in a list, give the tokens of
    the text and the ids; a malformed dict is a ValueError that leaves nothing queued."""
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate([{"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want, want]
    assert outs[0].prompt == PROMPTS[0] and outs[1].prompt_token_ids == ids
    assert llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match="exactly one of"):
        llm.generate(["hi", {"text": "hi"}], greedy, use_tqdm=False)
    assert_all_blocks_free(llm.engine)


def test_allowed_token_ids_and_bad_words(llm):
    allowed = [7042, 38634, 30, 28, 216]
    p = SamplingParams(temperature=1.0, seed=0, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed)
    assert set(llm.generate([PROMPTS[0]], p, use_tqdm=False)[0].outputs[0].token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["hi"], SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    base = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0].outputs[0]
    assert "Paris" in base.text
    banned = llm.generate([PROMPTS[0]], greedy.clone(bad_words=["Paris"]), use_tqdm=False)[0].outputs[0]
    assert "Paris" not in banned.text
    assert_all_blocks_free(llm.engine)


def test_chat_uses_template(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert "<|im_start|>user" in out.prompt and out.prompt.rstrip().endswith("<|im_start|>assistant")
    assert out.outputs[0].text


def test_prompt_logprobs_with_n(llm):
    one = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    three = llm.generate([PROMPTS[0]], SamplingParams(n=3, temperature=0, max_tokens=2, prompt_logprobs=2),
                         use_tqdm=False)[0]
    assert len(three.outputs) == 3
    assert three.prompt_logprobs == one.prompt_logprobs


def test_startup_heap_is_frozen_while_the_engine_runs(monkeypatch):
    """A full collection would otherwise traverse the model and every library object each
    time it runs while serving (a pause of hundreds of ms per step at large batches); the
    freeze is undone at shutdown so the released engine can be collected."""
    import gc

    from tandem.engine import core

    monkeypatch.setattr(core, "_num_frozen", 0)  # engines of other tests left running don't count
    gc.unfreeze()
    m = make_llm(num_kv_blocks=64, max_model_len=256)
    try:
        assert gc.get_freeze_count() > 10_000
        other = make_llm(num_kv_blocks=64, max_model_len=256)
        other.engine.shutdown()
        other.engine.shutdown()  # idempotent
        assert gc.get_freeze_count() > 10_000, "another engine's shutdown unfroze this one's heap"
        m.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        m.engine.shutdown()
    assert gc.get_freeze_count() == 0
