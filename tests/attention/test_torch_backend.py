"""The CPU attention backend against the per-request reference computation."""

from __future__ import annotations

import pytest
import torch

from tandem.attention.torch_backend import TorchAttentionBackend, gather_kv, reference_attention
from tests.models.paged_parity import step_metadata


def run_case(reqs, num_heads, num_kv_heads, head_dim=32, block_size=16, dtype=torch.float32, seed=0,
             shuffled=True):
    """``reqs[r] = (num_computed_tokens, query_len)``, decode requests (query_len 1) first;
    blocks shuffled over the cache (else consecutive). Returns (backend output, reference
    output)."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-(c + n) // block_size) for c, n in reqs]
    num_blocks = 1 + sum(nblocks) + 2
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist() if shuffled else list(range(2, num_blocks))
    tables = []
    for nb in nblocks:
        tables.append(perm[:nb])
        perm = perm[nb:]
    meta = step_metadata([n for _, n in reqs], [c for c, _ in reqs], tables, block_size)
    t = meta.query_start_loc_cpu[-1]
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(t, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    out = TorchAttentionBackend().forward(q, k, v, kv_cache, meta, scale)
    return out, reference_attention(q, kv_cache, meta, scale)


CASES = {
    "decode_only": [(5, 1), (0, 1), (47, 1), (15, 1), (16, 1)],
    "prefill_only": [(0, 37), (0, 1), (0, 16), (0, 17)],
    "mixed": [(20, 1), (63, 1), (0, 21), (0, 5)],
    "chunk_on_cached_prefix": [(9, 1), (32, 7), (0, 12), (17, 16)],
    "one_decode": [(47, 1)],
    "one_decode_full_blocks": [(15, 1)],
    "one_decode_and_prefill": [(20, 1), (0, 21)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_reference(case, heads, block_size):
    out, ref = run_case(CASES[case], *heads, block_size=block_size, seed=block_size)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["one_decode", "one_decode_full_blocks", "one_decode_and_prefill", "decode_only"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_consecutive_blocks_match_reference(case, dtype, tol):
    """A lone decode request reads its consecutive blocks in place."""
    out, ref = run_case(CASES[case], 9, 3, block_size=4, dtype=dtype, shuffled=False)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_bf16_matches_reference():
    out, ref = run_case(CASES["mixed"], 9, 3, dtype=torch.bfloat16)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_backend_reused_across_steps():
    """The per-step decode mask is rebuilt for every new step's metadata."""
    backend = TorchAttentionBackend()
    for step, lens in enumerate(([3, 40], [4, 41], [70, 2])):
        meta = step_metadata([1, 1], lens, [list(range(1, 6)), list(range(6, 11))], 16)
        g = torch.Generator().manual_seed(step)
        kv = torch.randn(2, 12, 16, 2, 8, generator=g)
        q, k, v = torch.randn(2, 4, 8, generator=g), torch.randn(2, 2, 8, generator=g), torch.randn(2, 2, 8, generator=g)
        out = backend.forward(q, k, v, kv, meta, 0.3)
        torch.testing.assert_close(out, reference_attention(q, kv, meta, 0.3), atol=1e-5, rtol=1e-5)


def test_gather_kv_layout():
    kv = torch.arange(2 * 6 * 4 * 1 * 1, dtype=torch.float32).view(2, 6, 4, 1, 1)
    k, v = gather_kv(kv, torch.tensor([[3, 1, 0], [5, 2, 0]], dtype=torch.int32), 2)
    assert k.shape == (2, 8, 1, 1)
    assert k[0, :, 0, 0].tolist() == kv[0, 3].flatten().tolist() + kv[0, 1].flatten().tolist()
    assert v[1, :, 0, 0].tolist() == kv[1, 5].flatten().tolist() + kv[1, 2].flatten().tolist()


def test_gather_into_buffer_matches_fresh():
    kv = torch.randn(2, 9, 4, 2, 3)
    bt = torch.tensor([[3, 1, 7], [5, 2, 8]], dtype=torch.int32)
    buf = torch.full((2 * 2 * 3 * 4 * 2 * 3 + 5,), float("nan"))
    for a, b in zip(gather_kv(kv, bt, 3), gather_kv(kv, bt, 3, out=buf)):
        assert torch.equal(a, b)
