"""The engine with FP8: a tiny FP8 checkpoint (compressed-tensors layout) and online
``quantization="fp8"`` serve greedy requests end to end on the CPU with an FP8 KV cache,
for a dense model, a Qwen3-MoE and a DeepSeek-V2 (FP8 MLA latent cache)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DeepseekV2Config, LlamaConfig, Qwen3MoeConfig

from tandem.sampling_params import SamplingParams
from tests.conftest import PROMPTS, assert_all_blocks_free
from tests.layers.quantization.fp8_checkpoints import write_fp8_checkpoint
from tests.models.paged_parity import random_hf_reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory, smol_tokenizer):
    """(FP8 checkpoint folder, full-precision folder) of one tiny Llama with SmolLM2's tokenizer."""
    cfg = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    ref = random_hf_reference(cfg)
    fp8_dir, full_dir = tmp_path_factory.mktemp("fp8"), tmp_path_factory.mktemp("full")
    write_fp8_checkpoint(ref, str(fp8_dir), "ct-channel-dynamic")
    ref.save_pretrained(full_dir)
    for d in (fp8_dir, full_dir):
        smol_tokenizer.save_pretrained(d)
    return str(fp8_dir), str(full_dir)


def _run(model: str, **kw):
    from tandem.entrypoints.llm import LLM

    llm = LLM(model, num_kv_blocks=64, max_model_len=256, **kw)
    outs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("which, kw", [("fp8", {}), ("fp8", {"kv_cache_dtype": "fp8"}), ("fp8", {"dtype": "bfloat16"}),
                                       ("full", {"quantization": "fp8", "kv_cache_dtype": "fp8"})])
def test_fp8_engine_generates(tiny_folders, which, kw):
    llm, ids = _run(tiny_folders[0] if which == "fp8" else tiny_folders[1], **kw)
    engine = llm.engine
    assert all(len(t) == GREEDY.max_tokens for t in ids)
    assert engine.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    qkv = engine.model.layers[0].self_attn.qkv_proj
    assert qkv.weight_scale.dtype == torch.float32  # in a bf16 model too (it was created bf16)
    # The checkpoint's scheme (read from its config.json by the worker alone), or online FP8.
    assert engine.resolved.quantization == ("compressed-tensors" if which == "fp8" else "fp8")
    want_kv = torch.float8_e4m3fn if kw.get("kv_cache_dtype") == "fp8" else getattr(torch, engine.resolved.dtype)
    assert all(c.dtype == want_kv for c in engine.runner.kv_caches)
    assert_all_blocks_free(engine)
    engine.shutdown()


def test_fp8_moe_dummy_weights_batched_equals_solo(tmp_path, embedded_model_path):
    """Online FP8 of a dummy Qwen3-MoE (experts FP8 too) with an FP8 KV cache: greedy
    output is the same batched and solo."""
    from tandem.entrypoints.llm import LLM

    cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=96, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=128)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    llm = LLM(str(tmp_path), tokenizer=embedded_model_path, load_format="dummy", quantization="fp8",
              kv_cache_dtype="fp8", block_size=8, num_kv_blocks=64, max_model_len=128)
    assert llm.engine.model.layers[0].mlp.experts.w13.dtype == torch.float8_e4m3fn
    prompts = [[5, 17, 99, 23, 41, 7, 7, 8, 250, 3, 11], [5, 17, 99, 23, 41, 7, 7, 8, 12], list(range(1, 30))]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    solo = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == solo
    llm.engine.shutdown()


def test_fp8_latent_cache_for_mla(tmp_path, embedded_model_path):
    """DeepSeek-V2 (MLA) with online FP8 and an FP8 latent cache runs end to end."""
    from tandem.entrypoints.llm import LLM

    cfg = DeepseekV2Config(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=96, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                           first_k_dense_replace=1, q_lora_rank=None, max_position_embeddings=128)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    llm = LLM(str(tmp_path), tokenizer=embedded_model_path, load_format="dummy", quantization="fp8",
              kv_cache_dtype="fp8", block_size=8, num_kv_blocks=32, max_model_len=128)
    assert llm.engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    attn = llm.engine.model.layers[0].self_attn
    assert attn.q_proj.weight.dtype == attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert attn.kv_b_proj.weight.dtype == torch.float32  # read per head by the absorbed decode
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([[5, 17, 99, 23], list(range(1, 20))], sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert_all_blocks_free(llm.engine)
    llm.engine.shutdown()
