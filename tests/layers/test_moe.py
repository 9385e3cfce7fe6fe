"""MoE layer: grouped expert compute == per-expert reference; routers == transformers';
the dispatch/combine seam (local and simulated backends, expert placement)."""

from __future__ import annotations

import pytest
import torch

from tandem.distributed.all2all import ExpertPlacement, LinkModel, LocalAll2All, SimulatedAll2All
from tandem.distributed.all2all_factory import get_all2all_backend
from tandem.layers.moe import (
    FusedMoE,
    TopKRouter,
    deepseek_v2_topk,
    grouped_experts,
    reference_experts,
    softmax_topk,
    sort_by_expert,
)


def _weights(e, h, i, gen):
    return torch.randn(e, 2 * i, h, generator=gen) * 0.2, torch.randn(e, h, i, generator=gen) * 0.2


@pytest.mark.parametrize("impl", ["grouped_mm", "padded_bmm", "auto"])
@pytest.mark.parametrize("n,e,k", [(1, 4, 1), (7, 8, 2), (33, 16, 4), (64, 6, 3)])
def test_grouped_equals_reference(impl, n, e, k):
    gen = torch.Generator().manual_seed(n * 100 + e)
    h, i = 32, 24
    x = torch.randn(n, h, generator=gen)
    w13, w2 = _weights(e, h, i, gen)
    # Only the first half of the experts is ever chosen: the others get no tokens.
    used = max(k, e // 2)
    ids = torch.stack([torch.randperm(used, generator=gen)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=gen)
    want = reference_experts(x, ids, w, w13, w2)
    got = grouped_experts(x, ids, w, w13, w2, impl=impl)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["grouped_mm", "padded_bmm"])
def test_invalid_slots_and_empty_input(impl):
    """-1 (expert on another rank) contributes nothing; a token with no valid slot gives 0."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 16, generator=gen)
    w13, w2 = _weights(4, 16, 8, gen)
    ids = torch.tensor([[0, -1], [-1, -1], [3, 3], [-1, 2], [1, 0]])
    w = torch.rand(5, 2, generator=gen)
    got = grouped_experts(x, ids, w, w13, w2, impl=impl)
    torch.testing.assert_close(got, reference_experts(x, ids, w, w13, w2), atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1], torch.zeros(16))
    all_invalid = torch.full((5, 2), -1)
    assert torch.equal(grouped_experts(x, all_invalid, w, w13, w2, impl=impl), torch.zeros(5, 16))
    empty = grouped_experts(x[:0], ids[:0], w[:0], w13, w2, impl=impl)
    assert empty.shape == (0, 16)


def test_bf16_grouped_close_to_reference():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, 32, generator=gen).bfloat16()
    w13, w2 = (t.bfloat16() for t in _weights(8, 32, 16, gen))
    ids = torch.randint(0, 8, (40, 2), generator=gen)
    w = torch.rand(40, 2, generator=gen)
    for impl in ("grouped_mm", "padded_bmm"):
        got = grouped_experts(x, ids, w, w13, w2, impl=impl)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), reference_experts(x, ids, w, w13, w2).float(), atol=2e-2, rtol=2e-2)


def test_sort_by_expert_offsets():
    ids = torch.tensor([[2, 0], [2, -1], [0, 3]])
    s = sort_by_expert(ids, 5)
    assert s.counts.tolist() == [2, 0, 2, 1, 0]
    assert s.offsets.tolist() == [2, 2, 4, 5, 5]
    assert s.sorted_ids.tolist() == [0, 0, 2, 2, 3, 5]
    assert s.token_idx.tolist() == [0, 2, 0, 1, 2, 1]


# ------------------------------------------------------------------------ routers


def _hf_router(kind, **over):
    from transformers import DeepseekV2Config, MixtralConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    if kind == "mixtral":
        return MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2, **over))
    if kind == "qwen3_moe":
        return Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3, **over))
    return DeepseekV2TopkRouter(DeepseekV2Config(hidden_size=32, n_routed_experts=8, num_experts_per_tok=3, **over))


def _same_routing(ids_a, w_a, ids_b, w_b, rtol=1e-6):
    """Same experts with the same weights, whatever the order inside the top-k."""
    oa, ob = ids_a.argsort(-1), ids_b.argsort(-1)
    assert torch.equal(ids_a.gather(-1, oa), ids_b.gather(-1, ob))
    torch.testing.assert_close(w_a.gather(-1, oa).float(), w_b.gather(-1, ob).float(), atol=1e-6, rtol=rtol)


@pytest.mark.parametrize("kind,over,router_kw", [
    ("mixtral", {}, dict(renormalize=True)),
    ("qwen3_moe", dict(norm_topk_prob=True), dict(renormalize=True)),
    ("qwen3_moe", dict(norm_topk_prob=False), dict(renormalize=False)),
    ("deepseek_v2", dict(routed_scaling_factor=16.0), dict(method="deepseek_v2", fp32_logits=True,
                                                           routed_scaling_factor=16.0)),
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
     dict(method="deepseek_v2", fp32_logits=True, topk_method="group_limited_greedy", n_group=4, topk_group=2)),
])
@pytest.mark.parametrize("router_impl", ["torch", "triton"])
def test_router_matches_transformers(kind, over, router_kw, router_impl, monkeypatch):
    """Both routing paths (torch; the fused Triton kernel, in its interpreter on the CPU)."""
    monkeypatch.setenv("TANDEM_MOE_ROUTER", router_impl)
    torch.manual_seed(0)
    hf = _hf_router(kind, **over)
    with torch.no_grad():
        hf.weight.normal_()
    k = 2 if kind == "mixtral" else 3
    ours = TopKRouter(32, 8, k, **router_kw)
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
    x = torch.randn(50, 32)
    _, hf_w, hf_ids = hf(x)
    ids, w = ours(x)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    # The kernel sums the logits in another order (and has its own exp): a few fp32 ulps.
    _same_routing(ids, w, hf_ids, hf_w, rtol=1e-6 if router_impl == "torch" else 1e-5)


def test_mixtral_routing_is_softmax_over_topk_logits():
    logits = torch.randn(20, 8)
    ids, w = softmax_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(w, logits.gather(-1, ids).softmax(-1))


def test_deepseek_group_limited_picks_from_top_groups_only_and_norm():
    logits = torch.randn(30, 16)
    ids, _ = deepseek_v2_topk(logits, 4, "group_limited_greedy", n_group=8, topk_group=2)
    group_best = logits.softmax(-1).view(30, 8, 2).max(-1).values
    allowed = group_best.topk(2, dim=-1).indices
    assert all(set((ids[t] // 2).tolist()) <= set(allowed[t].tolist()) for t in range(30))
    _, w = deepseek_v2_topk(logits, 4, norm_topk_prob=True, routed_scaling_factor=2.5)
    torch.testing.assert_close(w.sum(-1), torch.full((30,), 2.5))
    with pytest.raises(ValueError):
        deepseek_v2_topk(logits, 4, "nope")


# --------------------------------------------------------------- all2all seam


def test_placement():
    pl = ExpertPlacement(8, ep_size=4, ep_rank=2)
    assert (pl.num_local_experts, pl.first_local_expert) == (2, 4)
    ids = torch.tensor([[0, 4], [5, 7]])
    assert pl.to_local(ids).tolist() == [[-1, 0], [1, -1]]
    assert pl.owner(ids).tolist() == [[0, 2], [2, 3]]
    with pytest.raises(ValueError, match="at least the EP size"):
        ExpertPlacement(3, ep_size=4)


@pytest.mark.parametrize("num_experts,ep_size", [(10, 4), (6, 4), (9, 2), (5, 5), (64, 8)])
def test_uneven_placement_covers_every_expert_once(num_experts, ep_size):
    """vLLM's linear map: the first ``E % ep`` ranks hold one expert more; ``owner``,
    ``is_local``, ``to_local`` and ``first_experts`` agree on every expert."""
    pls = [ExpertPlacement(num_experts, ep_size, r) for r in range(ep_size)]
    base, extra = divmod(num_experts, ep_size)
    assert [p.num_local_experts for p in pls] == [base + (r < extra) for r in range(ep_size)]
    ids = torch.arange(num_experts)
    owners = pls[0].owner(ids).tolist()
    assert pls[0].first_experts(torch.arange(ep_size)).tolist() == [p.first_local_expert for p in pls]
    for e in range(num_experts):
        assert [p.is_local(e) for p in pls].count(True) == 1 and pls[owners[e]].is_local(e)
        assert pls[owners[e]].to_local(ids[e:e + 1]).item() == e - pls[owners[e]].first_local_expert
    assert sorted(sum((list(range(p.first_local_expert, p.first_local_expert + p.num_local_experts)) for p in pls),
                      [])) == list(range(num_experts))


@pytest.mark.parametrize("backend", ["local", "simulated"])
def test_fused_moe_through_backend(backend):
    torch.manual_seed(0)
    a2a = get_all2all_backend(backend, 8, **({"link": LinkModel(bandwidth_gbps=10, latency_us=5, ep_size=4)}
                                             if backend == "simulated" else {}))
    moe = FusedMoE(8, 2, 32, 16, all2all=a2a)
    with torch.no_grad():
        moe.w13.normal_(0, 0.2)
        moe.w2.normal_(0, 0.2)
    x = torch.randn(12, 32)
    ids, w = softmax_topk(torch.randn(12, 8), 2, True)
    want = reference_experts(x, ids, w, moe.w13, moe.w2)
    torch.testing.assert_close(moe(x, ids, w), want, atol=1e-5, rtol=1e-5)
    # The generator form yields once after each launch half and returns the same result.
    gen = moe.forward_steps(x, ids, w)
    assert [next(gen), next(gen)] == ["dispatch", "combine"]
    with pytest.raises(StopIteration) as stop:
        next(gen)
    torch.testing.assert_close(stop.value.value, want, atol=1e-5, rtol=1e-5)
    if backend == "simulated":
        rec = a2a.records
        assert [r.kind for r in rec[:2]] == ["dispatch", "combine"]
        # 12 tokens * 2 experts * 32 * 4 bytes * 3/4 remote = 2304 B at 10 GB/s + 5 us
        assert rec[0].modeled_s == pytest.approx(5e-6 + 2304 / 10e9)
        assert a2a.measured()[0][3] is None  # no CUDA timing on the CPU


@pytest.mark.parametrize("impl", ["grouped_mm", "padded_bmm", "loop"])
def test_grouped_experts_addend(impl):
    gen = torch.Generator().manual_seed(4)
    w13, w2 = _weights(6, 32, 24, gen)
    x = torch.randn(9, 32, generator=gen).bfloat16()
    ids, w = softmax_topk(torch.randn(9, 6, generator=gen), 2, True)
    add = torch.randn(9, 32, generator=gen).bfloat16()
    plain = grouped_experts(x, ids, w, w13.bfloat16(), w2.bfloat16(), impl=impl)
    assert torch.equal(grouped_experts(x, ids, w, w13.bfloat16(), w2.bfloat16(), impl=impl, addend=add), plain + add)


def test_shared_experts_fused_only_without_exchange():
    """SparseMoeBlock adds the shared experts' output in the routed experts' compute when
    the tokens stay local (same result as routed + shared); an exchange (simulated EP) or
    TP keeps the add after the combine / all-reduce."""
    from tandem.layers.moe import SparseMoeBlock
    from tandem.layers.parallel_moe import ParallelFusedMoE
    from tandem.models.llama import MLP

    torch.manual_seed(0)
    x = torch.randn(10, 32)
    for backend, fused in (("local", True), ("simulated", False)):
        a2a = get_all2all_backend(backend, 8, **({"link": LinkModel(ep_size=4)} if backend == "simulated" else {}))
        block = SparseMoeBlock(TopKRouter(32, 8, 2, renormalize=True), FusedMoE(8, 2, 32, 16, all2all=a2a), MLP(32, 24))
        for p in block.parameters():
            torch.nn.init.normal_(p, 0, 0.2)
        assert block.experts.fuses_addend == fused
        with torch.no_grad():
            ids, w = block.gate(x)
            want = block.experts(x, ids, w) + block.shared_experts(x)
            torch.testing.assert_close(block(x), want, atol=1e-6, rtol=1e-6)
        if not fused:
            with pytest.raises(ValueError, match="addend"):
                block.experts(x, ids, w, addend=x)
    assert not ParallelFusedMoE(8, 2, 32, 16, tp_size=2, tp_rank=0).fuses_addend
    assert ParallelFusedMoE(8, 2, 32, 16, tp_size=1, tp_rank=0).fuses_addend


def test_simulated_rank_experts_compute_one_ranks_share():
    """rank_experts: the layer holds E / ep_size experts and runs every routed pair on
    expert ``id % (E / ep_size)``, the load of one rank when all ranks route alike."""
    torch.manual_seed(0)
    a2a = SimulatedAll2All(8, link=LinkModel(bandwidth_gbps=10, latency_us=5, ep_size=4), rank_experts=True)
    assert (a2a.placement.num_local_experts, a2a.placement.ep_size) == (2, 4)
    moe = FusedMoE(8, 3, 32, 16, all2all=a2a)
    assert moe.w13.shape == (2, 32, 32) and moe.w2.shape == (2, 32, 16)
    with torch.no_grad():
        moe.w13.normal_(0, 0.2)
        moe.w2.normal_(0, 0.2)
    x = torch.randn(12, 32)
    ids, w = softmax_topk(torch.randn(12, 8), 3, True)
    want = reference_experts(x, ids % 2, w, moe.w13, moe.w2)
    torch.testing.assert_close(moe(x, ids, w), want, atol=1e-5, rtol=1e-5)
    # The link still carries this rank's tokens: 12 tokens * 3 experts * 32 * 4 B * 3/4 remote.
    assert a2a.records[0].modeled_s == pytest.approx(5e-6 + 12 * 3 * 32 * 4 * 0.75 / 10e9)
    with pytest.raises(ValueError, match="multiple"):
        SimulatedAll2All(6, link=LinkModel(ep_size=4), rank_experts=True)


def test_backends_reject_ep_size_above_one():
    with pytest.raises(ValueError):
        LocalAll2All(ExpertPlacement(8, 2, 0))
    with pytest.raises(ValueError):
        SimulatedAll2All(ExpertPlacement(8, 2, 1))
    with pytest.raises(ValueError):
        get_all2all_backend("nccl-magic", 8)


def test_load_expert_respects_placement():
    class _Fake(LocalAll2All):
        def __init__(self, pl):  # a rank of a 2-way EP group (data movement unused here)
            self.placement = pl

    moe = FusedMoE(4, 2, 8, 4, all2all=_Fake(ExpertPlacement(4, 2, 1)))
    assert moe.w13.shape == (2, 8, 8)
    assert not moe.load_expert("w2", 1, torch.ones(8, 4))
    assert moe.load_expert("w2", 3, torch.full((8, 4), 3.0))
    assert torch.equal(moe.w2[1], torch.full((8, 4), 3.0))
    stacked = torch.arange(4.0)[:, None, None].expand(4, 8, 8).clone()
    moe.load_fused("w13", stacked)
    assert moe.w13[:, 0, 0].tolist() == [2.0, 3.0]
