"""The torch.distributed EP backends against ``local`` on 2 and 4 gloo ranks: random
routing, uneven token counts (ranks with 0 tokens), uneven expert counts per rank (10
experts over 4 ranks), two exchanges in flight (DBO), and the FusedMoE layer end to end;
plus the single-process checks (missing forward context)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed._harness import run_ranks

K, H, I = 2, 16, 24
BACKENDS = ("allgather_reducescatter", "all_to_all")
# Per world size: experts, and (tokens per rank, seed) cases: uneven, ranks empty, equal, single token.
LAYOUTS = {
    2: (8, [((5, 3), 1), ((0, 7), 2), ((6, 0), 3), ((4, 4), 4), ((1, 1), 5)]),
    4: (10, [((5, 3, 0, 7), 1), ((0, 0, 6, 0), 2), ((4, 4, 4, 4), 4), ((1, 1, 1, 1), 5)]),
}


def _weights(E: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2


def _tokens(rank: int, t: int, seed: int, E: int):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    hidden = torch.randn(t, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else torch.zeros(0, K, dtype=torch.long)
    w = torch.rand(t, K, generator=g)
    return hidden, ids, w


def _ranks_body(rank, world, port):
    import torch.distributed as dist

    from tandem.distributed.all2all import ExpertPlacement
    from tandem.distributed.all2all_factory import make_all2all_factory
    from tandem.distributed.ep_all2all import EPBufferPool
    from tandem.distributed.forward_context import ForwardContext, forward_context
    from tandem.layers.moe import FusedMoE, grouped_experts

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    E, cases = LAYOUTS[world]
    w13, w2 = _weights(E)
    pl = ExpertPlacement(E, world, rank)
    lo, hi = pl.first_local_expert, pl.first_local_expert + pl.num_local_experts
    report = []
    for name in BACKENDS:
        factory = make_all2all_factory(name, group=dist.group.WORLD, ep_size=world, ep_rank=rank)
        be = factory(E)
        for counts, seed in cases:
            hidden, ids, w = _tokens(rank, counts[rank], seed, E)
            want = grouped_experts(hidden, ids, w, w13, w2, impl="loop")
            with forward_context(ForwardContext(max_tokens_per_rank=max(counts))):
                x, lid, lw, meta = be.dispatch_wait(be.dispatch_launch(hidden, ids, w))
                assert lid.min() >= -1 and lid.max() < pl.num_local_experts
                out = be.combine_wait(be.combine_launch(grouped_experts(x, lid, lw, w13[lo:hi], w2[lo:hi], "loop"), meta))
            assert out.shape == (counts[rank], H)
            report.append((name, counts, float((out - want).abs().max()) if out.numel() else 0.0))
        # Two ubatches in flight at once (DBO order: D0 D1 | C0 C1), different sizes; the
        # ubatch id of the forward context picks each one's buffer slot.
        a, b = _tokens(rank, 3 + rank, 7, E), _tokens(rank, 2, 8, E)
        ctx = [ForwardContext(max_tokens_per_rank=2 + world, ubatch_id=i) for i in (0, 1)]
        with forward_context(ctx[0]):
            ha = be.dispatch_launch(*a)
        with forward_context(ctx[1]):
            hb = be.dispatch_launch(*b)
        xa, ia, wa, ma = be.dispatch_wait(ha)
        xb, ib, wb, mb = be.dispatch_wait(hb)
        with forward_context(ctx[0]):
            ca = be.combine_launch(grouped_experts(xa, ia, wa, w13[lo:hi], w2[lo:hi], "loop"), ma)
        with forward_context(ctx[1]):
            cb = be.combine_launch(grouped_experts(xb, ib, wb, w13[lo:hi], w2[lo:hi], "loop"), mb)
        oa, ob = be.combine_wait(ca), be.combine_wait(cb)
        for (hid, i_, w_), o in ((a, oa), (b, ob)):
            report.append((name, "dbo", float((o - grouped_experts(hid, i_, w_, w13, w2, "loop")).abs().max())))
        # The FusedMoE layer with this backend (weights loaded from the full stack).
        moe = FusedMoE(E, K, H, I, factory(E))
        moe.load_fused("w13", w13)
        moe.load_fused("w2", w2)
        hidden, ids, w = _tokens(rank, 2 + 3 * rank, 9, E)
        with forward_context(ForwardContext(max_tokens_per_rank=2 + 3 * (world - 1))), torch.no_grad():
            got = moe(hidden, ids, w)
        report.append((name, "fused_moe", float((got - grouped_experts(hidden, ids, w, w13, w2, "loop")).abs().max())))
        assert isinstance(factory.pool, EPBufferPool)
    dist.destroy_process_group()
    return report


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_ep_backends_match_local_on_gloo_ranks(world):
    results = run_ranks(_ranks_body, world, timeout=180)
    for rank, report in enumerate(results):
        for name, case, err in report:
            assert err < 1e-5, (rank, name, case, err)
    assert len(results[0]) == len(BACKENDS) * (len(LAYOUTS[world][1]) + 3)


def test_ep_backend_needs_forward_context():
    """A multi-rank exchange without a forward context, or with more local tokens than
    agreed, is a clear error."""
    from tandem.distributed.ep_all2all import forward_capacity
    from tandem.distributed.forward_context import ForwardContext, forward_context

    with pytest.raises(RuntimeError, match="ForwardContext"):
        forward_capacity(3)
    with forward_context(ForwardContext(max_tokens_per_rank=2)):
        with pytest.raises(ValueError, match="exceed"):
            forward_capacity(3)
        assert forward_capacity(2) == 2


def test_single_rank_backends_refuse_ep():
    from tandem.distributed.all2all_factory import make_all2all_factory

    with pytest.raises(ValueError, match="one rank"):
        make_all2all_factory("simulated", ep_size=2, ep_rank=0)(8)
    assert make_all2all_factory("local")(8).placement.num_local_experts == 8
