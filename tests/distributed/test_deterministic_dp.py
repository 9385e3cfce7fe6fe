"""Deterministic mode over data parallelism (issue 36): DP=2 over gloo (2 processes, the
tiny dense Llama), each replica batching its own share of the requests, gives every request
the token ids and logprobs it gets alone in one process, bit for bit."""

from __future__ import annotations

from tandem.entrypoints.llm import DPLLM
from tandem.sampling_params import SamplingParams
from tests.distributed.conftest import PROMPTS, make_llm

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)


def _bits(out) -> tuple:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items())) for d in c.logprobs)


def test_dp2_gives_each_request_its_bits_alone(model_dir):
    model = model_dir("llama")
    llm = make_llm(model, deterministic=True)
    try:
        alone = [_bits(llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)[0]) for p in PROMPTS]
    finally:
        llm.engine.shutdown()
    dp = make_llm(model, DPLLM, data_parallel_size=2, deterministic=True)
    try:
        outs = dp.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        assert [_bits(o) for o in outs] == alone
    finally:
        dp.engine.shutdown()
