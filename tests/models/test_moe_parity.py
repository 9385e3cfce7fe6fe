"""Tiny random-weight Qwen3-MoE / Mixtral / DeepSeek-V2: logits equal transformers' (fp32,
1e-4) for a ragged prefill batch, decode steps and a chunked step through the paged cache;
plus an end-to-end engine smoke run of each family with dummy weights."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DeepseekV2Config, MixtralConfig, Qwen3MoeConfig

from tests.models.paged_parity import assert_paged_parity, random_hf_reference
from tandem.attention.torch_backend import TorchAttentionBackend
from tandem.models.registry import get_model_class

COMMON = dict(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=256,
              rms_norm_eps=1e-6)
DS = dict(COMMON, intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
          n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
          v_head_dim=32)


def _configs():
    return {
        "qwen3_moe": Qwen3MoeConfig(**COMMON, num_key_value_heads=2, head_dim=32, intermediate_size=96, num_experts=8,
                                    num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                    mlp_only_layers=[1]),
        "qwen3_moe-sparse-step2-nonorm": Qwen3MoeConfig(**COMMON, num_key_value_heads=2, intermediate_size=96, num_experts=4,
                                                        num_experts_per_tok=2, moe_intermediate_size=32,
                                                        norm_topk_prob=False, decoder_sparse_step=2,
                                                        tie_word_embeddings=True),
        "mixtral": MixtralConfig(**COMMON, num_key_value_heads=2, intermediate_size=64, num_local_experts=6,
                                 num_experts_per_tok=2),
        "deepseek_v2-q_lora": DeepseekV2Config(**DS, q_lora_rank=24),
        "deepseek_v2-no-q_lora": DeepseekV2Config(**DS, q_lora_rank=None, routed_scaling_factor=2.0),
        "deepseek_v2-group-limited-yarn": DeepseekV2Config(
            **DS, q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                             "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 64}),
    }


def _cache(model, num_layers, nblocks, bs):
    heads, dim = model.kv_cache_shape_per_block
    planes = getattr(model, "kv_cache_num_planes", 2)
    return [torch.zeros(planes, nblocks, bs, heads, dim) for _ in range(num_layers)]


@pytest.mark.parametrize("name", list(_configs()))
def test_logits_match_transformers(name):
    cfg = _configs()[name]
    ref = random_hf_reference(cfg)
    model = get_model_class(cfg)(cfg, TorchAttentionBackend()).eval()
    model.load_weights(ref.state_dict().items())

    bs, nblocks = 8, 64
    kv = _cache(model, cfg.num_hidden_layers, nblocks, bs)
    assert_paged_parity(model, ref, cfg.vocab_size, kv, bs, decode_steps=3)


def test_per_expert_checkpoint_names_load():
    """Hub checkpoints store experts one by one (Mixtral: block_sparse_moe.experts.{e}.w1/w3/w2)."""
    cfg = _configs()["mixtral"]
    ref = random_hf_reference(cfg)
    sd = {}
    for k, v in ref.state_dict().items():
        if k.endswith("experts.gate_up_proj"):
            base = k.removesuffix("mlp.experts.gate_up_proj") + "block_sparse_moe.experts"
            for e in range(v.shape[0]):
                gate, up = v[e].chunk(2, dim=0)
                sd[f"{base}.{e}.w1.weight"], sd[f"{base}.{e}.w3.weight"] = gate, up
        elif k.endswith("experts.down_proj"):
            base = k.removesuffix("mlp.experts.down_proj") + "block_sparse_moe.experts"
            for e in range(v.shape[0]):
                sd[f"{base}.{e}.w2.weight"] = v[e]
        else:
            sd[k.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = v
    a = get_model_class(cfg)(cfg, TorchAttentionBackend())
    a.load_weights(sd.items())
    b = get_model_class(cfg)(cfg, TorchAttentionBackend())
    b.load_weights(ref.state_dict().items())
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
    missing = {k: v for k, v in sd.items() if ".experts.3.w2." not in k}
    with pytest.raises(ValueError, match="lacks weights"):
        get_model_class(cfg)(cfg, TorchAttentionBackend()).load_weights(missing.items())


ENGINE_CONFIGS = {
    "qwen3_moe": dict(model_type="qwen3_moe", **COMMON, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "mixtral": dict(model_type="mixtral", **COMMON, num_key_value_heads=2, intermediate_size=64, num_local_experts=4,
                    num_experts_per_tok=2),
    "deepseek_v2": dict(model_type="deepseek_v2", **dict(DS, num_hidden_layers=2), q_lora_rank=None),
}


@pytest.mark.parametrize("family", list(ENGINE_CONFIGS))
def test_engine_dummy_weights_batched_equals_solo(family, tmp_path, embedded_model_path):
    """LLM(load_format="dummy") runs the family end to end; greedy output with prefix caching
    is the same batched and solo."""
    from tandem.entrypoints.llm import LLM
    from tandem.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(ENGINE_CONFIGS[family]))
    llm = LLM(model=str(tmp_path), tokenizer=embedded_model_path, load_format="dummy", block_size=8,
              num_kv_blocks=96, max_model_len=128, enable_prefix_caching=True)
    if family == "deepseek_v2":
        assert llm.engine.runner.kv_caches[0].shape == (1, 96, 8, 1, 32 + 16)
    prompts = [[5, 17, 99, 23, 41, 7, 7, 8, 250, 3, 11], [5, 17, 99, 23, 41, 7, 7, 8, 12], list(range(1, 30))]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    solo = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == solo
    assert all(len(t) == 8 for t in batched)
