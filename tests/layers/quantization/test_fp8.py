"""FP8 math: scales, round-trip error bounds, and the GEMMs (torch's CPU ``_scaled_mm``
against a float reference); the device requirement."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.quantization import fp8
from tandem.layers.quantization.fp8 import (FP8_DTYPE, FP8_MAX, MIN_SCALE, QuantizedActivation, block_fp8_linear,
                                            block_fp8_matmul_reference, check_fp8_supported, dequantize_block,
                                            dequantize_weight, fp8_linear, fp8_linear_takes_quantized_input,
                                            quantize_per_token,
                                            quantize_per_token_group, quantize_static, quantize_weight_per_channel)

# e4m3: 3 mantissa bits, so rounding to nearest is within 2^-4 of a normal value; values
# below the smallest normal (2^-6) round on the subnormal grid of 2^-9 (half: 2^-10).
REL, SUBNORMAL_HALF_STEP = 2.0**-4, 2.0**-10


def _within_fp8_rounding(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> bool:
    err = (q.float() * scale - x).abs()
    return bool((err <= x.abs() * REL + scale * SUBNORMAL_HALF_STEP).all())


def test_per_token_scales_and_round_trip():
    x = torch.randn(17, 96) * torch.logspace(-3, 3, 17)[:, None]
    x[3] = 0.0
    q, s = quantize_per_token(x)
    assert q.dtype == FP8_DTYPE and s.shape == (17, 1) and s.dtype == torch.float32
    assert torch.allclose(s[:, 0], (x.abs().amax(1) / FP8_MAX).clamp(min=MIN_SCALE))
    assert _within_fp8_rounding(x, q, s)
    # The largest magnitude of each row maps to +-448 exactly; a zero row to zeros.
    assert torch.equal(q.float().abs().amax(1)[torch.arange(17) != 3], torch.full((16,), FP8_MAX))
    assert torch.equal(q[3].float(), torch.zeros(96))


def test_per_channel_weight_quantization():
    w = torch.randn(3, 40, 64) * 0.02
    q, s = quantize_weight_per_channel(w)
    assert q.shape == w.shape and s.shape == (3, 40)
    assert _within_fp8_rounding(w, q, s[..., None])
    assert torch.equal(dequantize_weight(q, s, None, torch.float32), q.float() * s[..., None])


def test_static_quantization_saturates():
    x = torch.tensor([[-1000.0, -1.0, 0.0, 0.5, 1000.0]])
    q = quantize_static(x, torch.tensor(0.5))
    assert q.float().tolist() == [[-FP8_MAX, -2.0, 0.0, 1.0, FP8_MAX]]


def test_per_token_group_quantization():
    x = torch.randn(5, 256)
    x[:, 128:] *= 100
    q, s = quantize_per_token_group(x, 128)
    assert s.shape == (5, 2)
    assert _within_fp8_rounding(x, q, s.repeat_interleave(128, 1))
    with pytest.raises(ValueError, match="multiple of the group"):
        quantize_per_token_group(torch.randn(2, 100), 128)


def test_block_dequantization_uses_each_blocks_scale():
    q = torch.ones(200, 300).to(FP8_DTYPE)
    scale = torch.arange(6, dtype=torch.float32).reshape(2, 3)  # ceil(200/128) x ceil(300/128)
    d = dequantize_block(q, scale, (128, 128))
    assert d[0, 0] == 0 and d[127, 255] == 1 and d[128, 0] == 3 and d[199, 299] == 5 and d[130, 130] == 4


@pytest.mark.parametrize("cpu_rowwise", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_linear_equals_the_dequantized_product(out_dtype, static, cpu_rowwise, monkeypatch):
    """torch's CPU _scaled_mm (or, in builds whose CPU kernel takes per-tensor scales only,
    the fp32 fallback) gives (q_x * s_x) @ (q_w * s_w).T; and that is within the FP8 error
    of the float product."""
    if cpu_rowwise and not fp8._cpu_rowwise_scaled_mm():
        pytest.skip("this torch build's CPU _scaled_mm takes per-tensor scales only")
    monkeypatch.setattr(fp8, "_cpu_rowwise_scaled_mm", lambda: cpu_rowwise)
    torch.manual_seed(0)
    x, w = torch.randn(2, 9, 64).to(out_dtype), torch.randn(48, 64) * 0.05
    bias = torch.randn(48).to(out_dtype)
    qw, sw = quantize_weight_per_channel(w)
    in_scale = torch.tensor([x.float().abs().max().item() / FP8_MAX]) if static else None
    y = fp8_linear(x, qw, sw, in_scale, bias)
    assert y.shape == (2, 9, 48) and y.dtype == out_dtype
    x2 = x.reshape(-1, 64)
    if static:
        qx, sx = quantize_static(x2, in_scale), in_scale
    else:
        qx, sx = quantize_per_token(x2)
    ref = (qx.float() * sx) @ (qw.float() * sw[:, None]).t() + bias.float()
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.reshape(-1, 48).float(), ref, atol=tol, rtol=tol)
    exact = x2.float() @ w.t() + bias.float()
    assert ((y.reshape(-1, 48).float() - exact).norm() / exact.norm()) < 0.05


def test_fp8_linear_empty_batch():
    qw, sw = quantize_weight_per_channel(torch.randn(32, 16))
    assert fp8_linear(torch.empty(0, 16), qw, sw).shape == (0, 32)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_of_a_quantized_activation(out_dtype):
    """A QuantizedActivation (the input quantized by its producer) gives exactly what
    fp8_linear gives for the activation it quantizes itself; M = 0; the bias."""
    torch.manual_seed(0)
    x, w = torch.randn(9, 64).to(out_dtype), torch.randn(48, 64) * 0.05
    bias = torch.randn(48).to(out_dtype)
    qw, sw = quantize_weight_per_channel(w)
    assert fp8_linear_takes_quantized_input(qw, None, None)
    y = fp8_linear(QuantizedActivation(*quantize_per_token(x), out_dtype), qw, sw, bias=bias)
    assert y.dtype == out_dtype and torch.equal(y, fp8_linear(x, qw, sw, bias=bias))
    empty = QuantizedActivation(*quantize_per_token(x[:0]), out_dtype)
    assert fp8_linear(empty, qw, sw).shape == (0, 48) and fp8_linear(empty, qw, sw).dtype == out_dtype


def test_which_fp8_linears_take_a_quantized_activation():
    """Only per-channel FP8 weights with dynamic input scales and N, K multiples of 16 (the
    others quantize per tensor or per group, or dequantize on CUDA); the rest reject one."""
    qw, sw = quantize_weight_per_channel(torch.randn(48, 64))
    act = QuantizedActivation(*quantize_per_token(torch.randn(3, 64)), torch.float32)
    assert not fp8_linear_takes_quantized_input(qw, None, torch.ones(1))
    assert not fp8_linear_takes_quantized_input(qw, (128, 128), None)
    assert not fp8_linear_takes_quantized_input(torch.randn(48, 64), None, None)
    with pytest.raises(ValueError, match="dynamic input scales"):
        fp8_linear(act, qw, sw, torch.ones(1))
    qw_odd, sw_odd = quantize_weight_per_channel(torch.randn(40, 64))
    assert not fp8_linear_takes_quantized_input(qw_odd, None, None)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_linear(act, qw_odd, sw_odd)


def test_block_fp8_linear_matches_reference():
    torch.manual_seed(0)
    x, w = torch.randn(7, 256), torch.randn(384, 256) * 0.05
    q = torch.empty(384, 256, dtype=FP8_DTYPE)
    scale = torch.empty(3, 2)
    for i in range(3):
        for j in range(2):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale[i, j] = blk.abs().max() / FP8_MAX
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / scale[i, j]).to(FP8_DTYPE)
    y = block_fp8_linear(x, q, scale, (128, 128))
    qx, sx = quantize_per_token_group(x, 128)
    torch.testing.assert_close(y, block_fp8_matmul_reference(qx, sx, q, scale, (128, 128), torch.float32))
    exact = x @ w.t()
    assert ((y - exact).norm() / exact.norm()) < 0.05


def test_device_requirement(monkeypatch):
    check_fp8_supported(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    assert not fp8.fp8_supported(torch.device("cuda"))
    with pytest.raises(ValueError, match=r"compute capability >= 8\.9.*A100 has 8\.0"):
        check_fp8_supported(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8.fp8_supported(torch.device("cuda"))
    with pytest.raises(ValueError, match="not on mps"):
        check_fp8_supported(torch.device("mps"))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="CUDA sm89+: Triton's interpreter converts fp32 to e4m3 wrongly at mantissa carries "
                           "(-127.1 -> -64), so the kernel's stores are only checked compiled")
def test_per_token_triton_kernel_equals_torch():
    """The fused per-token kernel (the CUDA path of fp8_linear) == quantize_per_token, bit for bit."""
    from tandem.layers.quantization.fp8_triton import quantize_per_token_triton

    x = (torch.randn(6, 4000) * torch.logspace(-4, 3, 6)[:, None]).cuda()
    x[2] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        xs = x.to(dtype)
        q, s = quantize_per_token_triton(xs)
        q_ref, s_ref = quantize_per_token(xs)
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert quantize_per_token_triton(x[:0])[0].shape == (0, 4000)


_sm89 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                           reason="FP8 GEMMs need CUDA sm89+")


@_sm89
@pytest.mark.parametrize("m", [1, 7, 256, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fp8_linear_matches_reference(m, dtype):
    """cuBLASLt row-wise FP8 GEMM (Llama-8B down_proj shape) == the dequantized product."""
    torch.manual_seed(0)
    x, w = torch.randn(m, 14336, device="cuda").to(dtype), torch.randn(4096, 14336, device="cuda") * 0.01
    qw, sw = quantize_weight_per_channel(w)
    y = fp8_linear(x, qw, sw)
    qx, sx = quantize_per_token(x)
    ref = (qx.float() * sx) @ (qw.float() * sw[:, None]).t()
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)


@_sm89
@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("m", [1, 7, 256])
def test_cuda_unscaled_product_through_the_norm_matches_the_scaled_gemm(m, fast_accum):
    """At decode sizes (Llama-8B down_proj): the unit-scale GEMM's fp32 sums with the scales
    applied by the add + RMSNorm + quant kernel == the row-wise scaled GEMM then the same
    kernel, up to bf16 rounding of a few elements."""
    from tandem.layers import fused_ops
    from tandem.layers.quantization.fp8 import UnscaledProduct, fp8_linear_unscaled

    torch.manual_seed(0)
    x, w = torch.randn(m, 14336, device="cuda").to(torch.bfloat16), torch.randn(4096, 14336, device="cuda") * 0.01
    res = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
    norm_w = torch.rand(4096, device="cuda").to(torch.bfloat16)
    qw, sw = quantize_weight_per_channel(w)
    p = fp8_linear_unscaled(x, qw, sw, fast_accum)
    assert isinstance(p, UnscaledProduct) and p.acc.dtype == torch.float32
    y = fp8_linear(x, qw, sw, fast_accum=fast_accum)
    # Exact accumulation: the two kernels' sums agree, one bf16 ulp from the scaling order;
    # fast accumulation rounds differently per kernel (1e-2 of the largest value, session 12).
    atol, rtol = (0.0, 2 ** -7) if not fast_accum else (2e-2 * y.abs().max().item(), 2e-2)
    torch.testing.assert_close(p.apply_scales(), y, atol=atol, rtol=rtol)
    got_q, got_s, got_r = fused_ops.rms_norm_dynamic_per_token_quant(p, norm_w, 1e-5, res)
    want_q, want_s, want_r = fused_ops.rms_norm_dynamic_per_token_quant(y, norm_w, 1e-5, res)
    torch.testing.assert_close(got_r, want_r, atol=atol, rtol=rtol)
    torch.testing.assert_close(got_s, want_s, atol=0, rtol=2e-2)
    torch.testing.assert_close(got_q.float() * got_s, want_q.float() * want_s, atol=0.1, rtol=0.13)


@_sm89
@pytest.mark.parametrize("m", [1, 7, 100, 1024])
def test_cuda_block_fp8_linear_matches_reference(m):
    """cuBLASLt block-scaled GEMM (1x128 activations, 128x128 weights) == the reference."""
    torch.manual_seed(0)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    q = (torch.randn(1536, 4096, device="cuda") * 100).clamp(-448, 448).to(FP8_DTYPE)
    scale = torch.rand(12, 32, device="cuda") * 1e-3
    y = block_fp8_linear(x, q, scale, (128, 128))
    qx, sx = quantize_per_token_group(x, 128)
    ref = block_fp8_matmul_reference(qx, sx, q, scale, (128, 128), torch.float32)
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
