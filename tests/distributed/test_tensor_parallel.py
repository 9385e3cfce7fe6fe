"""TP=2 over gloo (2 processes) gives the greedy tokens of TP=1 (fp32) for a batch of
mixed-length prompts: a dense Llama, a Qwen3-MoE with its experts' intermediate dim
sharded (no EP), and a DeepSeek-V2 (MLA heads sharded, shared experts, first dense layer);
FP8 at TP=2 with the activation quantization fused or separate."""

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


def test_tp2_constrained_equals_tp1(model_dir, word_tokenizer):
    """Constrained sequences sample after the driver sends their bitmask to the follower:
    TP=2 gives TP=1's tokens, each matching the grammar, in a batch with free requests."""
    from tests.distributed.conftest import constrained_mix

    model = model_dir("llama")
    params = constrained_mix()
    want = single_process_ids(model, PROMPTS, params, tokenizer=word_tokenizer)
    llm = make_llm(model, tensor_parallel_size=2, tokenizer=word_tokenizer)
    try:
        got = generate_ids(llm, PROMPTS, params)
    finally:
        llm.engine.shutdown()
    assert got == want
    for ids in got[1::2]:  # (t3|t4|t5)+ t9, then the stop token t1, or cut by max_tokens
        body = ids[:ids.index(9)] if 9 in ids else ids
        assert body and set(body) <= {3, 4, 5}, ids
        assert ids[len(body):] in ([9, 1], [9], []) and (9 in ids or len(ids) == 10), ids


def test_tp2_fp8_fused_quantization_equals_separate(model_dir, monkeypatch):
    """FP8 (online, dynamic per-token activation scales) at TP=2: each rank's norm and
    SiLU-and-mul quantize their linear layer's input on that rank (the row-parallel
    down_proj's is the rank's slice of the intermediate dim, quantized per token over that
    slice as the separate kernel does), so the greedy tokens equal those of
    TANDEM_FP8_FUSED_QUANT=off (inherited by the spawned ranks)."""
    model = model_dir("llama")
    got = {}
    for fused in ("off", "on"):
        monkeypatch.setenv("TANDEM_FP8_FUSED_QUANT", fused)
        llm = make_llm(model, tensor_parallel_size=2, quantization="fp8")
        try:
            got[fused] = generate_ids(llm, PROMPTS)
        finally:
            llm.engine.shutdown()
    assert got["on"] == got["off"]
    assert all(len(t) == 10 for t in got["on"])
