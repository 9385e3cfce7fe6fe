"""Batch-invariant execution on the CPU (issue 36): in deterministic mode a row's result is
the same bits whatever rows it is computed with and wherever it sits among them; the
row-wise ops (RMSNorm with and without the residual add, SiLU-and-mul, RoPE) are so in
either mode."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.layers import batch_invariant
from tandem.layers.fused_ops import apply_rotary, fused_add_rms_norm, rms_norm, silu_and_mul

DTYPES = [torch.float32, torch.bfloat16]


def _embedded(row: torch.Tensor, m: int, pos: int, g: torch.Generator) -> torch.Tensor:
    """``m`` random rows with ``row`` at ``pos``."""
    x = torch.randn(m, *row.shape, generator=g).to(row.dtype)
    x[pos] = row
    return x


def _check_row_invariance(fn, row: torch.Tensor, sizes=(1, 2, 3, 5, 7, 11, 16, 17, 64, 300)) -> None:
    g, rng = torch.Generator().manual_seed(0), random.Random(0)
    ref = fn(row[None])[0]
    for m in sizes:
        pos = rng.randrange(m)
        assert torch.equal(fn(_embedded(row, m, pos, g))[pos], ref), (m, pos)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (64, 4096)])
def test_linear_rows_do_not_depend_on_the_batch(dtype, shape):
    """Every row count from 1 (decode of one sequence) to 300 (a prefill), with a bias: MKL's
    fp32 GEMM alone gives other bits for 1-3, 5-7 and 9-11 rows than for 12 or more."""
    k, n = shape
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    _check_row_invariance(lambda x: batch_invariant.linear(x, w, b), torch.randn(k, generator=g).to(dtype))


def test_linear_equals_plain_linear_up_to_rounding_and_keeps_leading_dims():
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(48, 32, generator=g), torch.randn(3, 7, 32, generator=g)
    out = batch_invariant.linear(x, w)
    assert out.shape == (3, 7, 48)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w), atol=1e-5, rtol=1e-5)
    assert batch_invariant.linear(x[:0], w).shape == (0, 7, 48)


def test_linear_off_is_plain_linear():
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(48, 32, generator=g), torch.randn(5, 32, generator=g)
    assert torch.equal(batch_invariant.linear(x, w, deterministic=False), torch.nn.functional.linear(x, w))


def test_linear_layers_use_the_mode_they_were_built_in(monkeypatch):
    """The model's high-precision linear layers go through the row blocks when built in
    deterministic mode, and not otherwise, whatever is being built when they run."""
    from tandem.layers.linear import ColumnParallelLinear, RowParallelLinear

    def layers() -> tuple[torch.nn.Module, ...]:
        return ColumnParallelLinear(32, 48, tp_size=1, tp_rank=0), RowParallelLinear(48, 32, tp_size=1, tp_rank=0)

    with batch_invariant.building(True):
        on = layers()
    off = layers()
    calls = []
    monkeypatch.setattr(batch_invariant, "row_blocked", lambda fn, x, n: calls.append(x.shape) or fn(x))
    with batch_invariant.building(True):  # a build in progress changes no existing layer
        for layer in on + off:
            torch.nn.init.normal_(layer.weight)
            layer(torch.randn(5, layer.weight.shape[1]))
    assert [layer.deterministic for layer in on + off] == [True, True, False, False]
    assert calls == [(5, 32), (5, 48)]


def test_building_scopes_the_mode():
    """The build mode is False outside a block, nests, is restored on exit (also when the
    block raises) and belongs to the building thread (an engine builds on its step thread)."""
    from concurrent.futures import ThreadPoolExecutor

    assert not batch_invariant.build_mode()
    with batch_invariant.building(True), ThreadPoolExecutor(1) as pool:
        assert batch_invariant.build_mode()
        assert not pool.submit(batch_invariant.build_mode).result()
        with batch_invariant.building(False):
            assert not batch_invariant.build_mode()
        assert batch_invariant.build_mode()
    with pytest.raises(RuntimeError), batch_invariant.building(True):
        raise RuntimeError
    assert not batch_invariant.build_mode()


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_wise_ops_do_not_depend_on_the_batch(dtype):
    g = torch.Generator().manual_seed(4)
    hidden = 576
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    row, res = torch.randn(hidden, generator=g).to(dtype), torch.randn(hidden, generator=g).to(dtype)
    _check_row_invariance(lambda x: rms_norm(x, w, 1e-5), row)
    both = torch.stack([row, res])
    _check_row_invariance(lambda x: torch.stack(fused_add_rms_norm(x[:, 0], x[:, 1], w, 1e-5), 1), both)
    _check_row_invariance(silu_and_mul, torch.randn(2 * 1536, generator=g).to(dtype))


def test_rotary_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(5)
    cos, sin = torch.rand(256, 32, generator=g), torch.rand(256, 32, generator=g)
    q, k = torch.randn(9, 64, generator=g), torch.randn(3, 64, generator=g)
    qk = torch.cat([q, k])  # one row: a token's q and k heads

    def rope(rows: torch.Tensor) -> torch.Tensor:
        positions = torch.full((rows.shape[0],), 200, dtype=torch.long)
        rq, rk = apply_rotary(rows[:, :9].contiguous(), rows[:, 9:].contiguous(), cos, sin, positions)
        return torch.cat([rq, rk], 1)

    _check_row_invariance(rope, qk)
