"""Batch-invariant Triton GEMM (tandem.layers.matmul_triton, issue 51) == F.linear, and a
row's bits do not depend on the batch.

On the CPU the kernel runs in the Triton interpreter (TRITON_INTERPRET=1, set by
conftest.py); the shapes stay small. With CUDA the same tests run on the GPU.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interpreter import triton_test_setup

DEVICE, INTERPRET = triton_test_setup("tandem.layers.matmul_triton", bf16_rounding=True)

from tandem.layers import batch_invariant  # noqa: E402
from tandem.layers.matmul_triton import bmm_batch_invariant, matmul_batch_invariant, tile_config  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Against F.linear of the same operands in fp64: fp32 sums, one rounding to the dtype.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _operands(shape, n, k, dtype, seed, bias=True):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(*shape, k, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, generator=g, device=DEVICE) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g, device=DEVICE).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead,n,k", [
    ((5,), 48, 64),  # one tile, K a multiple of BLOCK_K
    ((37,), 80, 96),  # N, K not multiples of the blocks (K tail masked)
    ((2, 70), 300, 40),  # leading dims; several row and column tiles, more than one per program
    ((3,), 7, 5),  # N, K under tl.dot's 16
])
def test_matches_f_linear(dtype, bias, lead, n, k):
    x, w, b = _operands(lead, n, k, dtype, seed=n * 7 + k)
    got = matmul_batch_invariant(x, w, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (*lead, n)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


def test_no_rows_and_strided_operands():
    x, w, b = _operands((4, 0), 24, 32, torch.float32, seed=1)
    assert matmul_batch_invariant(x, w, b).shape == (4, 0, 24)
    x, w, b = _operands((6,), 24, 64, torch.float32, seed=2)
    xs, wt = x[:, ::2], w.t().contiguous().t()[:, 1::2]  # rows not contiguous; a column-major weight view
    torch.testing.assert_close(matmul_batch_invariant(xs, wt, b), F.linear(xs, wt, b), **TOL[torch.float32])
    wide = torch.cat([x, x], 1)[:, 3:67]  # rows at a pitch of 128, unaligned; one of them alone
    assert torch.equal(matmul_batch_invariant(wide[2:3], w, b)[0], matmul_batch_invariant(wide, w, b)[2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_does_not_depend_on_the_batch(dtype):
    """One row alone and at a random place among 1..300 random rows: the same bits (MKL's
    fp32 GEMM on the CPU, cuBLAS on the GPU, need not give them)."""
    n, k = 80, 96
    g, rng = torch.Generator(device=DEVICE).manual_seed(3), random.Random(3)
    w = torch.randn(n, k, generator=g, device=DEVICE).to(dtype)
    b = torch.randn(n, generator=g, device=DEVICE).to(dtype)
    row = torch.randn(k, generator=g, device=DEVICE).to(dtype)
    alone = matmul_batch_invariant(row[None], w, b)[0]
    for m in [*range(2, 18), 31, 32, 33, 63, 64, 65, 127, 128, 129, 200, 255, 256, 257, 300]:
        x = torch.randn(m, k, generator=g, device=DEVICE).to(dtype)
        pos = rng.randrange(m)
        x[pos] = row
        assert torch.equal(matmul_batch_invariant(x, w, b)[pos], alone), (m, pos)


def test_tile_config_takes_no_batch_size():
    """The configuration is a function of (N, K, dtype) only; the kernel is not specialised on M."""
    from tandem.layers.matmul_triton import _matmul_kernel

    assert list(inspect.signature(tile_config).parameters) == ["n", "k", "dtype"]
    jit_args = _matmul_kernel.kwargs if INTERPRET else vars(_matmul_kernel)  # InterpretedFunction / JITFunction
    assert jit_args["do_not_specialize"] == ["M"]
    shapes = [(6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096), (128256, 4096), (64, 2048), (80, 96)]
    cfgs = {(n, k, dt): tile_config(n, k, dt) for n, k in shapes for dt in DTYPES}
    assert all(tile_config(*key) == cfg for key, cfg in cfgs.items())  # a pure function
    assert tuple(cfgs[4096, 4096, torch.bfloat16]) == (128, 128, 64, 8, 8, 4)
    assert cfgs[4096, 4096, torch.float16] == cfgs[4096, 4096, torch.bfloat16]
    assert tuple(cfgs[128256, 4096, torch.bfloat16])[:3] == (128, 256, 64)
    assert tuple(cfgs[64, 2048, torch.float32])[:3] == (16, 32, 128)
    assert tuple(cfgs[80, 96, torch.bfloat16])[:3] == (128, 128, 64)
    assert tile_config(7, 5, torch.float32).block_n == tile_config(7, 5, torch.float32).block_k == 16
    with pytest.raises(ValueError, match="dtype"):
        tile_config(64, 64, torch.float64)


@pytest.mark.parametrize("args,match", [
    (lambda x, w, b: (x.double(), w.double(), b.double()), "x dtype"),
    (lambda x, w, b: (x, w[:, :-1], b), "weight must be"),
    (lambda x, w, b: (x, w[0], b), "weight must be"),
    (lambda x, w, b: (x, w.half(), b), "weight is"),
    (lambda x, w, b: (x, w, b[:-1]), "bias must be"),
    (lambda x, w, b: (x, w, b.half()), "bias must be"),
    (lambda x, w, b: (x, w, b.to("meta")), "bias must be"),
])
def test_value_errors(args, match):
    x, w, b = _operands((3,), 16, 16, torch.float32, seed=4)
    with pytest.raises(ValueError, match=match):
        matmul_batch_invariant(*args(x, w, b))


def test_linear_routes_cuda_rows_to_the_kernel(monkeypatch):
    """In deterministic mode batch_invariant.linear sends CUDA tensors to the Triton GEMM
    (checked without a GPU by making the CPU input look like a CUDA one)."""
    import tandem.layers.matmul_triton as mt

    calls = []
    monkeypatch.setattr(mt, "matmul_batch_invariant", lambda x, w, b=None: calls.append(x.shape) or F.linear(x, w, b))
    x, w, b = _operands((5,), 16, 32, torch.float32, seed=5)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    batch_invariant.linear(x, w, b)
    assert calls == [(5, 32)]


@pytest.mark.skipif(DEVICE.type == "cuda", reason="CPU tensors")
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    import tandem.layers.matmul_triton as mt

    monkeypatch.setattr(mt, "_INTERPRET", False)
    x, w, b = _operands((3,), 16, 16, torch.float32, seed=6)
    with pytest.raises(ValueError, match="interpreter"):
        matmul_batch_invariant(x, w, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k,dtype", [(6144, 4096, torch.bfloat16), (28672, 4096, torch.bfloat16),
                                       (64, 2048, torch.float32)])
def test_cuda_linear_rows_do_not_depend_on_the_batch(n, k, dtype):
    """Llama-3.1-8B qkv / gate_up in bf16 and an MoE router's fp32 logits, through
    batch_invariant.linear (cuBLAS need not give the same bits)."""
    g, rng = torch.Generator(device="cuda").manual_seed(7), random.Random(7)
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(dtype)
    row = torch.randn(k, generator=g, device="cuda").to(dtype)
    alone = batch_invariant.linear(row[None], w)[0]
    for m in (2, 3, 16, 17, 64, 127, 128, 129, 300, 1000, 2048, 4097):
        x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
        pos = rng.randrange(m)
        x[pos] = row
        assert torch.equal(batch_invariant.linear(x, w)[pos], alone), (m, pos)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_matches_torch_and_rows_do_not_depend_on_the_batch(dtype):
    """The per-head form (MLA's W_uk / W_uv): ``x [M, heads, K]`` read in place from a wider
    projection output, a transposed weight view; equal to torch.bmm to the dtype's
    tolerance, and one token's rows the same bits among 1..70 tokens at any place."""
    g, rng = torch.Generator(device=DEVICE).manual_seed(9), random.Random(9)
    heads, k, n = 3, 40, 24
    w = (torch.randn(heads, n, k, generator=g, device=DEVICE) * k**-0.5).to(dtype).transpose(1, 2)  # [B, K, N] view

    def per_head_view(rows: torch.Tensor) -> torch.Tensor:  # [M, heads, K] inside [M, heads, K + 8]
        wide = torch.randn(rows.shape[0], heads, k + 8, generator=g, device=DEVICE).to(dtype)
        wide[..., 8:] = rows
        return wide[..., 8:]

    x = per_head_view(torch.randn(5, heads, k, generator=g, device=DEVICE).to(dtype))
    want = torch.bmm(x.double().transpose(0, 1), w.double()).transpose(0, 1)
    torch.testing.assert_close(bmm_batch_invariant(x, w).double(), want, **TOL[dtype])
    row = torch.randn(heads, k, generator=g, device=DEVICE).to(dtype)
    alone = bmm_batch_invariant(per_head_view(row[None]), w)[0]
    for m in (2, 7, 16, 33, 70):
        rows = torch.randn(m, heads, k, generator=g, device=DEVICE).to(dtype)
        at = rng.randrange(m)
        rows[at] = row
        assert torch.equal(bmm_batch_invariant(per_head_view(rows), w)[at], alone), (m, at)
    assert bmm_batch_invariant(x[:0], w).shape == (0, heads, n)
    with pytest.raises(ValueError, match="weight \\[B, K, N\\]"):
        bmm_batch_invariant(x, w.transpose(1, 2))
