"""The C++ RMSNorms of the CPU (tandem.layers.cpu_ops, tandem/csrc/cpu_ops.cpp): they build
here, compute the torch references' values in every dtype (16-bit rounding as the reference
rounds; fp32 to the last bits), a row's result does not depend on the rows beside it, the
fused ops run them in mode ``cpu`` only where dtypes agree, and a failed build falls back
to the torch code with one warning."""

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
