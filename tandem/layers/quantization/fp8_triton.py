"""FP8 kernels around the GEMMs (CUDA).

* :func:`quantize_per_token_triton`: dynamic per-token FP8 quantization as one kernel (the
  torch version in :func:`tandem.layers.quantization.fp8.quantize_per_token` takes five:
  abs, amax, divide, clamp, cast). One program per row: the row's absolute maximum, its
  scale ``max(amax / 448, MIN_SCALE)``, and the saturated e4m3 values, as vLLM's
  ``dynamic_per_token_scaled_fp8_quant``.
* :func:`scale_rows_cols_triton`: the per-token x per-channel scaling of a GEMM run with
  unit scales, as one elementwise pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.layers.quantization.fp8_format import FP8_DTYPE, FP8_MAX, MIN_SCALE


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, FMAX: tl.constexpr, MIN_S: tl.constexpr,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    # Divisions rounded to nearest (div_rn) as torch's: Triton's ``/`` is approximate.
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), FMAX), MIN_S)
    q = tl.clamp(tl.math.div_rn(x, scale), -FMAX, FMAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`~tandem.layers.quantization.fp8.quantize_per_token` for a
    2-d ``x [M, K]`` with unit column stride (``K`` up to 65,536)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _per_token_quant_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), FMAX=FP8_MAX, MIN_S=MIN_SCALE, BLOCK=block,
                                      num_warps=max(1, min(16, block // 512)))
    return q, s


@triton.jit
def _scale_rows_cols_kernel(acc_ptr, row_scale_ptr, col_scale_ptr, out_ptr, N, stride_acc, stride_out,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.load(acc_ptr + row * stride_acc + cols, mask=mask, other=0.0)
    sw = tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
    y = acc * tl.load(row_scale_ptr + row) * sw
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def scale_rows_cols_triton(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                           out_dtype: torch.dtype) -> torch.Tensor:
    """``(acc * row_scale * col_scale[None, :]).to(out_dtype)`` in one pass: the epilogue of
    an FP8 GEMM run with unit scales. ``acc [M, N]`` fp32 (unit column stride),
    ``row_scale [M, 1]`` fp32, ``col_scale [N]`` fp32; returns ``[M, N]``."""
    m, n = acc.shape
    out = torch.empty(m, n, dtype=out_dtype, device=acc.device)
    if m and n:
        block = 1024
        _scale_rows_cols_kernel[(m, triton.cdiv(n, block))](acc, row_scale, col_scale, out, n, acc.stride(0),
                                                             out.stride(0), BLOCK=block, num_warps=4)
    return out
