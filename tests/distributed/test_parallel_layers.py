"""Single-process checks of the sharding math (no process group: each TP rank's layer is
built with an explicit ``tp_size``/``tp_rank`` and the partial sums are added by hand),
the sharded dummy-weight init, and parallel_state's defaults."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                  RowParallelLinear, kv_head_range)


def _full(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tp,heads,kv_heads", [(2, 4, 2), (2, 4, 1), (4, 8, 2), (1, 4, 4)])
def test_qkv_and_row_parallel_reassemble_the_full_layer(tp, heads, kv_heads):
    hd, hidden = 8, 16
    wq, wk, wv = _full(heads * hd, hidden, seed=1), _full(kv_heads * hd, hidden, seed=2), _full(kv_heads * hd, hidden, seed=3)
    wo = _full(hidden, heads * hd, seed=4)
    x = _full(3, hidden, seed=5)
    partial = torch.zeros(3, hidden)
    for r in range(tp):
        qkv = QKVParallelLinear(hidden, hd, heads, kv_heads, tp_size=tp, tp_rank=r)
        for i, w in enumerate((wq, wk, wv)):
            qkv.weight.weight_loader(w, i)
        o = RowParallelLinear(heads * hd, hidden, tp_size=tp, tp_rank=r)
        o.weight.weight_loader(wo)
        q, k, v = qkv(x).split([qkv.num_heads * hd, qkv.num_kv_heads * hd, qkv.num_kv_heads * hd], -1)
        first, n = kv_head_range(kv_heads, tp, r)
        assert torch.equal(q, F.linear(x, wq)[:, r * qkv.num_heads * hd:(r + 1) * qkv.num_heads * hd])
        assert torch.equal(k, F.linear(x, wk)[:, first * hd:(first + n) * hd])
        # Row-parallel: each rank's slice of the input features; the sum is the full product.
        partial += o(F.linear(x, wq)[:, r * o.in_features:(r + 1) * o.in_features])
        # Dummy init: the full-shape draw, sliced, is what the loader keeps.
        assert torch.equal(qkv.weight.shard(torch.cat([wq, wk, wv])), qkv.weight.detach())
    torch.testing.assert_close(partial, F.linear(F.linear(x, wq), wo), atol=1e-5, rtol=1e-5)


def test_merged_column_and_bad_sizes():
    gate, up = _full(12, 6, seed=1), _full(12, 6, seed=2)
    parts = []
    for r in range(2):
        m = MergedColumnParallelLinear(6, [12, 12], tp_size=2, tp_rank=r)
        m.weight.weight_loader(gate, 0)
        m.weight.weight_loader(up, 1)
        parts.append(m.weight.detach())
    assert torch.equal(torch.cat([parts[0][:6], parts[1][:6]]), gate)
    assert torch.equal(torch.cat([parts[0][6:], parts[1][6:]]), up)
    with pytest.raises(ValueError, match="multiple of the TP size"):
        ColumnParallelLinear(6, 10, tp_size=4, tp_rank=0)
    with pytest.raises(ValueError, match="multiple"):
        QKVParallelLinear(16, 8, 4, 3, tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match="shard 0"):
        MergedColumnParallelLinear(6, [12, 12], tp_size=2, tp_rank=0).weight.weight_loader(gate[:6], 0)


def test_parallel_fused_moe_slices_experts_and_intermediate():
    from tandem.distributed.all2all import ExpertPlacement, LocalAll2All
    from tandem.layers.moe import grouped_experts
    from tandem.layers.parallel_moe import ParallelFusedMoE

    e, k, h, i = 4, 2, 8, 12
    w13, w2 = _full(e, 2 * i, h, seed=1) * 0.3, _full(e, h, i, seed=2) * 0.3
    x, ids, w = _full(5, h, seed=3), torch.stack([torch.randperm(e)[:k] for _ in range(5)]), torch.rand(5, k)
    want = grouped_experts(x, ids, w, w13, w2, "loop")
    got = torch.zeros_like(want)
    for r in range(2):  # TP=2, no EP: intermediate halves; the partial sums add up
        moe = ParallelFusedMoE(e, k, h, i, LocalAll2All(e), tp_size=2, tp_rank=r)
        moe.load_fused("w13", w13)
        moe.load_fused("w2", w2)
        assert torch.equal(moe.w13.shard(w13), moe.w13.detach()) and moe.w13.shape == (e, i, h)
        got += grouped_experts(x, ids, w, moe.w13.detach(), moe.w2.detach(), "loop")
        per = ParallelFusedMoE(e, k, h, i, LocalAll2All(e), tp_size=2, tp_rank=r)
        for ex in range(e):  # per-expert checkpoint tensors give the same slices
            per.load_expert("w13", ex, w13[ex, :i], 0)
            per.load_expert("w13", ex, w13[ex, i:], 1)
            per.load_expert("w2", ex, w2[ex])
        assert torch.equal(per.w13, moe.w13) and torch.equal(per.w2, moe.w2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    class _EP(LocalAll2All):  # placement only (EP rank 1 of 2): whole experts 2, 3
        def __init__(self):
            self.placement = ExpertPlacement(e, 2, 1)

    ep = ParallelFusedMoE(e, k, h, i, _EP(), tp_size=2, tp_rank=1)
    ep.load_fused("w13", w13)
    assert ep.w13.shape == (2, 2 * i, h) and torch.equal(ep.w13.detach(), w13[2:])
    assert torch.equal(ep.w2.shard(w2), w2[2:])


def test_parallel_state_defaults_without_distributed():
    from tandem.distributed import parallel_state as ps

    assert ps.get_tp_group() is None and ps.get_dp_group() is None and ps.get_ep_group() is None
    assert (ps.get_world_size(), ps.get_tp_size(), ps.get_dp_size(), ps.get_ep_size()) == (1, 1, 1, 1)
    info = ps.init_distributed()  # one process: no process group is made
    assert info.world_size == 1 and ps.get_dp_group() is None and ps.tp_min(7) == 7
    with pytest.raises(ValueError, match="world size"):
        ps.init_distributed(tp_size=2, dp_size=1, rank=0, world_size=3)


def test_engine_refuses_parallel_config_outside_the_ranks():
    from tandem.engine.arg_utils import EngineArgs
    from tandem.engine.core import EngineCore

    # The front end (LLMEngine) launches the ranks; a core must be one of them.
    with pytest.raises(ValueError, match="not one of them"):
        EngineCore(EngineArgs(tensor_parallel_size=2).create_engine_config())
    with pytest.raises(ValueError, match="all2all_backend"):
        EngineArgs(all2all_backend="nccl").create_engine_config()
