"""The CPU's C++ kernels (tandem.layers.cpu_ops, tandem/csrc/cpu): they build here; the
RMSNorms compute the torch references' values in every dtype (16-bit rounding as the
reference rounds; fp32 to the last bits), a row's result does not depend on the rows beside
it, the fused ops run them in mode ``cpu`` only where dtypes agree; the rotary embedding is
the torch path's bits; decode attention computes the reference's values over scattered
blocks and refuses what it cannot read; a failed build falls back to the torch code with one
warning. (The kernels inside the attention backend and RoPE layer: tests/attention,
tests/layers/test_rotary.py.)"""

from __future__ import annotations

import logging

import pytest
import torch

from tandem.layers import cpu_ops, fused_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:  # one rounding step apart at most, where the fp32 sums round across a 16-bit boundary
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        assert got.numel() == 0 or (got != want).float().mean() < 0.01


def test_the_kernels_build_on_this_machine():
    """CI has g++ and ninja: a fallback here would hide a broken build."""
    assert cpu_ops.available()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (3, 7, 64), (40, 100), (0, 32)])
def test_the_norms_compute_the_references_values(dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).to(dtype) * 3
    r = torch.randn(*shape, generator=g).to(dtype)
    w = torch.rand(shape[-1], generator=g).to(dtype) + 0.5
    _close(cpu_ops.rms_norm(x, w, EPS), fused_ops.rms_norm_ref(x, w, EPS))
    got, got_sum = cpu_ops.fused_add_rms_norm(x, r, w, EPS)
    want, want_sum = fused_ops.fused_add_rms_norm_ref(x, r, w, EPS)
    assert torch.equal(got_sum, want_sum)  # the residual sum rounds once, as x + residual does
    _close(got, want)


def test_a_strided_input_is_read_as_its_values():
    x = torch.randn(6, 128)[::2, ::2]  # neither rows nor the last dim contiguous
    w = torch.rand(64) + 0.5
    assert torch.equal(cpu_ops.rms_norm(x, w, EPS), cpu_ops.rms_norm(x.contiguous(), w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_bits_alone_or_among_others(dtype):
    """Rows are split over threads for a prompt and run inline at decode: no row's value may
    depend on that (a prompt's rows computed in another chunking, or a decode batch)."""
    x = torch.randn(37, 576).to(dtype)
    r = torch.randn(37, 576).to(dtype)
    w = (torch.rand(576) + 0.5).to(dtype)
    batch = cpu_ops.rms_norm(x, w, EPS)
    batch_add = cpu_ops.fused_add_rms_norm(x, r, w, EPS)[0]
    for i in (0, 16, 36):
        assert torch.equal(cpu_ops.rms_norm(x[i:i + 1], w, EPS), batch[i:i + 1])
        assert torch.equal(cpu_ops.fused_add_rms_norm(x[i:i + 1], r[i:i + 1], w, EPS)[0], batch_add[i:i + 1])


def test_bad_arguments_are_refused():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match=r"weight must be \[8\] of x's dtype"):
        cpu_ops.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), EPS)
    with pytest.raises(RuntimeError, match=r"weight must be \[8\]"):
        cpu_ops.rms_norm(x, torch.ones(4), EPS)
    with pytest.raises(RuntimeError, match="residual"):
        cpu_ops.fused_add_rms_norm(x, torch.randn(2, 4), torch.ones(8), EPS)


def test_the_fused_ops_run_the_kernels_in_mode_cpu_only_where_dtypes_agree():
    x = torch.randn(3, 64)
    w = torch.rand(64) + 0.5
    assert torch.equal(fused_ops.rms_norm(x, w, EPS, mode="cpu"), cpu_ops.rms_norm(x, w, EPS))
    r = torch.randn(3, 64)
    assert all(torch.equal(a, b) for a, b in zip(fused_ops.fused_add_rms_norm(x, r, w, EPS, mode="cpu"),
                                                 cpu_ops.fused_add_rms_norm(x, r, w, EPS)))
    # A bf16 input with an fp32 weight: the reference promotes, the kernel takes one dtype.
    xb = x.to(torch.bfloat16)
    assert torch.equal(fused_ops.rms_norm(xb, w, EPS, mode="cpu"), fused_ops.rms_norm_ref(xb, w, EPS))
    assert torch.equal(fused_ops.rms_norm(x, w, EPS, mode="torch"), fused_ops.rms_norm_ref(x, w, EPS))


