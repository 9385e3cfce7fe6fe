"""MLA pieces: interleaved RoPE == transformers' DeepSeek-V2 rotary; absorbed-weight decode
== decompressed attention, whatever the block-table width."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DeepseekV2Config

from tandem.attention.metadata import AttentionMetadata
from tandem.layers.mla import MLAAttention, apply_rope_interleaved, gather_latent, write_latent_cache
from tandem.layers.rotary import RotaryEmbedding


def _cfg():
    return DeepseekV2Config(hidden_size=64, num_attention_heads=4, kv_lora_rank=32, q_lora_rank=None,
                            qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20, max_position_embeddings=128)


def test_interleaved_rope_matches_transformers():
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RotaryEmbedding, apply_rotary_emb

    cfg = _cfg()
    pos = torch.tensor([[0, 3, 7, 100]])
    q, k = torch.randn(1, 4, 4, 16), torch.randn(1, 1, 4, 16)
    want_q, want_k = apply_rotary_emb(q, k, DeepseekV2RotaryEmbedding(cfg)(q, pos))
    rot = RotaryEmbedding(cfg, 16, 128)
    cos, sin = rot.cos[pos[0]], rot.sin[pos[0]]
    torch.testing.assert_close(apply_rope_interleaved(q, cos, sin), want_q)
    torch.testing.assert_close(apply_rope_interleaved(k, cos, sin), want_k)


def test_absorbed_decode_equals_decompressed():
    torch.manual_seed(0)
    cfg = _cfg()
    attn = MLAAttention(cfg, RotaryEmbedding(cfg, 16, 128))
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    bs, nblocks = 4, 20
    cache = torch.zeros(1, nblocks, bs, 1, 48)
    lens = [5, 11, 1]
    tables = [[3, 7], [1, 9, 12], [15]]
    lat = {i: torch.randn(n, 48) for i, n in enumerate(lens)}
    for i, n in enumerate(lens):
        slots = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(n)])
        write_latent_cache(lat[i], cache, slots)
    width = 6  # wider than any request needs: the extra (null) blocks must be masked out
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata(torch.arange(4, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                             torch.tensor([n - 1 for n in lens], dtype=torch.int32), bt, torch.zeros(3, dtype=torch.long),
                             1, max(lens), [0, 1, 2, 3], lens, 3)
    q_nope, q_pe = torch.randn(3, 4, 24), torch.randn(3, 4, 16)
    got = attn._decode_absorbed(q_nope, q_pe, cache, meta)
    for i, n in enumerate(lens):
        assert torch.equal(gather_latent(cache, bt[i: i + 1], 3)[0, :n], lat[i])
        k, v = attn.expand_latent(lat[i])
        q = torch.cat((q_nope[i], q_pe[i]), -1)[:, None]  # [h, 1, qk]
        want = F.scaled_dot_product_attention(q, k, v, scale=attn.scale)[:, 0]
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)
