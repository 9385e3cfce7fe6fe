"""TP=2 over gloo (2 processes) gives the greedy tokens of TP=1 (fp32) for a batch of
mixed-length prompts: a dense Llama, a Qwen3-MoE with its experts' intermediate dim
sharded (no EP), and a DeepSeek-V2 (MLA heads sharded, shared experts, first dense layer)."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import PROMPTS, generate_ids, make_llm, single_process_ids


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v2"])
def test_tp2_equals_tp1(model_dir, family):
    model = model_dir(family)
    want = single_process_ids(model)
    llm = make_llm(model, tensor_parallel_size=2)
    try:
        info = llm.engine.rank0_info
        assert info["parallel"].tp_size == 2 and info["kv_cache_shape_per_block"][0] == 1  # 2 KV heads on 2 ranks
        got = generate_ids(llm, PROMPTS)
        again = generate_ids(llm, PROMPTS[:1])  # a second batch after an idle period
    finally:
        llm.engine.shutdown()
    assert got == want
    assert again == want[:1]
    assert all(len(t) == 10 for t in got)
