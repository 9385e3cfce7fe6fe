"""Triton attention backend vs the torch reference backend.

Without CUDA the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` is set here,
before anything imports the kernels; the interpreter decides per ``@triton.jit`` at
decoration time). With CUDA they run compiled on the GPU and the larger CUDA-only cases
run too. Force the interpreter on a GPU machine with ``TRITON_INTERPRET=1 pytest ...``.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import triton_test_setup

DEVICE, INTERPRET = triton_test_setup("tandem.attention.triton_backend", fp8_rounding=True)

from tandem.attention import triton_backend  # noqa: E402
from tandem.attention.metadata import AttentionMetadata  # noqa: E402
from tandem.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from tandem.attention.triton_backend import TritonAttentionBackend  # noqa: E402

cuda_only = pytest.mark.skipif(INTERPRET, reason="large case: compiled CUDA only")

TOL = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def make_case(
    reqs: list[tuple[int, int]],
    num_decode: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_pad_tokens: int = 0,
    strided_q: bool = False,
    seed: int = 0,
    num_blocks: int | None = None,
    max_blocks: int | None = None,
):
    """Random step: ``reqs[r] = (num_computed_tokens, query_len)``; blocks shuffled."""
    g = torch.Generator().manual_seed(seed)
    for r, (_, q_len) in enumerate(reqs[:num_decode]):
        assert q_len == 1, r
    seq_lens = [nc + ql for nc, ql in reqs]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max_blocks or max(blocks_per_req) + 2  # unused trailing entries stay 0
    num_blocks = num_blocks or 1 + sum(blocks_per_req) + 3  # block 0: null block; a few spare
    assert max_blocks >= max(blocks_per_req) and num_blocks > sum(blocks_per_req)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    block_tables = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    for r, nb in enumerate(blocks_per_req):
        block_tables[r, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]

    qsl = [0]
    slots = []
    for r, (nc, ql) in enumerate(reqs):
        qsl.append(qsl[-1] + ql)
        for p in range(nc, nc + ql):
            slots.append(int(block_tables[r, p // block_size]) * block_size + p % block_size)
    num_tokens = qsl[-1] + num_pad_tokens
    slots += [-1] * num_pad_tokens

    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    if strided_q:  # q as a view into a fused qkv projection output
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
        q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    else:
        q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)

    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        num_computed_tokens=torch.tensor([nc for nc, _ in reqs], dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        max_query_len=max(ql for _, ql in reqs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_decode_reqs=num_decode,
    )
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kv_cache.to(DEVICE), meta


def check(reqs, num_decode, num_heads, num_kv_heads, head_dim, block_size, dtype, backend=None, **kw):
    q, k, v, kv_cache, meta = make_case(reqs, num_decode, num_heads, num_kv_heads, head_dim, block_size, dtype, **kw)
    scale = head_dim**-0.5
    cache_ref = kv_cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, cache_ref, meta, scale)
    backend = backend or TritonAttentionBackend()
    out = backend.forward(q, k, v, kv_cache, meta, scale)
    n = meta.query_start_loc_cpu[-1]
    assert out.shape == q.shape and out.dtype == q.dtype
    # Block 0 (null block) takes the padding tokens' writes: duplicate slots, order undefined on CUDA.
    assert torch.equal(kv_cache[:, 1:], cache_ref[:, 1:])
    tol = TOL[dtype]
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=tol, rtol=tol)
    return out, meta


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# --------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gqa", [1, 3, 4, 8])
def test_prefill_ragged(dtype, gqa):
    """Fresh prompts of ragged lengths (incl. 1, block boundaries +-1)."""
    reqs = [(0, 37), (0, 1), (0, 16), (0, 17), (0, 64)]
    check(reqs, 0, num_heads=gqa, num_kv_heads=1, head_dim=64, block_size=16, dtype=dtype, seed=gqa)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_chunked_prefill_cached_prefix(block_size, head_dim):
    """Queries after a cached prefix / earlier chunks, lengths at and around block edges.

    Prefixes 62 / 126 / 14 put the first query right before a KV-tile edge (the split
    between the unmasked and the causally masked KV loops)."""
    reqs = [(32, 32), (31, 2), (5, 27), (100, 1), (64, 65), (62, 9), (126, 4), (14, 20)]
    check(reqs, 0, num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_long_context_chunk(dtype):
    """A short chunk at the end of a ~4000-token context (many unmasked KV tiles)."""
    reqs = [(3990, 10), (4031, 33)]
    check(reqs, 0, num_heads=2, num_kv_heads=1, head_dim=64, block_size=32, dtype=dtype)


def test_prefill_small_tiles_many_q_blocks():
    """Tiles smaller than the queries: several q blocks per request, causal diagonal tiles."""
    backend = TritonAttentionBackend(prefill_block_m=16, block_n=16)
    reqs = [(7, 45), (0, 33), (16, 16), (14, 20), (30, 18)]
    check(reqs, 0, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, backend=backend)


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gqa", [1, 3, 4, 8])
def test_decode_only(dtype, gqa):
    """Decode batch, seq lens exactly at block boundaries and off by one."""
    reqs = [(15, 1), (16, 1), (31, 1), (0, 1), (47, 1), (63, 1)]
    check(reqs, len(reqs), num_heads=gqa * 2, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, seed=gqa)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("max_splits", [1, 3, 8])
def test_decode_split_kv(block_size, head_dim, max_splits):
    """Split-KV on short contexts (small min_tokens_per_split) incl. empty trailing splits."""
    backend = TritonAttentionBackend(max_num_splits=max_splits, min_tokens_per_split=16, block_n=16)
    reqs = [(16, 1), (130, 1), (31, 1), (200, 1), (1, 1)]
    nd = len(reqs)
    splits = backend.num_decode_splits(nd, 1, 201, DEVICE)
    assert splits == max_splits
    check(reqs, nd, num_heads=4, num_kv_heads=1, head_dim=head_dim, block_size=block_size, dtype=torch.float32,
          backend=backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_long_context(dtype):
    """~4000-token decode contexts: default backend picks split-KV."""
    backend = TritonAttentionBackend(max_model_len=8192)
    reqs = [(3999, 1), (4095, 1), (777, 1)]
    assert backend.num_decode_splits(len(reqs), 1, 4096, DEVICE) > 1
    check(reqs, len(reqs), num_heads=4, num_kv_heads=1, head_dim=64, block_size=16, dtype=dtype, backend=backend)


@pytest.mark.parametrize("max_splits", [1, 4])
def test_decode_empty_sequence_gives_zeros(max_splits):
    """A padding decode request with seq_len 0 (CUDA-graph batch padding) yields 0, not NaN."""
    q, k, v, kv_cache, meta = make_case([(40, 1), (0, 1), (70, 1)], 3, 4, 2, 64, 16, torch.float32)
    meta.seq_lens[1] = 0
    meta.slot_mapping[1] = -1
    backend = TritonAttentionBackend(max_num_splits=max_splits, min_tokens_per_split=16)
    out = backend.forward(q, k, v, kv_cache, meta, 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------- mixed


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_decode_then_prefill(dtype, block_size):
    """Decode requests first, then fresh prompts and chunked prefills; padding tokens; strided q."""
    reqs = [(40, 1), (31, 1), (32, 1), (0, 23), (50, 14), (7, 1), (0, 33)]
    backend = TritonAttentionBackend(min_tokens_per_split=16)
    check(reqs, 3, num_heads=8, num_kv_heads=2, head_dim=64, block_size=block_size, dtype=dtype,
          backend=backend, num_pad_tokens=5, strided_q=True)


def test_mixed_long_context():
    reqs = [(4000, 1), (12, 1), (3950, 50)]
    check(reqs, 2, num_heads=3, num_kv_heads=1, head_dim=64, block_size=32, dtype=torch.float32)


# --------------------------------------------------------------------------- misc


@pytest.mark.parametrize("head_dim", [80, 96])
def test_non_power_of_two_head_dim_rejected(head_dim):
    q, k, v, kv_cache, meta = make_case([(0, 4)], 0, 2, 1, head_dim, 16, torch.float32)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        TritonAttentionBackend().forward(q, k, v, kv_cache, meta, head_dim**-0.5)


def test_num_splits_bounded_by_max_model_len():
    backend = TritonAttentionBackend(max_model_len=1000, max_num_splits=16, min_tokens_per_split=256)
    assert backend.max_num_splits == 4
    assert backend.num_decode_splits(1, 1, 1000, torch.device("cpu")) == 4
    assert backend.num_decode_splits(1, 1, 100, torch.device("cpu")) == 1
    assert backend.num_decode_splits(1024, 8, 1000, torch.device("cpu")) == 1


# --------------------------------------------------------------------------- CUDA only


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cuda_large_mixed(dtype, head_dim, block_size):
    g = torch.Generator().manual_seed(1)
    decode = [(int(torch.randint(1, 9000, (1,), generator=g)), 1) for _ in range(24)]
    prefill = [(0, 1000), (2048, 512), (4095, 257), (0, 1), (123, 77)]
    check(decode + prefill, len(decode), num_heads=32, num_kv_heads=8, head_dim=head_dim, block_size=block_size,
          dtype=dtype, num_pad_tokens=7)


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [32, 256])
def test_cuda_other_head_dims(dtype, head_dim):
    reqs = [(700, 1), (3000, 1), (0, 300), (1000, 129)]
    check(reqs, 2, num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype)


@cuda_only
@pytest.mark.parametrize("gqa", [1, 3, 4, 8])
def test_cuda_long_decode(gqa):
    reqs = [(16383, 1), (10000, 1), (64, 1)]
    check(reqs, 3, num_heads=4 * gqa, num_kv_heads=4, head_dim=128, block_size=16, dtype=torch.bfloat16,
          backend=TritonAttentionBackend(max_model_len=32768))


@cuda_only
def test_cuda_graph_decode_replay():
    """A captured decode step replays correctly when seq lens and block tables change.

    The decode grid must not depend on ``meta.max_seq_len`` under capture: the captured
    contexts are short, the replayed ones long (and vice versa).
    """
    backend = TritonAttentionBackend(max_model_len=8192)
    H, Hkv, D, bs, dtype = 8, 2, 128, 16, torch.bfloat16
    shape = dict(num_blocks=1200, max_blocks=512)
    scale = D**-0.5
    q, k, v, kv_cache, meta = make_case([(100, 1), (20, 1), (17, 1), (47, 1)], 4, H, Hkv, D, bs, dtype, **shape)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(q, k, v, kv_cache, meta, scale)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, kv_cache, meta, scale)
    replays = [[(6000, 1), (1, 1), (300, 1), (8000, 1)], [(15, 1), (16, 1), (31, 1), (32, 1)]]
    for seed, reqs in enumerate(replays, start=4):
        q2, k2, v2, cache2, meta2 = make_case(reqs, 4, H, Hkv, D, bs, dtype, seed=seed, **shape)
        ref = TorchAttentionBackend().forward(q2, k2, v2, cache2.clone(), meta2, scale)
        for dst, src in [(q, q2), (k, k2), (v, v2), (kv_cache, cache2), (meta.seq_lens, meta2.seq_lens),
                         (meta.slot_mapping, meta2.slot_mapping), (meta.block_tables, meta2.block_tables),
                         (meta.num_computed_tokens, meta2.num_computed_tokens)]:
            dst.copy_(src)
        graph.replay()
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@cuda_only
def test_cuda_decode_split_counts_share_one_variant():
    """Once the direct and the split-KV decode have run, eager decodes whose split counts
    (2 to 32, the partial-output strides with them) and block-table widths differ build no
    new kernel variant: both change every serving step, so a variant per value would
    compile mid-run."""
    from tandem.triton_utils import record_jit_compiles

    backend = TritonAttentionBackend()
    # Split counts 1, 2, 3, 5, 16, 32; block-table widths 9, 21, 40, 78, 256, 565 (make_case).
    contexts = [(100, 1), (300, 1), (600, 1), (1200, 1), (4050, 1), (9000, 1)]
    shape = dict(backend=backend)  # block tables as wide as each case needs, as in eager steps
    check([contexts[0]], 1, 8, 2, 128, 16, torch.bfloat16, **shape)
    check([contexts[1]], 1, 8, 2, 128, 16, torch.bfloat16, **shape)
    splits = [backend.num_decode_splits(1, 2, n + 1, torch.device(DEVICE)) for n, _ in contexts]
    assert splits[0] == 1 and len(set(splits[1:])) == len(splits) - 1 and 32 in splits, splits
    with record_jit_compiles() as built:
        for reqs in contexts[2:]:
            check([reqs], 1, 8, 2, 128, 16, torch.bfloat16, **shape)
    assert built == []


# --------------------------------------------------------------------------- FP8 KV cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("max_splits", [1, 4])
def test_fp8_kv_cache_matches_torch_backend(dtype, max_splits):
    """A float8_e4m3fn cache with per-layer scales: decode (direct and split-KV) and prefill
    chunks over cached prefixes == the torch backend over the same FP8 cache; the new
    tokens' K/V are written identically."""
    reqs = [(40, 1), (7, 1), (0, 19), (23, 6)]
    q, k, v, kv_cache, meta = make_case(reqs, 2, 8, 2, 64, 16, dtype, num_pad_tokens=2)
    k_scale, v_scale = 0.25, 0.5
    fp8_cache = (kv_cache.float() / torch.tensor([k_scale, v_scale], device=DEVICE).view(2, 1, 1, 1, 1)).to(
        torch.float8_e4m3fn)
    cache_ref = fp8_cache.clone()
    scale = 64**-0.5
    ref = TorchAttentionBackend().forward(q, k, v, cache_ref, meta, scale, k_scale, v_scale)
    backend = TritonAttentionBackend(max_num_splits=max_splits, min_tokens_per_split=16)
    out = backend.forward(q, k, v, fp8_cache, meta, scale, k_scale, v_scale)
    n = meta.query_start_loc_cpu[-1]
    assert torch.equal(fp8_cache[:, 1:].view(torch.uint8), cache_ref[:, 1:].view(torch.uint8))
    tol = TOL[dtype]
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=tol, rtol=tol)


