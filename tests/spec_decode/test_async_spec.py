"""Speculative decoding one step ahead (stage 2 of issue 46): with a draft model, the step
verifying a sequence's drafts is launched while the step that proposed them is still in
flight; the drafts never reach the host, and the runner takes the rejected ones back from
the step's positions. Greedy output equals the one without speculation under every sampling
field the runner reads drafts for; tokens and acceptance equal the synchronous loop's;
a running grammar falls back to taking each step in first."""

from __future__ import annotations

import pytest

from tandem.sampling_params import SamplingParams
from tests.conftest import PROMPTS, assert_all_blocks_free, make_llm

K = 4
REPETITIVE = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,"


def _spec(model: str) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": K, "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def ahead(embedded_model_path):
    """The embedded model (fp32) drafting for itself, one step ahead (the default)."""
    llm = make_llm(speculative_config=_spec(embedded_model_path))
    assert llm.engine.config.scheduler_config.async_output_proc
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def plain():
    llm = make_llm()
    yield llm
    llm.engine.shutdown()


class _StepSpy:
    """Records, per engine step, whether the step it scheduled verified drafts kept on the
    device, and whether that step was left in flight when ``step()`` returned."""

    def __init__(self, llm):
        self.core = core = llm.engine.core
        self.steps: list[tuple[int, bool]] = []
        step = core.step

        def spy():
            outs = step()
            inflight = core._inflight
            if inflight is not None:
                self.steps.append((sum(s.num_device_drafts for s in inflight[0].scheduled), True))
            return outs

        core.step = spy
        self._schedule = schedule = core.scheduler.schedule

        def spy_schedule():
            so = schedule()
            self.scheduled.append(sum(s.num_device_drafts for s in so.scheduled))
            return so

        self.scheduled: list[int] = []
        core.scheduler.schedule = spy_schedule

    def close(self) -> None:
        del self.core.step, self.core.scheduler.schedule


def _stats(llm) -> dict:
    st = llm.engine.core.debug_stats()
    return {k: st[k] for k in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")}


def test_steps_verifying_drafts_run_one_step_ahead_with_the_tokens_of_no_speculation(ahead, plain):
    """Every step that verifies the device's drafts leaves itself in flight: the loop never
    waits on a step it just launched (vLLM #39206 asserts the same)."""
    params = SamplingParams(temperature=0, max_tokens=40)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:4], params, use_tqdm=False)]
    spy = _StepSpy(ahead)
    try:
        got = [o.outputs[0].token_ids for o in ahead.generate(PROMPTS[:4], params, use_tqdm=False)]
    finally:
        spy.close()
    assert got == want
    with_drafts = [n for n in spy.scheduled if n]
    assert len(with_drafts) >= 5
    # Each step with device drafts was in flight when its step() returned.
    assert sum(1 for n, _ in spy.steps if n) == len(with_drafts)
    assert_all_blocks_free(ahead.engine)


def test_tokens_and_acceptance_equal_the_synchronous_loop(embedded_model_path):
    """Seeded sampling (drafts greedy, the target sampling at temperature 1: rejections
    happen): async on and off emit the same tokens but near ``max_tokens``, where the step
    ahead verifies fewer drafts (it counts the tokens in flight as the most they can be),
    and a seeded verification draws by its draft count. Acceptance does not move."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=64, ignore_eos=True) for i in range(6)]
    runs = []
    for async_on in (True, False):
        llm = make_llm(speculative_config=_spec(embedded_model_path), async_output_proc=async_on)
        outs = llm.generate(PROMPTS[:6], params, use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs], _stats(llm)))
        assert_all_blocks_free(llm.engine)
        llm.engine.shutdown()
    (on, on_stats), (off, off_stats) = runs
    for a, b in zip(on, off):
        assert len(a) == len(b) == 64 and a[:64 - (K + 1) * 2] == b[:64 - (K + 1) * 2]
    rate = [s["spec_decode_num_accepted_tokens"] / s["spec_decode_num_draft_tokens"] for s in (on_stats, off_stats)]
    assert 0.05 < rate[1] < 0.95  # not vacuous: drafts are accepted and rejected
    assert abs(rate[0] - rate[1]) < 0.02, rate


@pytest.mark.parametrize("extra", [dict(presence_penalty=0.8), dict(frequency_penalty=0.6),
                                   dict(repetition_penalty=1.3), dict(logprobs=3), dict(min_tokens=12),
                                   "bad_words", "logit_bias"])
def test_sampling_fields_hold_at_every_verified_position(ahead, plain, extra):
    """Penalties count the device's drafts before each verified position (read back for
    them), bad words follow them, logprobs come from each position's logits, min_tokens
    keeps drafts away until it is reached: greedy output as without speculation."""
    if extra == "bad_words":
        text = plain.generate(REPETITIVE, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
        extra = dict(bad_words=[text[2:6], " 9"])
    elif extra == "logit_bias":
        ids = plain.generate(REPETITIVE, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].token_ids
        extra = dict(logit_bias={ids[3]: -100.0})
    params = SamplingParams(temperature=0, max_tokens=24, **extra)
    (want,) = plain.generate(REPETITIVE, params, use_tqdm=False)
    before = _stats(ahead)
    (got,) = ahead.generate(REPETITIVE, params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert _stats(ahead)["spec_decode_num_draft_tokens"] > before["spec_decode_num_draft_tokens"]
    if params.logprobs:
        for tok, g, w in zip(got.outputs[0].token_ids, got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert list(g) == list(w) and g[tok].logprob == pytest.approx(w[tok].logprob, abs=1e-4)
    assert_all_blocks_free(ahead.engine)


def test_a_constrained_request_beside_others_takes_each_step_in_first(ahead, plain):
    """While a grammar runs, drafts are checked against it on the host, so the loop takes
    each step in before the next; the others keep speculating and every output is the one
    without speculation."""
    constrained = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": r"( [0-9]+,){10}"})
    free = SamplingParams(temperature=0, max_tokens=40)
    prompts, params = [REPETITIVE, PROMPTS[0], PROMPTS[1]], [constrained, free, free]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    before = _stats(ahead)
    got = [o.outputs[0].token_ids for o in ahead.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert _stats(ahead)["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"]
    assert_all_blocks_free(ahead.engine)


def test_aborting_while_drafts_are_in_flight_frees_every_block(ahead):
    engine = ahead.engine
    engine.add_request("x", PROMPTS[3], SamplingParams(temperature=0, max_tokens=64))
    engine.add_request("y", PROMPTS[2], SamplingParams(temperature=0, max_tokens=64))
    for _ in range(4):
        engine.step()
    assert engine.core._inflight is not None
    engine.abort_request("x")
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)
