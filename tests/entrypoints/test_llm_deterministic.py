"""Deterministic inference (issue 36) end to end on the CPU.

``LLM(deterministic=True)``: a request's token ids and logprobs are the same bits alone, in
batches of 2..64 with random others at random positions, with its prompt chunked at 16 or
64 tokens, after a prefix-cache hit, with asynchronous output processing on or off, and
for seeded sampling. The tiny random Llama of tests/distributed (dummy weights from one
seed: every engine built here holds the same model), in fp32 and, where the CPU has native
bf16, bf16. The default mode's history case runs on the embedded model: the same six
requests sent twice to one ``LLM`` give the same bits (the second time their prefixes come
from the prefix cache).
"""

from __future__ import annotations

import json
import random

import pytest

from tandem.platform import cpu_has_native_bf16
from tandem.sampling_params import SamplingParams
from tests.conftest import PROMPTS, make_llm
from tests.distributed.conftest import CONFIGS, ENGINE

DTYPES = ["float32"] + (["bfloat16"] if cpu_has_native_bf16() else [])
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, logprobs=2, ignore_eos=True)
VOCAB = CONFIGS["llama"]["vocab_size"]
# Longer than a KV block (8 tokens here) several times over, so that chunks and cache
# hits cut it in different places.
TARGET = [random.Random(7).randrange(2, VOCAB) for _ in range(45)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny_llama")
    (d / "config.json").write_text(json.dumps(CONFIGS["llama"]))
    return str(d)


def _llm(model: str, dtype: str, **kwargs):
    from tandem.config import embedded_default_model
    from tandem.entrypoints.llm import LLM

    settings = {**ENGINE, "num_kv_blocks": 1024, "max_model_len": 256, "dtype": dtype, "deterministic": True,
                **kwargs}
    return LLM(model=model, tokenizer=embedded_default_model(), **settings)


def _bits(out) -> tuple:
    """Token ids and every returned logprob (the sampled token's and the top 2) of one output."""
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items())) for d in c.logprobs)


def _run(llm, prompts: list[list[int]], params: SamplingParams) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _others(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 70))] for _ in range(n)]


@pytest.fixture(scope="module", params=DTYPES)
def engine(request, tiny_llama):
    """One deterministic engine per dtype and the target's bits alone on it (greedy, seeded)."""
    llm = _llm(tiny_llama, request.param)
    alone = {name: _bits(_run(llm, [TARGET], p)[0]) for name, p in (("greedy", GREEDY), ("seeded", SEEDED))}
    yield request.param, llm, alone
    llm.engine.shutdown()


@pytest.mark.parametrize("params", ["greedy", "seeded"])
def test_batched_with_random_others_at_random_positions(engine, params):
    _, llm, alone = engine
    rng = random.Random(hash(params) & 0xFFFF)
    for n in (2, 5, 17, 64):
        others = _others(rng, n - 1)
        pos = rng.randrange(n)
        outs = _run(llm, others[:pos] + [TARGET] + others[pos:], GREEDY if params == "greedy" else SEEDED)
        assert _bits(outs[pos]) == alone[params], f"batch of {n}, target at {pos}"


def test_after_a_prefix_cache_hit(engine):
    _, llm, alone = engine
    rng = random.Random(3)
    # Another prompt with the target's first 40 tokens fills the cache, then the target
    # comes again among others: most of its prompt is read from the cache.
    _run(llm, [TARGET[:40] + [5, 6, 7]], GREEDY)
    outs = _run(llm, _others(rng, 3) + [TARGET], GREEDY)
    assert outs[-1].num_cached_tokens >= 32
    assert _bits(outs[-1]) == alone["greedy"]


@pytest.mark.parametrize("budget", [16, 64])
def test_chunked_prefill_and_async_off(engine, tiny_llama, budget):
    """Prompts cut into chunks of ``budget`` tokens per step, with the output processed
    synchronously for the smaller budget: the same bits as the unchunked, asynchronous run."""
    dtype, _, alone = engine
    llm = _llm(tiny_llama, dtype, max_num_batched_tokens=budget, enable_chunked_prefill=True,
               enable_prefix_caching=False, async_output_proc=budget != 16)
    try:
        outs = _run(llm, _others(random.Random(budget), 4) + [TARGET], GREEDY)
        assert _bits(outs[-1]) == alone["greedy"]
        assert _bits(_run(llm, [TARGET], SEEDED)[0]) == alone["seeded"]
    finally:
        llm.engine.shutdown()


def test_default_mode_same_requests_twice_give_the_same_bits(embedded_model_path):
    """Issue 36's case: six greedy requests sent twice to one engine (bf16 where the CPU has
    it, as ``dtype="auto"`` picks there); the second time the longer prompts' first blocks
    come from the prefix cache. Their first logprobs used to differ."""
    llm = make_llm(dtype=DTYPES[-1])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, ignore_eos=True)
        first = llm.generate(PROMPTS[:6], params, use_tqdm=False)
        second = llm.generate(PROMPTS[:6], params, use_tqdm=False)
        assert any(o.num_cached_tokens for o in second), "no prefix-cache hit: the case is not exercised"
        assert [_bits(o) for o in second] == [_bits(o) for o in first]
    finally:
        llm.engine.shutdown()


def test_moe_with_dbo_on_equals_alone_without(tmp_path_factory):
    """The tiny Qwen3-MoE (router and experts through the row-blocked GEMMs): the target
    alone with DBO off, and among others with DBO on over the simulated all-to-all (steps
    cut in two ubatches, the target's rows in either), give the same bits."""
    d = tmp_path_factory.mktemp("tiny_moe")
    (d / "config.json").write_text(json.dumps(CONFIGS["qwen3_moe"]))
    off = _llm(str(d), "float32")
    try:
        alone = _bits(_run(off, [TARGET], GREEDY)[0])
    finally:
        off.engine.shutdown()
    on = _llm(str(d), "float32", enable_dbo=True, all2all_backend="simulated", dbo_decode_token_threshold=2,
              dbo_prefill_token_threshold=8, dbo_measure_split=False)
    try:
        others = _others(random.Random(11), 6)
        outs = _run(on, others[:2] + [TARGET] + others[2:], GREEDY)
        assert on.engine.runner.num_dbo_steps > 0
        assert _bits(outs[2]) == alone
    finally:
        on.engine.shutdown()
