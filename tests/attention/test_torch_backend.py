"""The CPU attention backend against the per-request reference computation."""

from __future__ import annotations

import pytest
import torch

from tandem.attention.torch_backend import TorchAttentionBackend, gather_kv, reference_attention
from tests.models.paged_parity import step_metadata


def run_case(reqs, num_heads, num_kv_heads, head_dim=32, block_size=16, dtype=torch.float32, seed=0,
             shuffled=True, deterministic=False, cpu_kernels=False):
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
    out = TorchAttentionBackend(deterministic, cpu_kernels).forward(q, k, v, kv_cache, meta, scale)
    return out, reference_attention(q, kv_cache, meta, scale)


CASES = {
    "decode_only": [(5, 1), (0, 1), (47, 1), (15, 1), (16, 1)],
    "prefill_only": [(0, 37), (0, 1), (0, 16), (0, 17)],
    "mixed": [(20, 1), (63, 1), (0, 21), (0, 5)],
    "chunk_on_cached_prefix": [(9, 1), (32, 7), (0, 12), (17, 16)],
    "one_decode": [(47, 1)],
    "one_decode_full_blocks": [(15, 1)],
    "one_decode_and_prefill": [(20, 1), (0, 21)],
    "long_decodes": [(700, 1), (255, 1), (256, 1), (3, 1), (0, 9)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch", "cpu-kernels"])
def test_matches_reference(case, heads, block_size, cpu_kernels):
    out, ref = run_case(CASES[case], *heads, block_size=block_size, seed=block_size, cpu_kernels=cpu_kernels)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["one_decode", "one_decode_full_blocks", "one_decode_and_prefill", "decode_only"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch", "cpu-kernels"])
def test_consecutive_blocks_match_reference(case, dtype, tol, cpu_kernels):
    """A lone decode request reads its consecutive blocks in place."""
    out, ref = run_case(CASES[case], 9, 3, block_size=4, dtype=dtype, shuffled=False, cpu_kernels=cpu_kernels)
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


# ------------------------------------------------ invariance (issue 36)

H, HK, D = 9, 3, 64  # SmolLM2's heads


class _Request:
    """One request's tokens (q/k/v per position) and blocks, replayed in any split of steps."""

    def __init__(self, length: int, dtype: torch.dtype, seed: int, first_block: int, block_size: int = 16):
        g = torch.Generator().manual_seed(seed)
        self.q = torch.randn(length, H, D, generator=g).to(dtype)
        self.k = (3 * torch.randn(length, HK, D, generator=g)).to(dtype)
        self.v = torch.randn(length, HK, D, generator=g).to(dtype)
        self.blocks = list(range(first_block, first_block + -(-length // block_size)))


def _forward(cache: torch.Tensor, steps: list[list[tuple[_Request, int, int]]],
             deterministic: bool = False, cpu_kernels: bool = False) -> list[torch.Tensor]:
    """Run ``steps`` (each a list of ``(request, computed, new)``; query-length-1 entries
    first) on one backend; returns each step's output."""
    backend, outs = TorchAttentionBackend(deterministic, cpu_kernels), []
    for step in steps:
        meta = step_metadata([n for _, _, n in step], [c for _, c, _ in step], [r.blocks for r, _, _ in step], 16)
        cat = lambda name: torch.cat([getattr(r, name)[c:c + n] for r, c, n in step])  # noqa: E731
        outs.append(backend.forward(cat("q"), cat("k"), cat("v"), cache, meta, D**-0.5))
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [17, 19, 33, 300, 530])
def test_prefill_bits_do_not_depend_on_chunks_or_cached_prefix(dtype, length):
    """Default mode: a prompt computed in one step, on top of a cached first block, or in
    chunks of 64 beside another request gives the same bits for every token of a chunk of
    two or more (SDPA's flash kernel, used before, blocked queries and keys by the chunk's
    sizes: 19 tokens differed after a 16-token cache hit in both dtypes)."""
    req, other = _Request(length, dtype, 0, 1), _Request(40, dtype, 1, 60)
    cache = lambda: torch.zeros(2, 100, 16, HK, D, dtype=dtype)  # noqa: E731
    whole = _forward(cache(), [[(req, 0, length)]])[0]
    if length - 16 > 1:  # a 1-token rest is a decode step's query (see the next test)
        cached = torch.cat([o for o in _forward(cache(), [[(req, 0, 16)], [(req, 16, length - 16)]])])
        assert torch.equal(cached, whole)
    chunks = [(c, min(64, length - c)) for c in range(0, length, 64)]
    steps = [[(req, c, n), (other, 0, 40)] if i == 0 else [(req, c, n)] for i, (c, n) in enumerate(chunks)]
    outs = _forward(cache(), steps)
    pieces = [o[:n] for o, (_, n) in zip(outs, chunks) if n > 1]
    assert torch.equal(torch.cat(pieces), whole[: sum(n for _, n in chunks if n > 1)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_decode_equals_prefill_alone_or_batched(dtype):
    """Deterministic mode: a token's attention is the same bits computed in its prompt's
    prefill, as a lone decode, or as a decode among others at any position."""
    length = 300
    req = _Request(length, dtype, 0, 1)
    others = [_Request(n, dtype, 2 + i, 40 + 20 * i) for i, n in enumerate((5, 290, 17))]
    cache = lambda: torch.zeros(2, 140, 16, HK, D, dtype=dtype)  # noqa: E731
    whole = _forward(cache(), [[(req, 0, length)]], True)[0][-1]
    alone = _forward(cache(), [[(req, 0, length - 1)], [(req, length - 1, 1)]], True)[1][0]
    assert torch.equal(alone, whole)
    for pos in range(len(others) + 1):
        batch = [(o, 0, o.q.shape[0] - 1) for o in others] + [(req, 0, length - 1)]
        decode = [(o, o.q.shape[0] - 1, 1) for o in others]
        decode.insert(pos, (req, length - 1, 1))
        assert torch.equal(_forward(cache(), [batch, decode], True)[1][pos], whole), pos


@pytest.mark.parametrize("case", ["mixed", "chunk_on_cached_prefix", "decode_only", "one_decode"])
def test_deterministic_mode_matches_reference(case):
    out, ref = run_case(CASES[case], 9, 3, block_size=4, seed=3, deterministic=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lone_decode_bits_do_not_depend_on_the_block_layout(dtype):
    """A lone decode request read in place (consecutive blocks) or gathered (scattered
    blocks) gives the same bits: the physical layout chooses no arithmetic."""
    req = _Request(70, dtype, 0, 3)
    steps = [[(req, 0, 69)], [(req, 69, 1)]]
    in_place = _forward(torch.zeros(2, 40, 16, HK, D, dtype=dtype), steps)[1]
    req.blocks = [30, 7, 19, 2, 11]
    gathered = _forward(torch.zeros(2, 40, 16, HK, D, dtype=dtype), steps)[1]
    assert torch.equal(in_place, gathered)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_decode_bits_do_not_depend_on_the_batch_or_threads(dtype):
    """With the C++ decode kernel a request's decode output is the same bits alone, among
    other decodes at any place, over scattered blocks, and on one thread or more (its
    splits are fixed in size and computed alone: the default mode gets batch invariance
    of decode without the deterministic mode's cost)."""
    length = 600  # three of the kernel's 256-key splits
    req = _Request(length, dtype, 0, 1)
    others = [_Request(n, dtype, 2 + i, 45 + 40 * i) for i, n in enumerate((5, 530, 17))]
    cache = lambda: torch.zeros(2, 200, 16, HK, D, dtype=dtype)  # noqa: E731
    prefill = [(req, 0, length - 1)]
    alone = _forward(cache(), [prefill, [(req, length - 1, 1)]], cpu_kernels=True)[1][0]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_forward(cache(), [prefill, [(req, length - 1, 1)]], cpu_kernels=True)[1][0], alone)
    finally:
        torch.set_num_threads(threads)
    for pos in range(len(others) + 1):
        batch = [(o, 0, o.q.shape[0] - 1) for o in others] + prefill
        decode = [(o, o.q.shape[0] - 1, 1) for o in others]
        decode.insert(pos, (req, length - 1, 1))
        assert torch.equal(_forward(cache(), [batch, decode], cpu_kernels=True)[1][pos], alone), pos
    req.blocks = list(reversed(req.blocks))
    assert torch.equal(_forward(cache(), [prefill, [(req, length - 1, 1)]], cpu_kernels=True)[1][0], alone)
