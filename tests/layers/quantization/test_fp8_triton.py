"""The FP8 GEMM epilogue kernel (scale_rows_cols_triton) against torch, bit for bit; in the
Triton interpreter without CUDA (the per-token kernel is checked compiled only, in test_fp8.py)."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import triton_test_setup

DEVICE, INTERPRET = triton_test_setup(bf16_rounding=True)  # (tests/conftest.py sets TRITON_INTERPRET first)

from tandem.layers.quantization.fp8_triton import scale_rows_cols_triton  # noqa: E402


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_scale_rows_cols_equals_torch(out_dtype):
    """``(acc * row_scale * col_scale).to(out_dtype)`` with the same fp32 products, over a
    row-strided accumulator whose width is no multiple of the kernel's block."""
    g = torch.Generator().manual_seed(0)
    acc = (torch.randn(5, 2600, generator=g) * 1e4)[:, :2500].to(DEVICE)
    row_scale = torch.rand(5, 1, generator=g).to(DEVICE) * 1e-2
    col_scale = torch.rand(2500, generator=g).to(DEVICE) * 1e-3
    got = scale_rows_cols_triton(acc, row_scale, col_scale, out_dtype)
    want = (acc * row_scale * col_scale[None, :]).to(out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, want)
    assert scale_rows_cols_triton(acc[:0], row_scale[:0], col_scale, out_dtype).shape == (0, 2500)
