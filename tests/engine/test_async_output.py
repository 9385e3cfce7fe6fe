"""One-step-ahead output processing: outputs identical with ``async_output_proc`` on and off."""

from __future__ import annotations

import pytest

from tandem.sampling_params import RequestOutputKind, SamplingParams
from tests.conftest import PROMPTS, assert_all_blocks_free, make_llm


@pytest.fixture(scope="module")
def engines():
    on, off = make_llm(async_output_proc=True), make_llm(async_output_proc=False)
    yield {True: on, False: off}
    on.engine.shutdown()
    off.engine.shutdown()


def _logprob_values(lps):
    """Logprobs as (token, rank, value) rows; values compared with a tolerance because a
    sequence that finished one step late still fills a row of the next batch, and matmul
    rounding depends on the batch size."""
    if lps is None:
        return None, None
    keys = [[(t, lp.rank, lp.decoded_token) if lp is not None else None for t, lp in sorted(pos.items())] if pos else None
            for pos in lps]
    vals = [v for pos in lps if pos for _, v in sorted((t, lp.logprob) for t, lp in pos.items())]
    return keys, vals


def _run_both(engines, prompts, params):
    res = {}
    for mode, m in engines.items():
        outs = m.generate(prompts, params, use_tqdm=False)
        res[mode] = [(_logprob_values(o.prompt_logprobs), [(c.index, c.text, c.token_ids, _logprob_values(c.logprobs),
                                                            c.cumulative_logprob, c.finish_reason, c.stop_reason)
                                                           for c in o.outputs]) for o in outs]
        assert_all_blocks_free(m.engine)
    assert _same(res[True], res[False])
    return [(plp, [(i, text, ids, lps[0], cum, fr, sr) for i, text, ids, lps, cum, fr, sr in comps]) for plp, comps in res[True]]