def test_fp8_kv_cache_rejects_other_cache_dtypes():
    q, k, v, kv_cache, meta = make_case([(3, 1)], 1, 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="unsupported dtypes"):
        TritonAttentionBackend().forward(q, k, v, kv_cache.to(torch.float16), meta, 1.0)


# ------------------------------------------------ deterministic mode (issue 36)


def _decode_step(seq_lens: list[int], tables: list[list[int]], q, k, v):
    """Metadata of a decode-only step over requests with these contexts and block tables."""
    bs = 16
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for r, t in enumerate(tables):
        bt[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    slots = [tables[r][(s - 1) // bs] * bs + (s - 1) % bs for r, s in enumerate(seq_lens)]
    n = len(seq_lens)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        num_computed_tokens=torch.tensor([s - 1 for s in seq_lens], dtype=torch.int32, device=DEVICE),
        block_tables=bt.to(DEVICE), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        max_query_len=1, max_seq_len=max(seq_lens), query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=seq_lens,
        num_decode_reqs=n)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), meta


def test_deterministic_decode_row_does_not_depend_on_the_batch():
    """A decode request's output is the same bits alone and among others at any position,
    one of them with a long context: the heuristic would split the target's 600 tokens in
    3 segments alone and in 5 beside a 1500-token context (the cap follows the batch's
    longest context); in deterministic mode no split-KV decode kernel runs."""
    import random

    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    hq, hk, d, bs, num_blocks = 4, 2, 32, 16, 300
    cache = torch.randn(2, num_blocks, bs, hk, d, generator=g)
    target_len, target_blocks = 600, list(range(1, 39))
    tq, tk, tv = (torch.randn(1, h, d, generator=g) for h in (hq, hk, hk))
    backend = TritonAttentionBackend(deterministic=True)

    def run(others: list[tuple[int, list[int]]], pos: int) -> torch.Tensor:
        reqs = others[:pos] + [(target_len, target_blocks)] + others[pos:]
        n = len(reqs)
        q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hk, hk))
        q[pos], k[pos], v[pos] = tq[0], tk[0], tv[0]
        q, k, v, meta = _decode_step([s for s, _ in reqs], [t for _, t in reqs], q, k, v)
        return backend.forward(q, k, v, cache.clone().to(DEVICE), meta, d**-0.5)[pos].cpu()

    alone = run([], 0)
    free = list(range(39, num_blocks))
    for n in (2, 4):
        others = []
        for i in range(n - 1):
            s = 1500 if i == 0 else rng.randint(1, 300)
            others.append((s, [free.pop() for _ in range(-(-s // bs))]))
        assert torch.equal(run(others, rng.randrange(n)), alone), n


def _one_token_cases(seq_len: int, pos: int, chunk_sizes: tuple[int, ...], prefix_hit: int):
    """``(num_computed, query_len)`` of the steps that compute token ``pos`` of one sequence:
    the whole prompt, each chunk size's chunk holding it, the rest after a prefix-cache hit
    of ``prefix_hit`` tokens, and a decode of that token."""
    cases = {"prompt": (0, seq_len), "prefix hit": (prefix_hit, seq_len - prefix_hit), "decode": (pos, 1)}
    for c in chunk_sizes:
        start = pos // c * c
        cases[f"chunk {c}"] = (start, min(c, seq_len - start))
    return cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic_token_is_the_same_bits_in_every_phase_and_batch(dtype):
    """One token's attention output is the same bits computed in a whole prompt, in chunks of
    16 and 64, after a prefix-cache hit, as a decode, and each of those beside other requests
    (decodes and prompts of other lengths) at any position in the step."""
    import random

    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    hq, hk, d, bs = 8, 2, 64, 16
    seq_len, pos = 150, 97
    num_blocks = 200
    cache = torch.zeros(2, num_blocks, bs, hk, d).to(dtype)
    q_all, k_all, v_all = (torch.randn(seq_len, h, d, generator=g).to(dtype) for h in (hq, hk, hk))
    table = list(range(1, 1 + -(-seq_len // bs)))
    backend = TritonAttentionBackend(deterministic=True)
    free = list(range(table[-1] + 1, num_blocks))

    def other_request(decode: bool) -> tuple[int, int, list[int], torch.Tensor]:
        nc, ql = (rng.randint(1, 200), 1) if decode else (rng.choice([0, 16, 32]), rng.randint(2, 90))
        blocks = [free.pop() for _ in range(-(-(nc + ql) // bs))]
        return nc, ql, blocks, torch.randn(nc + ql, hk, d, generator=g).to(dtype)

    def run(nc: int, ql: int, others: list, at: int) -> torch.Tensor:
        """Token ``pos`` computed in a step where the sequence runs ``(nc, ql)``, placed at
        ``at`` among ``others`` (decodes first, as the runner orders them)."""
        c = cache.clone()
        reqs = others[:at] + [(nc, ql, table, None)] + others[at:]
        reqs.sort(key=lambda r: r[1] != 1)  # decodes first; stable
        qs, ks, vs, bt, slots, qsl = [], [], [], [], [], [0]
        for rnc, rql, blocks, kv in reqs:
            if kv is None:
                qr, kr, vr = q_all[rnc:rnc + rql], k_all[:rnc + rql], v_all[:rnc + rql]
            else:
                qr, kr, vr = torch.randn(rql, hq, d, generator=g).to(dtype), kv, kv.flip(0)
            for p in range(rnc):  # the cached context
                c[0, blocks[p // bs], p % bs], c[1, blocks[p // bs], p % bs] = kr[p], vr[p]
            qs.append(qr), ks.append(kr[rnc:]), vs.append(vr[rnc:])
            slots += [blocks[p // bs] * bs + p % bs for p in range(rnc, rnc + rql)]
            bt.append(blocks)
            qsl.append(qsl[-1] + rql)
        width = max(len(b) for b in bt)
        tables = torch.tensor([b + [0] * (width - len(b)) for b in bt], dtype=torch.int32)
        seq_lens = [r[0] + r[1] for r in reqs]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            num_computed_tokens=torch.tensor([r[0] for r in reqs], dtype=torch.int32, device=DEVICE),
            block_tables=tables.to(DEVICE), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
            max_query_len=max(r[1] for r in reqs), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens, num_decode_reqs=sum(r[1] == 1 for r in reqs))
        out = backend.forward(torch.cat(qs).to(DEVICE), torch.cat(ks).to(DEVICE), torch.cat(vs).to(DEVICE),
                              c.to(DEVICE), meta, d**-0.5)
        target = next(i for i, r in enumerate(reqs) if r[3] is None)
        return out[qsl[target] + pos - nc].cpu()

    ref = run(0, seq_len, [], 0)
    for name, (nc, ql) in _one_token_cases(seq_len, pos, (16, 64), prefix_hit=48).items():
        assert torch.equal(run(nc, ql, [], 0), ref), name
        others = [other_request(decode=i % 2 == 0) for i in range(rng.randint(1, 4))]
        assert torch.equal(run(nc, ql, others, rng.randrange(len(others) + 1)), ref), (name, "batched")
