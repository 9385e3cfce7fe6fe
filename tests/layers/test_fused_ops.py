"""Fused Triton ops (RMSNorm, add + RMSNorm, SiLU-and-mul, RoPE, the FP8-quantizing norm
and SiLU-and-mul) vs their torch references, and a whole tiny model built with the fused ops
forced on vs the same model built on the torch path, in bf16/fp32 and in FP8 with the
quantization fused or not; models built in different modes keep their own.

Without CUDA the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` is set here,
before any kernel is decorated: :mod:`tandem.layers.fused_ops` jits them on first use).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.triton_interpreter import triton_test_setup

# bf16 / e4m3 rounding: the interpreter truncates fp32 -> bf16 and mis-rounds fp32 -> e4m3;
# GPUs round to nearest even.
DEVICE, INTERPRET = triton_test_setup(bf16_rounding=True, fp8_rounding=True)

from transformers import LlamaConfig, Qwen3Config  # noqa: E402

from tests.models.paged_parity import step_metadata  # noqa: E402
from tandem.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from tandem.layers import fused_ops  # noqa: E402
from tandem.layers.linear import ColumnShardedLinear, RowParallelLinear  # noqa: E402
from tandem.layers.quantization.apply import finish_fp8_model  # noqa: E402
from tandem.layers.quantization.config import Fp8Config  # noqa: E402
from tandem.layers.quantization.fp8 import FP8_DTYPE, MIN_SCALE, UnscaledProduct, quantize_per_token  # noqa: E402
from tandem.layers.rotary import RotaryEmbedding  # noqa: E402
from tandem.models.llama import LlamaForCausalLM  # noqa: E402

fused_ops._kernel.cache_clear()  # jit again now that TRITON_INTERPRET is settled
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def _rand(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("t", [0, 1, 7, 256])
def test_rms_norm(t, hidden, dtype):
    x = _rand(t, hidden, dtype=dtype) * 3
    w = _rand(hidden, dtype=dtype, seed=1)
    _close(fused_ops.rms_norm(x, w, 1e-6, mode="triton"), fused_ops.rms_norm_ref(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_16_bit_rms_norm_is_the_fp32_formula_rounded_once(dtype):
    # rms_norm_ref's one-op CPU path relies on it: transformers' order, the same bits.
    g = torch.Generator().manual_seed(0)
    for hidden in (64, 576, 1536):
        for t in (1, 5, 128):
            for scale in (0.01, 1.0, 30.0):
                x = (torch.randn(t, hidden, generator=g) * scale).to(dtype)
                w = torch.randn(hidden, generator=g).to(dtype)
                want = w * torch.nn.functional.rms_norm(x.float(), (hidden,), eps=1e-6).to(dtype)
                assert torch.equal(fused_ops.rms_norm_ref(x, w, 1e-6), want), (hidden, t, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("t", [0, 1, 7, 256])
def test_fused_add_rms_norm(t, hidden, dtype):
    x = _rand(t, hidden, dtype=dtype)
    res = _rand(t, hidden, dtype=dtype, seed=1) * 4
    w = _rand(hidden, dtype=dtype, seed=2)
    out, new_res = fused_ops.fused_add_rms_norm(x, res, w, 1e-5, mode="triton")
    want_out, want_res = fused_ops.fused_add_rms_norm_ref(x, res, w, 1e-5)
    torch.testing.assert_close(new_res, want_res, atol=0, rtol=0)  # same single rounding as ``x + res``
    _close(out, want_out, dtype)
    if t:
        assert new_res.data_ptr() not in (x.data_ptr(), res.data_ptr())  # out of place


def test_rms_norm_strided_heads_and_dtypes():
    """Per-head norm (Qwen3 q/k norm) on a [T, H, D] view of a fused projection; fp16;
    fp32 weight with a bf16 input (the result promotes, as ``weight * x`` does)."""
    qkv = _rand(5, 9 * 64 + 2 * 3 * 64, dtype=torch.float32)
    q = qkv[:, : 9 * 64].view(5, 9, 64)
    w = _rand(64, dtype=torch.float32, seed=3)
    _close(fused_ops.rms_norm(q, w, 1e-6, mode="triton"), fused_ops.rms_norm_ref(q, w, 1e-6), torch.float32)
    x16 = _rand(7, 576, dtype=torch.float16)
    w16 = _rand(576, dtype=torch.float16, seed=4)
    _close(fused_ops.rms_norm(x16, w16, 1e-6, mode="triton"), fused_ops.rms_norm_ref(x16, w16, 1e-6), torch.float16)
    xb = _rand(7, 64, dtype=torch.bfloat16)
    wf = _rand(64, dtype=torch.float32, seed=5)
    _close(fused_ops.rms_norm(xb, wf, 1e-6, mode="triton"), fused_ops.rms_norm_ref(xb, wf, 1e-6), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 576, 1536])
@pytest.mark.parametrize("t", [0, 1, 7, 256])
def test_silu_and_mul(t, inter, dtype):
    if t == 256 and inter == 1536 and INTERPRET:
        t = 31
    x = _rand(t, 2 * inter, dtype=dtype) * 3
    _close(fused_ops.silu_and_mul(x, mode="triton"), fused_ops.silu_and_mul_ref(x), dtype)


def _same_fp8(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
              scale_ulps: int = 0) -> None:
    """Equal FP8 values (bytes) and scales, bit for bit (scales within ``scale_ulps`` fp32
    ulps where the two sides come from differently compiled row reductions)."""
    (q, s), (wq, ws) = got, want
    assert q.dtype == FP8_DTYPE and q.shape == wq.shape and s.dtype == torch.float32 and s.shape == ws.shape
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8))
    ulps = (s.view(torch.int32).long() - ws.view(torch.int32).long()).abs()
    assert (ulps <= scale_ulps).all(), ulps.max()


def _near_fp8(q: torch.Tensor, s: torch.Tensor, want: torch.Tensor, dtype) -> None:
    """``q * s`` within e4m3's rounding (half a step: 2^-4 relative, 2^-10 of the scale in
    the subnormal range) plus the op's own tolerance of the unquantized reference ``want``."""
    err = (q.float() * s - want.float()).abs()
    bound = want.float().abs() * (2**-4 + TOL[dtype]) + s * 2**-9 + TOL[dtype]
    assert (err <= bound).all(), (err - bound).max()


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100, 576])
@pytest.mark.parametrize("t", [0, 1, 7, 64])
def test_rms_norm_dynamic_per_token_quant(t, hidden, dtype, residual):
    x = _rand(t, hidden, dtype=dtype) * 3
    x[t // 2:t // 2 + 1] = 0  # an all-zero row (without residual): the minimum scale
    res = _rand(t, hidden, dtype=dtype, seed=1) * 4 if residual else None
    w = _rand(hidden, dtype=dtype, seed=2)
    q, s, new_res = fused_ops.rms_norm_dynamic_per_token_quant(x, w, 1e-6, res, mode="triton")
    # Fused == the unfused kernels (norm in the activation dtype, then quantize_per_token).
    if residual:
        out, want_res = fused_ops.fused_add_rms_norm(x, res, w, 1e-6, mode="triton")
        torch.testing.assert_close(new_res, want_res, atol=0, rtol=0)
        torch.testing.assert_close(new_res, x + res, atol=0, rtol=0)
    else:
        out = fused_ops.rms_norm(x, w, 1e-6, mode="triton")
        assert new_res is None
    # An fp32 row wider than one warp's share is summed across warps, and the fused and the
    # plain norm kernel are compiled separately: on the H200 their fp32 outputs (so the amax)
    # differed by up to 2 ulps at hidden 576 (session 11). 16-bit outputs round that away.
    ulps = 4 if dtype == torch.float32 and DEVICE.type == "cuda" and hidden > 512 else 0
    _same_fp8((q, s), quantize_per_token(out), scale_ulps=ulps)
    # And the torch reference (the CPU path) within the norm's tolerance and e4m3's rounding.
    wq, ws, _ = fused_ops.rms_norm_dynamic_per_token_quant_ref(x, w, 1e-6, res)
    assert ws.shape == s.shape == (t, 1)
    torch.testing.assert_close(s, ws, atol=0, rtol=TOL[dtype])
    _near_fp8(q, s, fused_ops.rms_norm_ref(x if res is None else x + res, w, 1e-6), dtype)
    if t and not residual:
        assert s[t // 2].item() == pytest.approx(MIN_SCALE) and (q[t // 2].float() == 0).all()


def _unscaled(t: int, n: int, dtype: torch.dtype) -> UnscaledProduct:
    """Sums of FP8 products (large, as unit-scale GEMMs give) with small per-token and
    per-channel scales."""
    acc = _rand(t, n, dtype=torch.float32) * 3e4
    row = (_rand(t, 1, dtype=torch.float32, seed=3).abs() + 0.1) * 1e-3
    col = (_rand(n, dtype=torch.float32, seed=4).abs() + 0.1) * 1e-2
    return UnscaledProduct(acc, row, col, dtype)


@pytest.mark.parametrize("op", ["rms_norm", "add", "quant", "add_quant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t", [0, 1, 7, 64])
def test_norms_apply_the_scales_of_an_unscaled_product(t, dtype, op):
    """A norm fed an UnscaledProduct gives what it gives for ``x.apply_scales()``, bit for
    bit, in the kernel and in the torch path (compiled fp32: the scaling and the residual
    add may contract into one FMA, so within an ulp there)."""
    x = _unscaled(t, 96, dtype)
    res = _rand(t, 96, dtype=dtype, seed=1) * 4
    w = _rand(96, dtype=dtype, seed=2)

    def run(inp, mode):
        if op == "rms_norm":
            return (fused_ops.rms_norm(inp, w, 1e-6, mode=mode),)
        if op == "add":
            return fused_ops.fused_add_rms_norm(inp, res, w, 1e-6, mode=mode)
        return fused_ops.rms_norm_dynamic_per_token_quant(inp, w, 1e-6, res if op == "add_quant" else None, mode=mode)

    for mode in ("triton", "torch"):
        got, want = run(x, mode), run(x.apply_scales(), mode)
        fma = mode == "triton" and dtype == torch.float32 and DEVICE.type == "cuda"
        for g, e in zip(got, want):
            assert (g is None) == (e is None)
            if g is None:
                continue
            assert g.dtype == e.dtype
            if fma and g.dtype == FP8_DTYPE:  # an ulp in the scale may move a value one e4m3 step
                torch.testing.assert_close(g.float(), e.float(), atol=2 ** -9, rtol=2 ** -3)
            elif fma:  # an ulp of the product, relative to the row after cancellation in the add
                torch.testing.assert_close(g, e, atol=1e-6 * e.abs().amax().item() if e.numel() else 0.0, rtol=1e-6)
            else:
                assert torch.equal(g.view(torch.uint8) if g.dtype == FP8_DTYPE else g,
                                   e.view(torch.uint8) if e.dtype == FP8_DTYPE else e)


def test_norms_reject_a_malformed_unscaled_product():
    x = _unscaled(4, 32, torch.bfloat16)
    w = _rand(32, dtype=torch.bfloat16, seed=2)
    for bad in (UnscaledProduct(x.acc.to(torch.bfloat16), x.row_scale, x.col_scale, x.dtype),
                UnscaledProduct(x.acc, x.row_scale[:3], x.col_scale, x.dtype),
                UnscaledProduct(x.acc, x.row_scale, x.col_scale[:16], x.dtype)):
        with pytest.raises(ValueError, match="UnscaledProduct"):
            fused_ops.rms_norm(bad, w, 1e-6, mode="triton")


def test_rms_norm_dynamic_per_token_quant_strided_and_promoted():
    """Rows of a wider tensor (leading stride != N); a bf16 input with an fp32 weight: the
    unfused output is fp32, so the fused kernel quantizes the fp32 values."""
    big = _rand(9, 200, dtype=torch.bfloat16)
    x = big[:, :128]
    w = _rand(128, dtype=torch.bfloat16, seed=1)
    _same_fp8(fused_ops.rms_norm_dynamic_per_token_quant(x, w, 1e-5, mode="triton")[:2],
              quantize_per_token(fused_ops.rms_norm(x, w, 1e-5, mode="triton")))
    wf = _rand(128, dtype=torch.float32, seed=2)
    assert fused_ops.rms_norm(x, wf, 1e-5, mode="triton").dtype == torch.float32
    _same_fp8(fused_ops.rms_norm_dynamic_per_token_quant(x, wf, 1e-5, mode="triton")[:2],
              quantize_per_token(fused_ops.rms_norm(x, wf, 1e-5, mode="triton")))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 100, 1536])
@pytest.mark.parametrize("t", [0, 1, 7, 64])
def test_silu_and_mul_dynamic_per_token_quant(t, inter, dtype):
    x = _rand(t, 2 * inter, dtype=dtype) * 3
    if t > 1:
        x[1, inter:] = 0  # up == 0: an all-zero row
    q, s = fused_ops.silu_and_mul_dynamic_per_token_quant(x, mode="triton")
    _same_fp8((q, s), quantize_per_token(fused_ops.silu_and_mul(x, mode="triton")))
    _, ws = fused_ops.silu_and_mul_dynamic_per_token_quant_ref(x)
    torch.testing.assert_close(s, ws, atol=0, rtol=TOL[dtype])
    _near_fp8(q, s, fused_ops.silu_and_mul_ref(x), dtype)
    if t > 1:
        assert s[1].item() == pytest.approx(MIN_SCALE) and (q[1].float() == 0).all()


def test_fp8_quant_ops_reject_what_the_kernels_cannot_do():
    x = _rand(64, 8, dtype=torch.float32).t()  # last-dim stride 8
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        fused_ops.rms_norm_dynamic_per_token_quant(x, _rand(64, dtype=torch.float32), 1e-6, mode="triton")
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        fused_ops.silu_and_mul_dynamic_per_token_quant(x, mode="triton")
    with pytest.raises(ValueError, match="odd"):
        fused_ops.silu_and_mul_dynamic_per_token_quant(_rand(2, 7, dtype=torch.float32), mode="triton")


def _rope_tables(head_dim, max_pos=512, scaled=False):
    kw = dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64}) if scaled else {}
    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=max_pos, **kw)
    rot = RotaryEmbedding(cfg, head_dim, max_pos)
    return rot.cos.to(DEVICE), rot.sin.to(DEVICE)


