"""Deterministic inference end to end through the GPU's kernels (issue 51), run on the CPU in
the Triton interpreter: the tiny random Llama of tests/distributed with the Triton attention
backend (decode requests through the paged prefill kernel) and every linear layer and the LM
head through the batch-invariant Triton GEMM, as ``--deterministic`` runs them on CUDA. A
request's greedy token ids and logprobs are the same bits alone, batched with random others
at random positions, with its prompt chunked at 16 tokens and after a prefix-cache hit.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.triton_interpreter import triton_test_setup

DEVICE, INTERPRET = triton_test_setup("tandem.attention.triton_backend")

from tandem.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tandem.layers import batch_invariant  # noqa: E402
from tandem.sampling_params import SamplingParams  # noqa: E402
from tests.distributed.conftest import CONFIGS, ENGINE  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the CPU engine through the interpreted kernels")

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
VOCAB = CONFIGS["llama"]["vocab_size"]
TARGET = [random.Random(7).randrange(2, VOCAB) for _ in range(37)]


@pytest.fixture
def gpu_kernels(monkeypatch):
    """The CUDA path's kernels on the CPU: the Triton attention backend, and
    ``batch_invariant.linear``'s CUDA branch (the Triton GEMM) for CPU tensors."""
    from tandem.layers.matmul_triton import matmul_batch_invariant

    import tandem.worker.worker as worker

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               deterministic: bool = True) -> torch.Tensor:
        if not deterministic or x.shape[:-1].numel() == 0:
            return torch.nn.functional.linear(x, weight, bias)
        return matmul_batch_invariant(x, weight, bias)

    def backend(device, max_model_len=None, deterministic=False, cpu_kernels=False) -> TritonAttentionBackend:
        return TritonAttentionBackend(max_model_len=max_model_len, deterministic=deterministic)

    monkeypatch.setattr(worker, "get_attention_backend", backend)
    monkeypatch.setattr(batch_invariant, "linear", linear)


def _llm(model: str, **kwargs):
    from tandem.config import embedded_default_model
    from tandem.entrypoints.llm import LLM

    settings = {**ENGINE, "num_kv_blocks": 256, "max_model_len": 128, "deterministic": True, **kwargs}
    return LLM(model=model, tokenizer=embedded_default_model(), **settings)


def _bits(out) -> tuple:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items())) for d in c.logprobs)


def _run(llm, prompts: list[list[int]]) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def _others(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def test_batched_chunked_and_cached_equal_alone(gpu_kernels, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["llama"]))
    rng = random.Random(5)
    llm = _llm(str(tmp_path))
    try:
        backends = {(type(m.backend), m.backend.deterministic)
                    for m in llm.engine.core.runner.model.modules() if hasattr(m, "backend")}
        assert backends == {(TritonAttentionBackend, True)}
        alone = _bits(_run(llm, [TARGET])[0])
        for n in (3, 6):
            others = _others(rng, n - 1)
            pos = rng.randrange(n)
            assert _bits(_run(llm, others[:pos] + [TARGET] + others[pos:])[pos]) == alone, f"batch of {n}"
        _run(llm, [TARGET[:24] + [5, 6, 7]])  # fills the cache with the target's first 24 tokens
        outs = _run(llm, _others(rng, 2) + [TARGET])
        assert outs[-1].num_cached_tokens >= 16 and _bits(outs[-1]) == alone
    finally:
        llm.engine.shutdown()
    chunked = _llm(str(tmp_path), max_num_batched_tokens=16, enable_chunked_prefill=True, enable_prefix_caching=False)
    try:
        assert _bits(_run(chunked, _others(rng, 2) + [TARGET])[-1]) == alone
    finally:
        chunked.engine.shutdown()
