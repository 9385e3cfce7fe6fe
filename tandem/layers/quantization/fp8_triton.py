"""Dynamic per-token FP8 quantization as one Triton kernel (CUDA; the torch version in
:func:`tandem.layers.quantization.fp8.quantize_per_token` takes five kernels: abs, amax,
divide, clamp, cast). One program per row: the row's absolute maximum, its scale
``max(amax / 448, MIN_SCALE)``, and the saturated e4m3 values, as vLLM's
``dynamic_per_token_scaled_fp8_quant``."""

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
