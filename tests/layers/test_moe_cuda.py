"""MoE on CUDA (skipped without a GPU): torch._grouped_mm in bf16 equals the per-expert
loop, the grouped path makes no host sync, and the simulated all2all's measured delay
follows its model while compute overlaps it."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.distributed.all2all import LinkModel, SimulatedAll2All
from tandem.layers.moe import FusedMoE, grouped_experts, grouped_mm_available, reference_experts, softmax_topk

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("impl", ["grouped_mm", "padded_bmm"])
def test_grouped_equals_reference_bf16(impl):
    dev = torch.device("cuda")
    if impl == "grouped_mm" and not grouped_mm_available(dev, torch.bfloat16):
        pytest.skip("torch._grouped_mm needs sm90+")
    g = torch.Generator(device=dev).manual_seed(0)
    n, e, k, h, i = 300, 16, 4, 256, 128
    x = torch.randn(n, h, device=dev, generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * i, h, device=dev, generator=g) * h**-0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device=dev, generator=g) * i**-0.5).bfloat16()
    ids = torch.rand(n, e // 2, device=dev, generator=g).topk(k, dim=-1).indices  # experts 8..15 idle
    ids[::7, 0] = -1  # slots owned by another rank
    w = torch.rand(n, k, device=dev, generator=g)
    got = grouped_experts(x, ids, w, w13, w2, impl=impl)
    want = reference_experts(x, ids, w, w13, w2)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@cuda
def test_grouped_mm_path_is_graph_capturable():
    dev = torch.device("cuda")
    if not grouped_mm_available(dev, torch.bfloat16):
        pytest.skip("torch._grouped_mm needs sm90+")
    moe = FusedMoE(8, 2, 128, 64, impl="grouped_mm").to(dev, torch.bfloat16)
    with torch.no_grad():
        moe.w13.normal_(0, 0.05)
        moe.w2.normal_(0, 0.05)
        x = torch.randn(64, 128, device=dev).bfloat16()
        ids, w = softmax_topk(torch.randn(64, 8, device=dev), 2, True)
        want = moe(x, ids, w)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            moe(x, ids, w)  # warm-up off the default stream
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x, ids, w)
        graph.replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(out, want)


@cuda
def test_simulated_all2all_delay_and_overlap():
    dev = torch.device("cuda")
    link = LinkModel(bandwidth_gbps=1.0, latency_us=100.0, ep_size=8)  # slow link: ms-scale exchanges
    a2a = SimulatedAll2All(64, link=link)
    moe = FusedMoE(64, 6, 1024, 512, all2all=a2a, impl="auto").to(dev, torch.bfloat16)
    with torch.no_grad():
        moe.w13.normal_(0, 0.02)
        moe.w2.normal_(0, 0.02)
        x = torch.randn(256, 1024, device=dev).bfloat16()
        ids, w = softmax_topk(torch.randn(256, 64, device=dev), 6, True)
        local = FusedMoE(64, 6, 1024, 512, impl="auto").to(dev, torch.bfloat16)
        local.load_state_dict(moe.state_dict())
        torch.testing.assert_close(moe(x, ids, w), local(x, ids, w))
        a2a.records.clear()
        moe(x, ids, w)
        torch.cuda.synchronize()
        for kind, _, modeled, measured in a2a.measured():
            assert measured is not None
            print(f"{kind}: modeled {modeled * 1e3:.3f} ms, measured {measured * 1e3:.3f} ms")
            assert measured == pytest.approx(modeled, rel=0.15, abs=5e-5)
        # Compute on the current stream overlaps an in-flight dispatch.
        a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

        def compute_chain():
            b = a
            for _ in range(20):
                b = b @ a * 1e-3
            return b

        compute_chain()  # warm-up (cuBLAS heuristics)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        compute_chain()
        torch.cuda.synchronize()
        compute = time.perf_counter() - t0
        t0 = time.perf_counter()
        h = a2a.dispatch_launch(x, ids, w)
        compute_chain()
        a2a.dispatch_wait(h)
        torch.cuda.synchronize()
        both = time.perf_counter() - t0
        comm = a2a.records[-1].modeled_s
        print(f"overlap: compute {compute * 1e3:.2f} ms, comm {comm * 1e3:.2f} ms, both {both * 1e3:.2f} ms")
        assert both < compute + comm - 0.3 * min(compute, comm)


def _prefill_meta(lens, tables, bs, dev):
    from tandem.attention.metadata import AttentionMetadata

    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    slots = [t[p // bs] * bs + p % bs for n, t in zip(lens, tables) for p in range(n)]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    return AttentionMetadata(torch.tensor(qsl, **i32), torch.tensor(lens, **i32), torch.zeros(len(lens), **i32), bt,
                             torch.tensor(slots, device=dev), max(lens), max(lens), qsl, list(lens), 0)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deepseek_decode_cuda_graph_equals_eager(dtype):
    """MLA (absorbed decode over the latent cache) + MoE (grouped_mm in bf16, padded bmm
    at capture-time capacity in fp32) replayed as decode CUDA graphs == eager."""
    import numpy as np
    from transformers import DeepseekV2Config

    from tandem.attention.metadata import AttentionMetadata
    from tandem.models.deepseek_v2 import DeepseekV2ForCausalLM

    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = DeepseekV2Config(vocab_size=300, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                           intermediate_size=192, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                           n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=None,
                           qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=256)
    model = DeepseekV2ForCausalLM(cfg).to(dev, dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.08)
    bs, nblocks, max_blocks = 16, 64, 8
    caches = [torch.zeros(1, nblocks, bs, 1, 80, dtype=dtype, device=dev) for _ in range(3)]
    lens, tables = [5, 17, 30], [[3], [7, 9], [11, 12]]
    with torch.inference_mode():
        ids = torch.randint(0, 300, (sum(lens),), device=dev)
        pos = torch.cat([torch.arange(n, device=dev) for n in lens])
        model(ids, pos, caches, _prefill_meta(lens, tables, bs, dev))
        # One decode step eagerly ...
        tok = torch.randint(0, 300, (3,), device=dev)
        positions = np.array(lens)
        slot = np.array([t[p // bs] * bs + p % bs for t, p in zip(tables, lens)])
        seq_lens = positions + 1
        bt = np.zeros((3, max_blocks), dtype=np.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = t
        i32 = dict(dtype=torch.int32, device=dev)
        meta = AttentionMetadata(torch.arange(4, **i32), torch.tensor(seq_lens, **i32), torch.tensor(positions, **i32),
                                 torch.tensor(bt, device=dev), torch.tensor(slot, device=dev), 1, int(seq_lens.max()),
                                 [0, 1, 2, 3], seq_lens.tolist(), 3)
        want = model(tok, torch.tensor(positions, device=dev), caches, meta).clone()
        # ... and replayed from a graph captured for 4 sequences (one padding row), with
        # host-side metadata that does not know the real lengths (as a graph runner's).
        n = 4
        b = dict(ids=torch.zeros(n, dtype=torch.long, device=dev), pos=torch.zeros(n, dtype=torch.long, device=dev),
                 slot=torch.full((n,), -1, dtype=torch.long, device=dev), seq=torch.ones(n, **i32),
                 comp=torch.zeros(n, **i32), bt=torch.zeros(n, max_blocks, **i32))
        gmeta = AttentionMetadata(torch.arange(n + 1, **i32), b["seq"], b["comp"], b["bt"], b["slot"], 1,
                                  max_blocks * bs, list(range(n + 1)), [1] * n, n)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(b["ids"], b["pos"], caches, gmeta)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(b["ids"], b["pos"], caches, gmeta)
        b["ids"][:3].copy_(tok)
        b["pos"][:3].copy_(torch.tensor(positions, device=dev))
        b["slot"][:3].copy_(torch.tensor(slot, device=dev))
        b["seq"][:3].copy_(torch.tensor(seq_lens, **i32))
        b["comp"][:3].copy_(torch.tensor(positions, **i32))
        b["bt"][:3].copy_(torch.tensor(bt, device=dev))
        graph.replay()
        torch.cuda.synchronize()
        got = out[:3].clone()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
