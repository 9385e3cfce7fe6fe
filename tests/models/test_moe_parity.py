"""Tiny random-weight Qwen3-MoE / Mixtral / DeepSeek-V2: logits equal transformers' (fp32,
1e-4) for a ragged prefill batch, decode steps and a chunked step through the paged cache;
plus an end-to-end engine smoke run of each family with dummy weights."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, MixtralConfig, Qwen3MoeConfig

from tandem.attention.metadata import AttentionMetadata
from tandem.attention.torch_backend import TorchAttentionBackend
from tandem.models.registry import get_model_class

COMMON = dict(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=256,
              rms_norm_eps=1e-6)
DS = dict(COMMON, intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
          n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
          v_head_dim=32)


def _meta(q_lens, computed, block_tables, block_size):
    """Metadata of one step (decode requests first), as the model runner builds it."""
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    seq_lens = [c + q for c, q in zip(computed, q_lens)]
    slots = [bt[p // block_size] * block_size + p % block_size
             for q, c, bt in zip(q_lens, computed, block_tables) for p in range(c, c + q)]
    width = max(len(b) for b in block_tables)
    bt = torch.tensor([b + [0] * (width - len(b)) for b in block_tables], dtype=torch.int32)
    num_decode = next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))
    return AttentionMetadata(torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                             torch.tensor(computed, dtype=torch.int32), bt, torch.tensor(slots), max(q_lens),
                             max(seq_lens), qsl, seq_lens, num_decode)


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


def _ref_model(cfg):
    torch.manual_seed(0)
    cfg._attn_implementation = "eager"
    ref = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.1)
    return ref


def _cache(model, num_layers, nblocks, bs):
    heads, dim = model.kv_cache_shape_per_block
    planes = getattr(model, "kv_cache_num_planes", 2)
    return [torch.zeros(planes, nblocks, bs, heads, dim) for _ in range(num_layers)]


@pytest.mark.parametrize("name", list(_configs()))
def test_logits_match_transformers(name):
    cfg = _configs()[name]
    ref = _ref_model(cfg)
    model = get_model_class(cfg)(cfg, TorchAttentionBackend()).eval()
    model.load_weights(ref.state_dict().items())

    bs, nblocks = 8, 64
    kv = _cache(model, cfg.num_hidden_layers, nblocks, bs)
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (13, 8, 21)]
    perm = (torch.randperm(nblocks - 1) + 1).tolist()  # shuffled physical blocks
    tables = [perm[0:6], perm[6:12], perm[12:18]]
    seqs = [list(p) for p in prompts]
    with torch.no_grad():
        meta = _meta([len(p) for p in prompts], [0, 0, 0], tables, bs)
        ids = torch.tensor([t for p in prompts for t in p])
        pos = torch.cat([torch.arange(len(p)) for p in prompts])
        logits = model.compute_logits(model(ids, pos, kv, meta))
        off = 0
        for p in prompts:
            torch.testing.assert_close(logits[off: off + len(p)], ref(torch.tensor([p])).logits[0], atol=1e-4, rtol=0)
            off += len(p)
        last = [logits[sum(len(p) for p in prompts[: i + 1]) - 1].argmax().item() for i in range(3)]
        for _ in range(3):  # decode steps, one token per sequence
            for s, t in zip(seqs, last):
                s.append(t)
            computed = [len(s) - 1 for s in seqs]
            meta = _meta([1, 1, 1], computed, tables, bs)
            step_logits = model.compute_logits(model(torch.tensor(last), torch.tensor(computed), kv, meta))
            for i, s in enumerate(seqs):
                torch.testing.assert_close(step_logits[i], ref(torch.tensor([s])).logits[0, -1], atol=1e-4, rtol=0)
            last = step_logits.argmax(-1).tolist()
        # Chunked step: two decodes + a 5-token chunk on top of a cached prefix.
        extra = torch.randint(0, cfg.vocab_size, (5,)).tolist()
        c0 = len(seqs[0])
        seqs[0] += extra
        for s, t in zip(seqs[1:], last[1:]):
            s.append(t)
        computed = [len(seqs[1]) - 1, len(seqs[2]) - 1, c0]
        meta = _meta([1, 1, 5], computed, [tables[1], tables[2], tables[0]], bs)
        ids = torch.tensor([last[1], last[2]] + extra)
        pos = torch.tensor([computed[0], computed[1]] + list(range(c0, c0 + 5)))
        out = model.compute_logits(model(ids, pos, kv, meta))
        torch.testing.assert_close(out[0], ref(torch.tensor([seqs[1]])).logits[0, -1], atol=1e-4, rtol=0)
        torch.testing.assert_close(out[1], ref(torch.tensor([seqs[2]])).logits[0, -1], atol=1e-4, rtol=0)
        torch.testing.assert_close(out[2:], ref(torch.tensor([seqs[0]])).logits[0, -5:], atol=1e-4, rtol=0)


def test_per_expert_checkpoint_names_load():
    """Hub checkpoints store experts one by one (Mixtral: block_sparse_moe.experts.{e}.w1/w3/w2)."""
    cfg = _configs()["mixtral"]
    ref = _ref_model(cfg)
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
