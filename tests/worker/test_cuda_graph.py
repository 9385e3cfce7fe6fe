"""Decode CUDA graphs with dual-batch overlap on the device (skipped without CUDA): with
``DBOPolicy(measure_split=True)`` the capture keeps a split graph only where its replay was faster, and every
kept graph, split or plain, gives the eager forward's hidden states."""

from __future__ import annotations

import numpy as np
import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TINY_DEEPSEEK = dict(model_type="deepseek_v2", vocab_size=300, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=4, intermediate_size=192, n_routed_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64,
                     q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                     max_position_embeddings=256, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0)


def _model(dev):
    from transformers import AutoConfig

    from tandem.attention.selector import get_attention_backend
    from tandem.distributed.all2all import LinkModel, SimulatedAll2All
    from tandem.model_loader.loader import build_model

    d = dict(TINY_DEEPSEEK)
    hf = AutoConfig.for_model(d.pop("model_type"), **d)
    link = LinkModel(bandwidth_gbps=50, latency_us=5, ep_size=4)
    return build_model(hf, "", "dummy", get_attention_backend(dev, 256), torch.float32, dev, max_positions=256,
                       all2all=lambda e: SimulatedAll2All(e, link=link, record=False))


@cuda
@pytest.mark.parametrize("faked,other_rank_says_plain", [(True, False), (True, True), (False, False)])
def test_measured_dbo_graphs_equal_eager(monkeypatch, faked, other_rank_says_plain):
    from tandem.attention.metadata import AttentionMetadata
    from tandem.worker.cuda_graph import DecodeCUDAGraphs
    from tandem.worker.step_plan import DBOPolicy, StepPlanner

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = _model(dev)
    bs, max_blocks, nblocks = 8, 4, 80
    heads, dim = model.kv_cache_shape_per_block
    kv = [torch.randn(1, nblocks, bs, heads, dim, device=dev) * 0.5 for _ in model.layers]
    if faked:
        # Capture goes largest size first and times plain, then split: 16 split wins,
        # 8 split loses, 4 ties (a tie keeps the plain graph).
        times = iter([2.0, 1.0, 1.0, 2.0, 1.0, 1.0])
        monkeypatch.setattr(DecodeCUDAGraphs, "_replay_ms", lambda self, g: next(times))
    if other_rank_says_plain:
        # The ranks agree through forward_min: one rank that measured split slower wins.
        from tandem.worker import step_plan

        monkeypatch.setattr(step_plan.ps, "forward_min", lambda v: 0)
    dbo = DBOPolicy(decode_token_threshold=4, measure_split=True)
    g = DecodeCUDAGraphs(model, kv, 16, max_blocks, bs, dev, dbo=dbo, sizes=[2, 4, 8, 16])
    g.capture()
    assert set(dbo.graph_timings) == {4, 8, 16}
    if faked:
        assert g.split_sizes == (set() if other_rank_says_plain else {16})
    else:
        assert g.split_sizes <= {4, 8, 16} and all(p > 0 and s > 0 for p, s in dbo.graph_timings.values())
    planner = StepPlanner(dbo, g.sizes, g.split_sizes)
    rng = np.random.default_rng(0)
    for n in (2, 3, 7, 13, 16):
        table = (1 + np.arange(n)[:, None] * max_blocks + np.arange(max_blocks)[None, :]).astype(np.int32)
        pos = rng.integers(1, max_blocks * bs - 1, n)
        slots = table[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        ids = torch.randint(0, 300, (n,), device=dev)
        with torch.inference_mode():
            plan = planner.plan(n, decode_only=True)
            assert plan.split == (plan.padded_tokens in g.split_sizes)
            got = g.run(n, ids, pos, slots, pos + 1, pos, torch.tensor(table, device=dev), plan.padded_tokens).clone()
            i32 = dict(dtype=torch.int32, device=dev)
            meta = AttentionMetadata(torch.arange(n + 1, **i32), torch.tensor(pos + 1, **i32), torch.tensor(pos, **i32),
                                     torch.tensor(table, device=dev), torch.tensor(slots, device=dev), 1,
                                     int(pos.max()) + 1, list(range(n + 1)), (pos + 1).tolist(), n)
            want = model(ids, torch.tensor(pos, device=dev), kv, meta)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
