"""Tiny random-weight Llama / Qwen2 / Qwen3: logits equal transformers' (fp32, 1e-4),
for a prefill and for decode steps through the paged KV cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from tandem.attention.metadata import AttentionMetadata
from tandem.attention.torch_backend import TorchAttentionBackend
from tandem.models.llama import LlamaForCausalLM

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


def _meta(q_lens, computed, block_tables, block_size):
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    seq_lens = [c + q for c, q in zip(computed, q_lens)]
    slots = []
    for q, c, bt in zip(q_lens, computed, block_tables):
        for p in range(c, c + q):
            slots.append(bt[p // block_size] * block_size + p % block_size)
    width = max(len(b) for b in block_tables)
    bt = torch.tensor([b + [0] * (width - len(b)) for b in block_tables], dtype=torch.int32)
    num_decode = 0
    for q in q_lens:
        if q != 1:
            break
        num_decode += 1
    return AttentionMetadata(torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                             torch.tensor(computed, dtype=torch.int32), bt, torch.tensor(slots), max(q_lens), max(seq_lens),
                             qsl, seq_lens, num_decode)


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
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (13, 8, 21)]
    # Shuffled physical blocks: the paged layout must not matter.
    perm = (torch.randperm(nblocks - 1) + 1).tolist()
    tables = [perm[0:6], perm[6:12], perm[12:18]]
    seqs = [list(p) for p in prompts]
    with torch.no_grad():
        meta = _meta([len(p) for p in prompts], [0, 0, 0], tables, bs)
        ids = torch.tensor([t for p in prompts for t in p])
        pos = torch.cat([torch.arange(len(p)) for p in prompts])
        h = model(ids, pos, kv, meta)
        logits = model.compute_logits(h)
        off = 0
        for p in prompts:
            want = ref(torch.tensor([p])).logits[0]
            torch.testing.assert_close(logits[off : off + len(p)], want, atol=1e-4, rtol=0)
            off += len(p)
        # Decode steps: greedy token of each sequence appended, one token per sequence.
        last = [logits[sum(len(p) for p in prompts[: i + 1]) - 1].argmax().item() for i in range(3)]
        for _ in range(4):
            for s, t in zip(seqs, last):
                s.append(t)
            computed = [len(s) - 1 for s in seqs]
            meta = _meta([1, 1, 1], computed, tables, bs)
            h = model(torch.tensor(last), torch.tensor(computed), kv, meta)
            step_logits = model.compute_logits(h)
            for i, s in enumerate(seqs):
                want = ref(torch.tensor([s])).logits[0, -1]
                torch.testing.assert_close(step_logits[i], want, atol=1e-4, rtol=0)
            last = step_logits.argmax(-1).tolist()
        # A chunked-prefill step mixing decode and a chunk with a cached prefix.
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