ROPE_SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(ROPE_SHAPES))
@pytest.mark.parametrize("t", [0, 1, 7, 256])
def test_apply_rotary(t, shape, dtype):
    hq, hk, d = ROPE_SHAPES[shape]
    if shape == "llama8b" and t == 256:
        t = 16  # small T for the big heads
    cos, sin = _rope_tables(d, scaled=shape == "llama8b")
    # q/k as views of a fused qkv projection output (strided rows), like the model's.
    qkv = _rand(t, (hq + 2 * hk) * d, dtype=dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    pos = torch.randint(0, cos.shape[0], (t,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want_q, want_k = fused_ops.apply_rotary_ref(q, k, cos, sin, pos)
    got_q, got_k = fused_ops.apply_rotary(q, k, cos, sin, pos, mode="triton")
    assert got_q.is_contiguous() and got_k.is_contiguous()
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)
    # In place: writes through the views, leaves v alone.
    v_before = qkv[:, (hq + hk) * d :].clone()
    rq, rk = fused_ops.apply_rotary(q, k, cos, sin, pos.to(torch.int32), inplace=True, mode="triton")
    assert rq.data_ptr() == q.data_ptr() and rk.data_ptr() == k.data_ptr()
    _close(q, want_q, dtype)
    _close(k, want_k, dtype)
    torch.testing.assert_close(qkv[:, (hq + hk) * d :], v_before, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [0, 1, 9])
def test_apply_rotary_interleaved_deepseek_layout(t, dtype):
    """DeepSeek-V2 MLA: q_pe [T, 16, 64] a strided view of the query projection, k_pe
    [T, 1, 64] a strided view of the latent projection; adjacent pairs rotated."""
    heads, nope, rope, lora = 16, 128, 64, 512
    cos, sin = _rope_tables(rope)
    q = _rand(t, heads, nope + rope, dtype=dtype)
    q_pe = q[..., nope:]
    kv = _rand(t, lora + rope, dtype=dtype, seed=1)
    k_pe = kv[:, None, lora:]
    pos = torch.randint(0, cos.shape[0], (t,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    # The reference is transformers' DeepSeek-V2 rotation of (x[2i], x[2i+1]) pairs.
    c, s_ = cos[pos][:, None], sin[pos][:, None]
    want_q = torch.view_as_real(torch.view_as_complex(q_pe.float().unflatten(-1, (-1, 2)).contiguous())
                                * torch.complex(c, s_)).flatten(-2).to(dtype)
    want_k = torch.view_as_real(torch.view_as_complex(k_pe.float().unflatten(-1, (-1, 2)).contiguous())
                                * torch.complex(c, s_)).flatten(-2).to(dtype)
    got_q, got_k = fused_ops.apply_rotary(q_pe, k_pe, cos, sin, pos, interleaved=True, mode="triton")
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)
    nope_before = q[..., :nope].clone()
    fused_ops.apply_rotary(q_pe, k_pe, cos, sin, pos, inplace=True, interleaved=True, mode="triton")
    _close(q_pe, want_q, dtype)
    _close(k_pe, want_k, dtype)
    torch.testing.assert_close(q[..., :nope], nope_before, atol=0, rtol=0)
    # The NeoX layout rotates other pairs: the flag matters.
    if t:
        neox_q, _ = fused_ops.apply_rotary(q_pe.clone(), k_pe.clone(), cos, sin, pos, mode="triton")
        assert not torch.allclose(neox_q.float(), fused_ops.apply_rotary(q_pe.clone(), k_pe.clone(), cos, sin, pos,
                                                                         interleaved=True, mode="triton")[0].float())


def test_rotary_module_matches_reference():
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=512)
    rots = {}
    for mode in ("triton", "torch"):
        with fused_ops.building(mode):
            rots[mode] = RotaryEmbedding(cfg, 64, 512).to(DEVICE)
    q, k = _rand(7, 9, 64, dtype=torch.float32), _rand(7, 3, 64, dtype=torch.float32, seed=1)
    pos = torch.tensor([0, 5, 511, 3, 3, 100, 7], device=DEVICE)
    got = rots["triton"](pos, q, k)
    want = rots["torch"](pos, q, k)
    for g, w in zip(got, want):
        _close(g, w, torch.float32)


def test_non_contiguous_last_dim_is_rejected():
    x = _rand(64, 8, dtype=torch.float32).t()  # [8, 64], last-dim stride 8
    w = _rand(64, dtype=torch.float32)
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        fused_ops.rms_norm(x, w, 1e-6, mode="triton")
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        fused_ops.fused_add_rms_norm(x, x, w, 1e-6, mode="triton")
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        fused_ops.silu_and_mul(x, mode="triton")
    q = _rand(4, 64, 2, dtype=torch.float32).transpose(1, 2)  # [4, 2, 64], last-dim stride 2
    cos, sin = _rope_tables(64)
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        fused_ops.apply_rotary(q, q, cos, sin, torch.zeros(4, dtype=torch.long, device=DEVICE), mode="triton")


def test_dispatch():
    x = torch.randn(2, 8)
    assert fused_ops.use_triton(x, "auto") is False  # CPU tensors: torch reference
    if torch.cuda.is_available():
        assert fused_ops.use_triton(x.cuda(), "auto") is True
        assert fused_ops.use_triton(x.cuda(), "torch") is False
    assert fused_ops.use_triton(x, "torch") is False
    assert fused_ops.use_triton(x, "triton") is True
    with pytest.raises(ValueError, match="fast"):
        fused_ops.use_triton(x, "fast")
    with pytest.raises(ValueError, match="fast"):
        fused_ops.rms_norm(x, x[0], 1e-6, mode="fast")
    with pytest.raises(ValueError, match="fast"):
        fused_ops.resolve_mode("fast", x.device)
    with pytest.raises(ValueError, match="fast"), fused_ops.building("fast"):
        pass


def test_auto_resolves_once_per_device_as_it_dispatches_per_tensor():
    """The worker's decision (resolve_mode) is what ``auto`` does for a tensor there."""
    cpu = torch.device("cpu")
    assert fused_ops.resolve_mode("auto", cpu) == "cpu"  # the C++ norms build here (tests/layers/test_cpu_ops.py)
    assert fused_ops.resolve_mode("auto", torch.device("cuda", 0)) == ("triton" if fused_ops.HAS_TRITON else "torch")
    for m in ("triton", "torch", "cpu"):
        assert fused_ops.resolve_mode(m, cpu) == m
    with pytest.raises(ValueError, match="'cpu' .* is for CPU models, not cuda"):
        fused_ops.resolve_mode("cpu", torch.device("cuda", 0))


def test_a_build_block_sets_the_mode_of_the_layers_built_in_it():
    cfg = LlamaConfig(**COMMON)
    assert fused_ops.build_mode() == "auto"  # outside any block
    with fused_ops.building("torch"):
        with fused_ops.building("triton"):  # blocks nest
            inner = RotaryEmbedding(cfg, 16, 64)
        outer = RotaryEmbedding(cfg, 16, 64)
        assert fused_ops.build_mode() == "torch"
    assert fused_ops.build_mode() == "auto"
    assert (inner.fused_ops_mode, outer.fused_ops_mode) == ("triton", "torch")
    assert RotaryEmbedding(cfg, 16, 64).fused_ops_mode == "auto"


# Compiles the kernels for sm_90 (Triton's bundled ptxas, no GPU needed) as a launch on
# 16-byte aligned tensors specializes them: the FP8 norm and SiLU-and-mul at the
# Llama-3.1-8B sizes; the quantizing divisions must be IEEE (div.rn), the conversion
# cvt.rn.satfinite (round to nearest even, saturating), as torch's quantize_per_token.
_COMPILE_SM90 = textwrap.dedent("""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tandem.layers import fused_ops
    from tandem.layers.quantization.fp8_format import FP8_MAX, MIN_SCALE

    def build(name, sig, const, warps):
        kernel = fused_ops._kernel(name)
        names = kernel.arg_names
        sig = {n: "constexpr" if n in const else sig[n] for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
        src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm["ptx"]
        ops = {line.split()[0] for line in ptx.splitlines() if line.strip()}
        assert "div.rn.f32" in ops and "cvt.rn.satfinite.e4m3x2.f32" in ops, (name, sorted(ops))
        print("compiled", name)

    for act, dtype in (("bf16", tl.bfloat16), ("fp16", tl.float16), ("fp32", tl.float32)):
        # (residual, x an UnscaledProduct's fp32 sums)
        for residual, scaled in ((False, False), (True, False), (True, True)):
            sig = dict(x_ptr="*" + ("fp32" if scaled else act), res_ptr="*" + act, w_ptr="*" + act,
                       out_ptr="*fp8e4nv", res_out_ptr="*" + act, scale_ptr="*fp32", x_row_scale_ptr="*fp32",
                       x_col_scale_ptr="*fp32", B="i32", stride_xa="i32", stride_xb="i32", stride_ra="i32",
                       stride_rb="i32", N="i32", eps="fp32")
            build("_rms_norm_kernel", sig, dict(HAS_RESIDUAL=residual, SCALED_X=scaled, X_DTYPE=dtype, FP8_OUT=True,
                                                OUT_DTYPE=dtype, FMAX=FP8_MAX, MIN_S=MIN_SCALE, BLOCK_N=4096),
                  fused_ops._num_warps(4096))
        sig = dict(x_ptr="*" + act, q_ptr="*fp8e4nv", scale_ptr="*fp32", stride_x="i32", I="i32")
        build("_silu_and_mul_quant_kernel", sig, dict(OUT_DTYPE=dtype, FMAX=FP8_MAX, MIN_S=MIN_SCALE, BLOCK=16384),
              fused_ops._num_warps(16384))
""")


def test_fp8_kernels_compile_for_sm90():
    """The interpreter accepts what the compiler may not: compile the FP8 kernels for an
    H100/H200 in a process without the interpreter."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.count("compiled") == 12


@pytest.mark.skipif(INTERPRET, reason="Llama-3.1-8B sizes: compiled CUDA only")
@pytest.mark.parametrize("t", [1, 7, 256])
def test_cuda_fp8_quant_ops_equal_the_unfused_kernels(t):
    """At Llama-3.1-8B's sizes on the GPU: fused == norm / SiLU-and-mul kernel + the
    per-token quantization kernel == torch's quantize_per_token, bit for bit."""
    from tandem.layers.quantization.fp8_triton import quantize_per_token_triton

    x = _rand(t, 4096, dtype=torch.bfloat16) * 3
    res = _rand(t, 4096, dtype=torch.bfloat16, seed=1) * 30
    w = _rand(4096, dtype=torch.bfloat16, seed=2)
    out, _ = fused_ops.fused_add_rms_norm(x, res, w, 1e-5, mode="triton")
    q, s, _ = fused_ops.rms_norm_dynamic_per_token_quant(x, w, 1e-5, res, mode="triton")
    _same_fp8((q, s), quantize_per_token(out))
    _same_fp8((q, s), quantize_per_token_triton(out))
    gate_up = _rand(t, 2 * 14336, dtype=torch.bfloat16, seed=3) * 4
    h = fused_ops.silu_and_mul(gate_up, mode="triton")
    q, s = fused_ops.silu_and_mul_dynamic_per_token_quant(gate_up, mode="triton")
    _same_fp8((q, s), quantize_per_token(h))
    _same_fp8((q, s), quantize_per_token_triton(h))


# ---------------------------------------------------------------- whole model

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def _meta(q_lens, computed, block_tables, block_size):
    return step_metadata(q_lens, computed, block_tables, block_size, DEVICE)


def _run(model, cfg, dtype):
    """A prefill of 3 prompts then 2 decode steps; the logits of every step."""
    bs = 8
    kv = [torch.zeros(2, 32, bs, cfg.num_key_value_heads, model.spec.head_dim, dtype=dtype, device=DEVICE)
          for _ in range(cfg.num_hidden_layers)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (13, 8, 21)]
    tables = [list(range(1, 5)), list(range(5, 9)), list(range(9, 13))]
    ids = torch.tensor([t for p in prompts for t in p], device=DEVICE)
    pos = torch.cat([torch.arange(len(p)) for p in prompts]).to(DEVICE)
    out = [model.compute_logits(model(ids, pos, kv, _meta([len(p) for p in prompts], [0, 0, 0], tables, bs)))]
    lens = [len(p) for p in prompts]
    for step in range(2):
        ids = torch.randint(0, cfg.vocab_size, (3,), generator=g).to(DEVICE)
        meta = _meta([1, 1, 1], lens, tables, bs)
        out.append(model.compute_logits(model(ids, torch.tensor(lens, device=DEVICE), kv, meta)))
        lens = [n + 1 for n in lens]
    return torch.cat(out)


def _tiny(name: str, dtype: torch.dtype, mode: str) -> tuple[LlamaForCausalLM, LlamaConfig]:
    """The tiny Llama (or Qwen3) built in fused-ops ``mode``, random weights the same in
    every mode."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**COMMON) if name == "llama" else Qwen3Config(**COMMON, head_dim=32)
    with fused_ops.building(mode):
        model = LlamaForCausalLM(cfg, TorchAttentionBackend())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model.to(device=DEVICE, dtype=dtype).eval(), cfg


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name,dtype,tol", [("llama", torch.float32, 1e-4), ("qwen3", torch.float32, 1e-4),
                                            ("llama", torch.bfloat16, 5e-2)])
def test_model_fused_matches_unfused(name, dtype, tol):
    model, cfg = _tiny(name, dtype, "triton")
    unfused, _ = _tiny(name, dtype, "torch")
    assert _same_weights(model, unfused)
    with torch.no_grad():
        fused = _run(model, cfg, dtype)
        ref = _run(unfused, cfg, dtype)
    torch.testing.assert_close(fused, ref, atol=tol, rtol=0)


def test_models_built_in_different_modes_keep_their_own(monkeypatch):
    """Two models of one process, one built on the kernels and one on the torch code, run
    interleaved: each forward launches the kernels of its own model's mode only (before: one
    process-wide mode, read at every call)."""
    models = {mode: _tiny("llama", torch.float32, mode) for mode in ("triton", "torch")}
    for mode, (model, _) in models.items():
        assert {m.fused_ops_mode for m in model.modules() if hasattr(m, "fused_ops_mode")} == {mode}
    launched: list[str] = []
    kernel = fused_ops._kernel
    monkeypatch.setattr(fused_ops, "_kernel", lambda name: launched.append(name) or kernel(name))
    seen: dict[str, set[str]] = {}
    with torch.no_grad():
        for mode in ("triton", "torch", "triton", "torch"):
            launched.clear()
            model, cfg = models[mode]
            _run(model, cfg, torch.float32)
            seen.setdefault(mode, set()).update(launched)
    assert seen == {"triton": {"_rms_norm_kernel", "_silu_and_mul_kernel", "_rope_kernel"}, "torch": set()}


def _fp8_llama(monkeypatch, fused: str, deferred_rows: str = "256", mode: str = "triton"):
    """The tiny Llama in bf16 built in fused-ops ``mode``, its linear layers quantized
    online (``--quantization fp8``) with the norm / SiLU-and-mul quantization fused or not
    (``TANDEM_FP8_FUSED_QUANT``), and the scales of o_proj / down_proj deferred to the norms
    up to ``deferred_rows`` rows; the same weights in every mode."""
    monkeypatch.setenv("TANDEM_FP8_FUSED_QUANT", fused)
    monkeypatch.setenv("TANDEM_FP8_DEFERRED_SCALES_MAX_ROWS", deferred_rows)
    model, cfg = _tiny("llama", torch.bfloat16, mode)
    finish_fp8_model(model, Fp8Config(), torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, (ColumnShardedLinear, RowParallelLinear))]
    assert linears and all(m.weight.dtype == FP8_DTYPE for m in linears)
    assert all(m.takes_quantized_input == (fused == "on") for m in linears)
    return model, cfg


def test_fp8_model_fused_quant_matches_unfused(monkeypatch):
    """FP8 Llama: the quantization fused into the norm and SiLU-and-mul kernels gives the
    logits of the separate quantization, bit for bit (the same FP8 inputs reach the same
    GEMMs), in a prefill and two decode steps; and the torch reference path too."""
    fused, cfg = _fp8_llama(monkeypatch, "on")
    unfused, _ = _fp8_llama(monkeypatch, "off")
    fused_ref, _ = _fp8_llama(monkeypatch, "on", mode="torch")
    unfused_ref, _ = _fp8_llama(monkeypatch, "off", mode="torch")
    assert _same_weights(fused, fused_ref) and _same_weights(unfused, unfused_ref)
    with torch.no_grad():
        got = _run(fused, cfg, torch.bfloat16)
        want = _run(unfused, cfg, torch.bfloat16)
        ref = _run(fused_ref, cfg, torch.bfloat16)
        ref_unfused = _run(unfused_ref, cfg, torch.bfloat16)
    assert torch.equal(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.equal(ref, ref_unfused)
    # The Triton path against the torch one: the bf16 tolerance of the unquantized model.
    torch.testing.assert_close(got, ref, atol=5e-2, rtol=0)


def test_fp8_model_deferred_scales_match_the_scaled_gemms(monkeypatch):
    """FP8 Llama whose o_proj / down_proj leave their scales to the following norms (in
    every step here: at most 42 rows) vs the same model with the scaled GEMMs: the same
    logits up to the order of the two fp32 scalings (a bf16 ulp in a few activations), in
    the kernels and in the torch path; only o_proj and down_proj defer."""
    for mode in ("triton", "torch"):
        deferred, cfg = _fp8_llama(monkeypatch, "on", mode=mode)
        scaled, _ = _fp8_llama(monkeypatch, "on", deferred_rows="0", mode=mode)
        layer = deferred.layers[0]
        assert layer.self_attn.o_proj.deferred_scales_max_rows == layer.mlp.down_proj.deferred_scales_max_rows == 256
        assert not hasattr(layer.self_attn.qkv_proj, "deferred_scales_max_rows")
        assert all(m.deferred_scales_max_rows == 0 for m in scaled.modules() if isinstance(m, RowParallelLinear))
        with torch.no_grad():
            got, want = _run(deferred, cfg, torch.bfloat16), _run(scaled, cfg, torch.bfloat16)
        torch.testing.assert_close(got, want, atol=5e-2, rtol=0)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
