"""Tiny random-weight Llama / Qwen2 / Qwen3: logits equal transformers' (fp32, 1e-4),
for a prefill and for decode steps through the paged KV cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from tandem.attention.torch_backend import TorchAttentionBackend
from tandem.models.llama import LlamaForCausalLM
from tests.models.paged_parity import assert_paged_parity

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def _configs():
    return {
        "llama": LlamaConfig(**COMMON, tie_word_embeddings=False),
        "llama3-rope-scaling": LlamaConfig(**COMMON, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**COMMON, head_dim=32),
    }


@pytest.mark.parametrize("name", list(_configs()))
def test_logits_match_transformers(name):
    torch.manual_seed(0)
    cfg = _configs()[name]
    ref = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.1)
    model = LlamaForCausalLM(cfg, TorchAttentionBackend()).eval()
    model.load_weights(ref.state_dict().items())

    bs, nblocks = 8, 64
    kv = [torch.zeros(2, nblocks, bs, cfg.num_key_value_heads, model.spec.head_dim) for _ in range(cfg.num_hidden_layers)]
    assert_paged_parity(model, ref, cfg.vocab_size, kv, bs, decode_steps=4)
