"""Speculative decoding one step ahead on a CUDA device (skipped without one): with CUDA
graphs on, a draft model's device drafts feed the next step's input ids and the rejected
ones come off its positions on the GPU path as on the CPU's: greedy output equals no
speculation with async on and off, with a penalty (drafts read back) too, every step with
device drafts runs one step ahead, the draft model's one-token forwards replay its own CUDA
graphs, and the draft decisions do not move with async."""

from __future__ import annotations

import pytest
import torch

from tandem.sampling_params import SamplingParams
from tests.spec_decode.test_async_spec import _StepSpy
# The fixture too (tiny): pytest finds it in this module's namespace.
from tests.spec_decode.test_draft_model import TOKEN_PROMPTS, _ids, _tiny_llm, tiny  # noqa: F401

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_draft_model_one_step_ahead_under_cuda_graphs(tiny, embedded_model_path):  # noqa: F811
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 3 + \
        [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=0.6)]
    common = dict(enforce_eager=False, num_kv_blocks=256)
    plain = _tiny_llm(tiny[0], embedded_model_path, None, **common)
    want = _ids(plain, TOKEN_PROMPTS, params)
    plain.engine.shutdown()
    counts = []
    for async_on in (True, False):
        llm = _tiny_llm(tiny[0], embedded_model_path, tiny[1], async_output_proc=async_on, **common)
        drafter = llm.engine.core.runner.drafter
        assert llm.engine.core.runner.cuda_graphs is not None and drafter.cuda_graphs is not None
        replays = _count_replays(drafter)
        spy = _StepSpy(llm)
        assert _ids(llm, TOKEN_PROMPTS, params) == want, async_on
        spy.close()
        assert replays, "the draft model's one-token forwards never replayed a graph"
        st = llm.engine.core.debug_stats()
        counts.append((st["spec_decode_num_drafts"], st["spec_decode_num_accepted_tokens"]))
        if async_on:
            assert sum(1 for n, _ in spy.steps if n) == len([n for n in spy.scheduled if n]) >= 5
        llm.engine.shutdown()
    assert counts[0][0] > 0 and abs(counts[0][1] - counts[1][1]) <= 4, counts


def _count_replays(drafter) -> list[int]:
    """Sizes of the drafter's graph replays from now on (wraps the instance's ``_replay``)."""
    sizes, inner = [], drafter._replay

    def replay(step, ids, hidden, size):
        sizes.append(size)
        return inner(step, ids, hidden, size)

    drafter._replay = replay
    return sizes


def test_catch_up_of_steps_without_drafts_replays_the_draft_graphs(tiny, embedded_model_path):  # noqa: F811
    """While ``disable_by_batch_size`` holds speculation off, the draft model's catch-up on
    each step's one token per sequence is one graph replay; its cache is the eager one's:
    once a sequence runs alone and drafts again, acceptance matches the eager drafter's and
    greedy output equals no speculation."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 16, 24, 40)]
    spec = {"method": "draft_model", "model": tiny[1], "num_speculative_tokens": 3, "disable_by_batch_size": 1}
    prompts = TOKEN_PROMPTS[:4]
    plain = _tiny_llm(tiny[0], embedded_model_path, None, enforce_eager=False, num_kv_blocks=256)
    want = _ids(plain, prompts, params)
    plain.engine.shutdown()
    accepted = []
    for eager in (True, False):
        llm = _tiny_llm(tiny[0], embedded_model_path, None, enforce_eager=eager, num_kv_blocks=256,
                        speculative_config=spec)
        drafter = llm.engine.core.runner.drafter
        replays, per_plain_step, inner = _count_replays(drafter), [], drafter.propose

        def propose(d, inner=inner, replays=replays, per_plain_step=per_plain_step):
            before = len(replays)
            out = inner(d)
            if not d.propose:
                per_plain_step.append(len(replays) - before)
            return out

        drafter.propose = propose
        assert _ids(llm, prompts, params) == want, eager
        st = llm.engine.core.debug_stats()
        accepted.append((st["spec_decode_num_drafts"], st["spec_decode_num_accepted_tokens"]))
        llm.engine.shutdown()
        assert per_plain_step and set(per_plain_step) <= ({0} if eager else {0, 1}), per_plain_step
        if not eager:
            assert per_plain_step.count(1) >= 8, per_plain_step  # the decode steps of 2+ sequences
    assert accepted[0][0] > 0 and abs(accepted[0][1] - accepted[1][1]) <= 2, accepted


def test_verification_and_catch_up_steps_replay_graphs(tiny, embedded_model_path):  # noqa: F811
    """With CUDA graphs on, the target's steps that verify drafts (1 + K rows per sequence)
    replay their graphs, and so does the draft model's catch-up after them (one row per
    sequence: its one-token graphs; two, when all drafts were accepted: its catch-up graphs):
    only the prompts' catch-up runs eagerly; greedy output equals no speculation, at batch
    sizes 1 and 4."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _tiny_llm(tiny[0], embedded_model_path, None, enforce_eager=False, num_kv_blocks=256)
    for prompts in (TOKEN_PROMPTS[:1], TOKEN_PROMPTS):
        want = _ids(plain, prompts, params)
        llm = _tiny_llm(tiny[0], embedded_model_path, tiny[1], enforce_eager=False, num_kv_blocks=256)
        runner = llm.engine.core.runner
        drafter = runner.drafter
        verify, eager, inner = _count_runs(runner.verify_graphs), [], drafter._forward
        drafter._forward = lambda inputs, ids: eager.append(inputs.num_tokens) or inner(inputs, ids)
        assert _ids(llm, prompts, params) == want
        st = llm.engine.core.debug_stats()
        llm.engine.shutdown()
        assert st["spec_decode_num_drafts"] > 0
        assert len(verify) >= 5 and len(prompts) in verify, verify
        assert len(eager) <= 2, eager  # the prompts' catch-up
    plain.engine.shutdown()


def _count_runs(graphs) -> list[int]:
    """Batch sizes of ``graphs.run`` calls from now on (wraps the instance's ``run``)."""
    sizes, inner = [], graphs.run

    def run(n, *args, **kwargs):
        sizes.append(n)
        return inner(n, *args, **kwargs)

    graphs.run = run
    return sizes


def test_ngram_verification_replays_graphs(tiny, embedded_model_path):  # noqa: F811
    """n-gram drafts (host-side, up to K per sequence, often fewer) verified under CUDA
    graphs: greedy output equals no speculation and the verification graphs replay."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [[300, 301, 302, 303] * 6, [7, 8, 9] * 5 + [7, 8]]
    plain = _tiny_llm(tiny[0], embedded_model_path, None, enforce_eager=False, num_kv_blocks=256)
    want = _ids(plain, prompts, params)
    plain.engine.shutdown()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "disable_by_batch_size": None}
    llm = _tiny_llm(tiny[0], embedded_model_path, None, enforce_eager=False, num_kv_blocks=256, speculative_config=spec)
    verify = _count_runs(llm.engine.core.runner.verify_graphs)
    assert _ids(llm, prompts, params) == want
    st = llm.engine.core.debug_stats()
    llm.engine.shutdown()
    assert st["spec_decode_num_drafts"] > 0 and verify, (st, verify)
