"""The same request gives the same answer (issue 45): a greedy chat repeated four times
gives bit-identical token ids and logprobs on every default CPU configuration, whatever
the prefix cache holds from the earlier runs and however the prompt is chunked; GGUF int4
layers still run the decodes in int4 (and never a prompt's rows)."""

from __future__ import annotations

import pytest

from tandem import SamplingParams
from tandem.layers.quantization.gguf import GGUFInt4Linear
from tandem.models.cpu_decode import CpuDecode

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=2)


def _runs(llm, times: int = 4) -> list[tuple]:
    runs = []
    for _ in range(times):
        out = llm.chat(CHAT, PARAMS)[0].outputs[0]
        runs.append((out.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in out.logprobs]))
    return runs


def _check(llm) -> list[tuple]:
    hits = llm.engine.kv_manager.prefix_hits
    runs = _runs(llm)
    assert llm.engine.kv_manager.prefix_hits > hits, "the repeats should hit the prefix cache"
    for r in runs[1:]:
        assert r == runs[0]
    return runs


@pytest.fixture(scope="module")
def default_llm():
    from tandem import LLM

    llm = LLM(num_kv_blocks=64, max_model_len=512)
    yield llm
    llm.engine.shutdown()


def test_default_configuration_repeats_bit_identically_and_decodes_in_int4(default_llm, monkeypatch):
    rows: list[int] = []
    int4 = GGUFInt4Linear._int4

    def counted(self, x):
        rows.append(x.reshape(-1, self.in_features).shape[0])
        return int4(self, x)

    monkeypatch.setattr(GGUFInt4Linear, "_int4", counted)
    model = default_llm.engine.model
    if getattr(model, "cpu_decode", None) is not None:
        # The one-op decoder layer (tandem.models.cpu_decode) runs its int4 GEMMs in C++: count
        # each of the layers' int4 linears once per forward with that forward's rows.
        in_layers = sum(isinstance(m, GGUFInt4Linear) for m in model.layers.modules())
        fast = CpuDecode.forward

        def counted_fast(self, hidden, *args):
            rows.extend([hidden.shape[0]] * in_layers)
            return fast(self, hidden, *args)

        monkeypatch.setattr(CpuDecode, "forward", counted_fast)
    runs = _check(default_llm)
    layers = sum(isinstance(m, GGUFInt4Linear) for m in model.modules())
    if layers:  # the default on CPUs with native bf16 without AVX512-VNNI (with it: GGUF blocks, one kernel)
        assert set(rows) == {1}, "only decodes (one row each here) run the int4 kernel"
        decodes = sum(len(ids) - 1 for ids, _ in runs)
        # One-step-ahead: a step launched before its request's EOS was seen is discarded.
        assert layers * decodes <= len(rows) <= layers * (decodes + len(runs))


@pytest.mark.parametrize("kwargs", [{"quantization": "none"}, {"dtype": "float32"},
                                    {"dtype": "float32", "enable_chunked_prefill": True, "max_num_batched_tokens": 16}],
                         ids=["bf16-dequantized", "fp32", "fp32-chunked"])
def test_other_configurations_repeat_bit_identically(kwargs):
    from tandem import LLM

    llm = LLM(num_kv_blocks=64, max_model_len=512, **kwargs)
    try:
        _check(llm)
    finally:
        llm.engine.shutdown()


def test_server_repeats_bit_identically(client):
    """Through ``tandem serve`` (the shared test server: fp32, prefix caching on)."""
    runs = []
    for _ in range(4):
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, temperature=0, max_tokens=12,
                                           logprobs=True, top_logprobs=2)
        runs.append([(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in r.choices[0].logprobs.content])
    assert all(r == runs[0] for r in runs[1:])