def _same(a, b) -> bool:
    """Equal structure and exact tokens/text; float logprobs within 1e-4."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_max_tokens_exact(engines, max_tokens):
    res = _run_both(engines, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    for _, comps in res:
        (_, _, ids, _, _, reason, _), = comps
        assert len(ids) == max_tokens and reason == "length"


def test_stop_conditions(engines):
    alpha = "Here is the English alphabet: ABC"
    greedy = engines[False].generate([alpha], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    stop_tok = greedy.token_ids[2]
    params = [
        SamplingParams(temperature=0, max_tokens=10, stop=["GH"]),
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0, max_tokens=40),  # EOS well before 40 for a chat answer
        SamplingParams(temperature=0, max_tokens=12, min_tokens=12, stop=["\n"], stop_token_ids=[stop_tok]),
    ]
    prompts = [alpha, alpha, "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\n", alpha]
    res = _run_both(engines, prompts, params)
    assert res[0][1][0][5:] == ("stop", "GH")
    assert res[1][1][0][5:] == ("stop", stop_tok) and len(res[1][1][0][2]) == 3
    assert res[2][1][0][5] == "stop" and len(res[2][1][0][2]) < 40
    assert len(res[3][1][0][2]) == 12


def test_penalised_request_joins_running_batch(engines):
    loop_prompt = "one two one two one two one two one two"
    pen = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=2.0, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    results = {}
    for mode, m in engines.items():
        solo = m.generate([loop_prompt], pen, use_tqdm=False)[0].outputs[0].token_ids
        eng = m.engine
        eng.add_request("plain", loop_prompt, plain.clone(output_kind=RequestOutputKind.FINAL_ONLY))
        outs = {}
        for _ in range(5):
            for o in eng.step():
                outs[o.request_id] = o
        eng.add_request("pen", loop_prompt, pen.clone(output_kind=RequestOutputKind.FINAL_ONLY))
        while eng.has_unfinished_requests():
            for o in eng.step():
                outs[o.request_id] = o
        assert outs["pen"].outputs[0].token_ids == solo
        results[mode] = (solo, outs["plain"].outputs[0].token_ids)
        assert_all_blocks_free(eng)
    assert results[True] == results[False]
    assert results[True][0] != results[True][1][:24]  # the penalty changed the output


@pytest.mark.parametrize("async_on", [True, False])
def test_preemption_while_step_in_flight(async_on):
    m = make_llm(async_output_proc=async_on, num_kv_blocks=8, block_size=16)
    p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = PROMPTS[:4]
    solo = [m.generate([x], p, use_tqdm=False)[0].outputs[0].token_ids for x in prompts]
    before = m.engine.scheduler.num_preemptions
    outs = m.generate(prompts, p, use_tqdm=False)
    assert m.engine.scheduler.num_preemptions > before
    for o, want in zip(outs, solo):
        assert o.outputs[0].token_ids == want
    assert_all_blocks_free(m.engine)
    m.engine.shutdown()


def test_n_logprobs_prompt_logprobs_chunking_prefix_caching(engines):
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 3
    prompts = [shared + "What is 2+2?", shared + "Name a color.", PROMPTS[3]]
    params = [
        SamplingParams(n=3, temperature=0.7, seed=7, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=2, logprobs=0),
        SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True),
    ]
    res = _run_both(engines, prompts, params)
    assert len(res[0][1]) == 3 and len(res[2][1]) == 2
    assert res[1][0][0] is not None and len(res[1][0][0]) == len(engines[True].get_tokenizer().encode(prompts[1]))


def test_chunked_prefill_parity():
    results = []
    for async_on in (True, False):
        m = make_llm(async_output_proc=async_on, max_num_batched_tokens=16)
        outs = m.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
        assert_all_blocks_free(m.engine)
        m.engine.shutdown()
    assert results[0] == results[1]


@pytest.mark.parametrize("async_on", [True, False])
def test_abort_while_step_in_flight(engines, async_on):
    eng = engines[async_on].engine
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    eng.add_request("keep", PROMPTS[0], p)
    eng.add_request("drop", PROMPTS[1], p)
    seen = {"keep": 0, "drop": 0}
    for _ in range(4):
        for o in eng.step():
            seen[o.request_id] += len(o.outputs[0].token_ids) if o.outputs else 0
    if async_on:
        assert eng.core._inflight is not None  # a step holding "drop" is in flight
    eng.abort_request("drop")
    after_abort = seen["drop"]
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id != "drop"
            seen[o.request_id] += len(o.outputs[0].token_ids) if o.outputs else 0
    assert seen["keep"] == 30 and seen["drop"] == after_abort < 30
    assert_all_blocks_free(eng)


@pytest.mark.parametrize("async_on", [True, False])
def test_request_id_reuse(engines, async_on):
    eng = engines[async_on].engine
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.add_request("same", PROMPTS[0], p)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("same", PROMPTS[1], p)
    first = None
    while first is None:
        for o in eng.step():
            if o.finished:
                first = o
    # Reused at once, possibly while a step holding the old sequence is still in flight.
    eng.add_request("same", PROMPTS[1], p.clone(max_tokens=4))
    second = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                second = o
    assert first.prompt == PROMPTS[0] and len(first.outputs[0].token_ids) == 3
    assert second.prompt == PROMPTS[1] and len(second.outputs[0].token_ids) == 4
    solo = engines[async_on].generate([PROMPTS[1]], p.clone(max_tokens=4), use_tqdm=False)[0]
    assert second.outputs[0].token_ids == solo.outputs[0].token_ids
    assert_all_blocks_free(eng)


@pytest.mark.parametrize("inline", [True, False])
def test_failed_step_aborts_its_requests_and_poisons_nothing(engines, inline):
    """A step that raises (inline, as on CUDA, or on the CPU step thread) aborts the requests
    of the failed and the in-flight step, frees their blocks, drops idle prefix-cache
    entries whose K/V were never written, and the engine keeps serving."""
    m = engines[True]
    eng, runner = m.engine, m.engine.runner
    prompt = "The quick brown fox jumps over the lazy dog. " * 5
    p = SamplingParams(temperature=0, max_tokens=12)
    want = m.generate([prompt], p, use_tqdm=False)[0].outputs[0].text
    eng.kv_manager.pool.evict_idle_cached_blocks()
    executor, real = runner._executor, runner._execute
    calls = {"n": 0}

    def flaky(so):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return real(so)

    runner._execute = flaky
    if inline:
        runner._executor = None
    try:
        eng.add_request("a", "Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        eng.add_request("b", prompt, p)
        with pytest.raises(RuntimeError, match="injected"):
            for _ in range(10):
                eng.step()
        for _ in range(50):
            if not eng.has_unfinished_requests():
                break
            eng.step()
    finally:
        runner._execute, runner._executor = real, executor
    assert_all_blocks_free(eng)
    assert m.generate([prompt], p, use_tqdm=False)[0].outputs[0].text == want


def test_stop_string_on_last_allowed_token_is_stop(engines):
    out = engines[True].generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=2, stop=["."]),
                                 use_tqdm=False)[0].outputs[0]
    if out.text.endswith("."):
        pytest.skip("the model's first two tokens end differently")
    assert (out.finish_reason, out.stop_reason) == ("stop", ".")