def _decode_reference(q, kv_cache, tables, seq_lens, scale):
    """Per request and head in fp64: softmax(q k^T * scale) v over its first seq_len keys."""
    out = torch.empty(q.shape, dtype=torch.float64)
    bs, hk = kv_cache.shape[2], kv_cache.shape[3]
    for r in range(q.shape[0]):
        n = int(seq_lens[r])
        blocks = tables[r, : -(-n // bs)].long()
        k = kv_cache[0][blocks].flatten(0, 1)[:n].double().repeat_interleave(q.shape[1] // hk, 1)
        v = kv_cache[1][blocks].flatten(0, 1)[:n].double().repeat_interleave(q.shape[1] // hk, 1)
        s = torch.einsum("hd,khd->hk", q[r].double(), k) * scale
        out[r] = torch.einsum("hk,khd->hd", s.softmax(-1), v)
    return out


def _decode_case(dtype, seq_lens, hq=9, hk=3, d=64, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    per_req = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(per_req) + 3
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(per_req) + 2, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(per_req):
        tables[r, :nb] = perm[used:used + nb]
        used += nb
    kv_cache = (torch.randn(2, num_blocks, bs, hk, d, generator=g) * 2).to(dtype)
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(dtype)
    return q, kv_cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1), (6, 2)], ids=["gqa3", "mha", "mqa", "gqa3-d40"])
def test_decode_attention_computes_the_references_values(dtype, tol, heads):
    d = 40 if heads == (6, 2) else 64  # a head_dim that is not a multiple of the vector width
    seq_lens = [1, 16, 17, 255, 256, 257, 700]  # one split, split edges, three splits
    q, kv_cache, tables, lens = _decode_case(dtype, seq_lens, *heads, d=d)
    got = cpu_ops.paged_attention_decode(q, kv_cache, tables, lens, d**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), _decode_reference(q, kv_cache, tables, lens, d**-0.5),
                               atol=tol, rtol=tol)


def test_decode_attention_reads_only_the_leading_requests_rows():
    """Tables and lengths may have more rows than q (the step's prefill requests after its
    decodes), and q may be a strided view (q of the fused q/k/v projection)."""
    q, kv_cache, tables, lens = _decode_case(torch.float32, [30, 5, 90])
    qkv = torch.cat([q, torch.randn(3, 6, 64)], dim=1)
    got = cpu_ops.paged_attention_decode(qkv[:2, :9], kv_cache, tables, lens, 0.125)
    assert torch.equal(got, cpu_ops.paged_attention_decode(q[:2].contiguous(), kv_cache, tables[:2], lens[:2], 0.125))


def test_decode_attention_refuses_what_it_cannot_read():
    q, kv_cache, tables, lens = _decode_case(torch.float32, [20, 40])
    cases = [
        ((q, kv_cache, tables, torch.tensor([0, 40], dtype=torch.int32)), r"seq_lens\[0\] = 0 outside"),
        ((q, kv_cache, tables, torch.tensor([20, 10_000], dtype=torch.int32)), r"seq_lens\[1\] = 10000 outside"),
        ((q, kv_cache, tables.masked_fill(tables == tables[1, 0], 999), lens), r"block_tables\[1, 0\] = 999"),
        ((q, kv_cache.to(torch.bfloat16), tables, lens), "kv_cache dtype"),
        ((q, kv_cache, tables.long(), lens), "block_tables must be int32"),
        ((q, kv_cache, tables, lens.long()), "seq_lens must be int32"),
        ((q[:, :5], kv_cache, tables, lens), "does not fit kv_cache"),
        ((q, kv_cache[0], tables, lens), "kv_cache must be a contiguous"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            cpu_ops.paged_attention_decode(*args, 0.125)


def test_rotary_refuses_positions_outside_its_tables():
    x = torch.randn(2, 3, 8)
    cos = sin = torch.zeros(10, 4)
    with pytest.raises(RuntimeError, match=r"position 10 outside \[0, 10\)"):
        cpu_ops.rotary_embedding_neox(torch.tensor([0, 10]), x, cos, sin)
    with pytest.raises(RuntimeError, match="positions must be"):
        cpu_ops.rotary_embedding_neox(torch.tensor([0, 1], dtype=torch.int32), x, cos, sin)
    with pytest.raises(RuntimeError, match="cos and sin must be float32"):
        cpu_ops.rotary_embedding_neox(torch.tensor([0, 1]), x, cos.double(), sin)


def test_a_failed_build_falls_back_to_the_torch_code_with_one_warning(monkeypatch, caplog):
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions\nmore detail")

    monkeypatch.setattr(cpu_ops, "_loaded", None)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="tandem.layers.cpu_ops"):
        assert not cpu_ops.available() and not cpu_ops.available()
        assert fused_ops.resolve_mode("auto", torch.device("cpu")) == "torch"
        # Asked for by name, it is the user's setting that cannot be met: one line on the command line.
        with pytest.raises(ValueError, match="TANDEM_FUSED_OPS=cpu, but the C\\+\\+ CPU kernels could not be built"):
            fused_ops.resolve_mode("cpu", torch.device("cpu"))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "Ninja is required" in warnings[0] and "more detail" not in warnings[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3072), (5, 2, 96), (40, 18), (0, 8)])
def test_silu_and_mul_computes_the_references_values(dtype, shape):
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    got, want = cpu_ops.silu_and_mul(x), fused_ops.silu_and_mul_ref(x)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:  # the exp polynomial against libm's
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:
        _close(got, want)
    strided = x.transpose(0, -1).contiguous().transpose(0, -1) if x.dim() == 2 else x
    assert torch.equal(cpu_ops.silu_and_mul(strided), got)
    assert torch.equal(fused_ops.silu_and_mul(x, mode="cpu"), got)


def test_silu_and_mul_refuses_an_odd_last_dim():
    with pytest.raises(RuntimeError, match="last dim must be even"):
        cpu_ops.silu_and_mul(torch.randn(2, 7))
