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


TINY_LLAMA = dict(model_type="llama", vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256)


class _EagerReplays:
    """A stand-in for a captured graph on the CPU: replaying runs the forward again on the
    persistent buffers, into the output tensor the capture returned. The CPU backend reads
    the host copies of the sequence lengths, which a graph's kernels read on the device:
    they are taken from the buffers here."""

    def __init__(self, graphs, size: int) -> None:
        self.graphs, self.size = graphs, size
        if not hasattr(graphs, "_device_meta"):
            graphs._device_meta = graphs._meta
            graphs._meta = lambda start, end: _with_host_lens(graphs._device_meta(start, end))
        self.out = graphs._forward(size, False).clone()

    def replay(self) -> None:
        self.out.copy_(self.graphs._forward(self.size, False))


def _with_host_lens(meta):
    from dataclasses import replace

    return replace(meta, seq_lens_cpu=meta.seq_lens.tolist(), max_seq_len=int(meta.seq_lens.max()))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_verify_graphs_give_the_eager_forward_of_uneven_queries(device):
    """Graphs of ``query_len`` rows per sequence (speculative decoding's verification and
    catch-up steps) replayed for sequences of 1..query_len tokens each, at several capture
    sizes: the hidden states and the K/V written are the unpadded eager forward's, and the
    padding rows write nothing outside the null block."""
    from transformers import AutoConfig

    from tandem.attention.metadata import AttentionMetadata
    from tandem.attention.selector import get_attention_backend
    from tandem.model_loader.loader import build_model
    from tandem.worker.cuda_graph import DecodeCUDAGraphs
    from tandem.worker.step_plan import StepMode, StepPlanner

    dev = torch.device(device)
    torch.manual_seed(0)
    d = dict(TINY_LLAMA)
    hf = AutoConfig.for_model(d.pop("model_type"), **d)
    max_len = 256
    model = build_model(hf, "", "dummy", get_attention_backend(dev, max_len), torch.float32, dev, max_positions=max_len)
    bs, max_blocks, q = 16, max_len // 16, 5
    nblocks = 1 + 8 * max_blocks
    kv = [torch.randn(2, nblocks, bs, 2, 16, device=dev) for _ in range(hf.num_hidden_layers)]
    g = DecodeCUDAGraphs(model, kv, 8, max_blocks, bs, dev, sizes=[1, 2, 4, 8], label="verification", query_len=q,
                         max_position=max_len - 1)
    with torch.inference_mode():
        if device == "cuda":
            g.capture()
        else:
            for s in g.sizes:
                fake = _EagerReplays(g, s)
                g.graphs[s], g.outputs[s] = fake, fake.out
    planner = StepPlanner(graph_sizes=[1, 2, 4, 8], verify_sizes=g.sizes, verify_query_len=q)
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 6, 8):
        q_lens = rng.integers(1, q + 1, n)
        q_lens[0] = q if n > 1 else 2  # a full sequence beside uneven ones; one alone with two
        qsl = np.concatenate([[0], np.cumsum(q_lens)])
        computed = rng.integers(0, max_len - q, n)
        if n > 1:
            computed[-1] = max_len - q_lens[-1]  # its padding rows would pass max_model_len
        table = (1 + np.arange(n)[:, None] * max_blocks + np.arange(max_blocks)[None, :]).astype(np.int32)
        pos = np.concatenate([c + np.arange(k) for c, k in zip(computed, q_lens)])
        row = np.repeat(np.arange(n), q_lens)
        slots = table[row, pos // bs].astype(np.int64) * bs + pos % bs
        ids = torch.randint(0, 300, (int(qsl[-1]),), device=dev)
        plan = planner.plan(int(qsl[-1]), decode_only=False, num_reqs=n, max_query_len=int(q_lens.max()))
        assert plan.mode is StepMode.GRAPH and plan.query_len == q
        size = plan.padded_tokens // q
        assert size == min(s for s in g.sizes if s >= n)
        want_kv = [c.clone() for c in kv]
        i32 = dict(dtype=torch.int32, device=dev)
        meta = AttentionMetadata(torch.tensor(qsl, **i32), torch.tensor(computed + q_lens, **i32),
                                 torch.tensor(computed, **i32), torch.tensor(table, device=dev),
                                 torch.tensor(slots, device=dev), int(q_lens.max()), int((computed + q_lens).max()),
                                 qsl.tolist(), (computed + q_lens).tolist(), 0)
        with torch.inference_mode():
            want = model(ids, torch.tensor(pos, device=dev), want_kv, meta)
            got = g.run(n, ids, pos, slots, computed + q_lens, computed, torch.tensor(table, device=dev), size,
                        qsl).clone()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for c, w in zip(kv, want_kv):  # the null block (0) takes the padding rows' writes
            torch.testing.assert_close(c[:, 1:], w[:, 1:], atol=1e-5, rtol=0)
            c.copy_(w)


def test_verify_plans():
    """A verification graph serves steps without prompt tokens whose sequences hold 2..1+K
    tokens, up to its largest size, when the rank plans alone; others keep their plans."""
    from tandem.worker.cuda_graph import verify_capture_sizes
    from tandem.worker.step_plan import StepMode, StepPlanner

    assert verify_capture_sizes(256, 1, 5) == [1]
    assert verify_capture_sizes(256, None, 5) == [1, 2, 4] + list(range(8, 97, 8)) + [102]
    assert verify_capture_sizes(8, None, 5) == [1, 2, 4, 8]
    assert verify_capture_sizes(4, 600, 600) == [1]
    p = StepPlanner(graph_sizes=[1, 2, 4], verify_sizes=[1, 2], verify_query_len=5)
    assert p.plan(2, decode_only=True, num_reqs=2) == p.plan(2, decode_only=True)  # a decode graph
    assert p.plan(2, decode_only=True).query_len == 1
    plan = p.plan(7, decode_only=False, num_reqs=2, max_query_len=5)
    assert (plan.mode, plan.padded_tokens, plan.query_len) == (StepMode.GRAPH, 10, 5)
    for kwargs in (dict(num_reqs=3, max_query_len=5), dict(num_reqs=2, max_query_len=6),
                   dict(num_reqs=2, max_query_len=5, with_prompt=True)):
        assert p.plan(7, decode_only=False, **kwargs).mode is StepMode.EAGER
    assert StepPlanner(graph_sizes=[1, 2, 4]).plan(7, decode_only=False, num_reqs=2, max_query_len=5).mode is StepMode.EAGER
