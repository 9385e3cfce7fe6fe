"""FP8 weights of the tensor-parallel linear layers and experts, sharded without a process
group (explicit ``tp_size``/``tp_rank``): each rank loads the whole checkpoint tensors and
keeps the FP8 bytes and scales of its slice, per-channel, per-tensor and block-wise."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.layers.parallel_moe import ParallelFusedMoE
from tandem.layers.quantization.fp8 import FP8_DTYPE, FP8_MAX, dequantize_block, dequantize_weight

BLOCK = (128, 128)


def _fp8(rows: int, cols: int, seed: int, scheme: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, its checkpoint scale, dequantized fp32 weight) of one matrix."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(rows, cols, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    if scheme == "block":
        s = torch.rand(-(-rows // 128), -(-cols // 128), generator=g) + 0.5
        return q, s, dequantize_block(q, s, BLOCK)
    s = torch.rand(rows, 1, generator=g) + 0.5 if scheme == "channel" else torch.rand(1, generator=g) + 0.5
    return q, s, q.float() * s.reshape(-1, 1)


def _deq(layer) -> torch.Tensor:
    return dequantize_weight(layer.weight, layer.weight_scale, layer.weight_block, torch.float32)


@pytest.mark.parametrize("scheme", ["channel", "tensor", "block"])
@pytest.mark.parametrize("tp", [1, 2])
def test_column_and_row_parallel_fp8_shards(scheme, tp):
    hidden, hd, heads, kv_heads, inter = 256, 128, 4, 2, 512
    block = BLOCK if scheme == "block" else None
    q, k, v = (_fp8(n * hd, hidden, i, scheme) for i, n in enumerate((heads, kv_heads, kv_heads)))
    gate, up = _fp8(inter, hidden, 5, scheme), _fp8(inter, hidden, 6, scheme)
    down = _fp8(hidden, inter, 7, scheme)
    for r in range(tp):
        qkv = QKVParallelLinear(hidden, hd, heads, kv_heads, tp_size=tp, tp_rank=r)
        gu = MergedColumnParallelLinear(hidden, [inter, inter], tp_size=tp, tp_rank=r)
        dp = RowParallelLinear(inter, hidden, tp_size=tp, tp_rank=r)
        for layer in (qkv, gu, dp):
            layer.create_fp8_weights(block, static_input=False)
        for i, (w, s, _) in enumerate((q, k, v)):
            qkv.weight.weight_loader(w, i)
            qkv.weight_scale.weight_loader(s, i)
        for i, (w, s, _) in enumerate((gate, up)):
            gu.weight.weight_loader(w, i)
            gu.weight_scale.weight_loader(s, i)
        dp.weight.weight_loader(down[0])
        dp.weight_scale.weight_loader(down[1])
        nq, nkv, ni, nc = heads * hd // tp, kv_heads * hd // tp, inter // tp, inter // tp
        want_qkv = torch.cat([q[2][r * nq:(r + 1) * nq], k[2][r * nkv:(r + 1) * nkv], v[2][r * nkv:(r + 1) * nkv]])
        assert torch.equal(_deq(qkv), want_qkv)
        assert torch.equal(_deq(gu), torch.cat([gate[2][r * ni:(r + 1) * ni], up[2][r * ni:(r + 1) * ni]]))
        assert torch.equal(_deq(dp), down[2][:, r * nc:(r + 1) * nc])


def test_block_scales_need_whole_blocks_per_shard():
    layer = QKVParallelLinear(256, 64, 4, 1, tp_size=1, tp_rank=0)  # k and v: 64 rows, half a block
    with pytest.raises(ValueError, match="whole blocks of 128 rows"):
        layer.create_fp8_weights(BLOCK, static_input=False)


def test_static_input_scales_take_the_largest_shard():
    from tandem.layers.quantization.apply import finish_fp8_model
    from tandem.layers.quantization.config import Fp8Config

    layer = MergedColumnParallelLinear(32, [16, 16], tp_size=1, tp_rank=0)
    layer.create_fp8_weights(None, static_input=True)
    for i in range(2):
        w, s, _ = _fp8(16, 32, i, "tensor")
        layer.weight.weight_loader(w, i)
        layer.weight_scale.weight_loader(s, i)
        layer.input_scale.weight_loader(torch.tensor([0.25 * (i + 1)]), i)
    finish_fp8_model(torch.nn.ModuleDict({"mlp": layer}), Fp8Config(True, static_input_scale=True), torch.float32)
    assert layer.input_scale.tolist() == [0.5]


@pytest.mark.parametrize("scheme", ["channel", "tensor", "block"])
@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_expert_scales_shard_over_tp(scheme, tp):
    e, hidden, inter = 2, 256, 256
    block = BLOCK if scheme == "block" else None
    mats = {(x, which): _fp8(*((inter, hidden) if which != "down" else (hidden, inter)), 10 * x + i, scheme)
            for x in range(e) for i, which in enumerate(("gate", "up", "down"))}
    for r in range(tp):
        moe = ParallelFusedMoE(e, 1, hidden, inter, tp_size=tp, tp_rank=r)
        moe.create_fp8_weights(block)
        for (x, which), (w, s, _) in mats.items():
            kind, shard = ("w2", None) if which == "down" else ("w13", 0 if which == "gate" else 1)
            moe.load_expert(kind, x, w, shard)
            moe.load_expert_scale(kind, x, s, shard)
        moe.finish_fp8_weights("experts")
        n = inter // tp
        w13 = dequantize_weight(moe.w13, moe.w13_weight_scale, block, torch.float32)
        w2 = dequantize_weight(moe.w2, moe.w2_weight_scale, block, torch.float32)
        for x in range(e):
            assert torch.equal(w13[x], torch.cat([mats[x, "gate"][2][r * n:(r + 1) * n],
                                                  mats[x, "up"][2][r * n:(r + 1) * n]]))
            assert torch.equal(w2[x], mats[x, "down"][2][:, r * n:(r + 1) * n])


def test_missing_expert_scale_is_an_error():
    moe = ParallelFusedMoE(2, 1, 32, 16, tp_size=1, tp_rank=0)
    moe.create_fp8_weights(None)
    with pytest.raises(ValueError, match="lacks w13_weight_scale"):
        moe.finish_fp8_weights("layers.0.mlp.experts")


@pytest.mark.parametrize("setting", ["on", "off"])
def test_fast_accumulation_follows_the_environment_at_load(setting, monkeypatch):
    """TANDEM_FP8_FAST_ACCUM, read when the weights are finished, reaches every per-channel
    GEMM as ``_scaled_mm``'s ``use_fast_accum`` (on an FP8 GPU where there is one, else on
    the CPU where torch's ``_scaled_mm`` takes row-wise scales)."""
    from tandem.layers.quantization import fp8
    from tandem.layers.quantization.apply import finish_fp8_model
    from tandem.layers.quantization.config import Fp8Config

    cuda = torch.cuda.is_available() and fp8.fp8_supported(torch.device("cuda"))
    if not cuda and not fp8._cpu_rowwise_scaled_mm():
        pytest.skip("this torch build's CPU _scaled_mm takes per-tensor scales only (the fp32 fallback runs)")
    monkeypatch.setenv("TANDEM_FP8_FAST_ACCUM", setting)
    layer = RowParallelLinear(32, 16, tp_size=1, tp_rank=0)
    finish_fp8_model(torch.nn.ModuleDict({"o_proj": layer}), Fp8Config(), torch.float32)
    monkeypatch.delenv("TANDEM_FP8_FAST_ACCUM")
    assert layer.weight.dtype == FP8_DTYPE and layer.fp8_fast_accum is (setting == "on")
    seen = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        seen.append(kwargs.get("use_fast_accum"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    device = "cuda" if cuda else "cpu"
    layer.to(device)(torch.randn(3, 32, device=device))
    assert seen == [setting == "on"]


def _row_parallel_fp8(monkeypatch, max_rows: str, **kwargs) -> RowParallelLinear:
    """A 64 -> 32 row-parallel layer that feeds a norm, its random fp32 weight quantized
    online with ``TANDEM_FP8_DEFERRED_SCALES_MAX_ROWS=max_rows``."""
    from tandem.layers.quantization.apply import finish_fp8_model
    from tandem.layers.quantization.config import Fp8Config

    monkeypatch.setenv("TANDEM_FP8_DEFERRED_SCALES_MAX_ROWS", max_rows)
    layer = RowParallelLinear(64, 32, **{"tp_size": 1, "tp_rank": 0, **kwargs})
    with torch.no_grad():
        layer.weight.normal_()
        if layer.bias is not None:
            layer.bias.normal_()
    layer.output_feeds_norm = True
    finish_fp8_model(torch.nn.ModuleDict({"o_proj": layer}), Fp8Config(), torch.bfloat16)
    return layer


def test_deferred_output_scales_up_to_the_row_limit(monkeypatch):
    """Up to TANDEM_FP8_DEFERRED_SCALES_MAX_ROWS rows, a row-parallel FP8 layer that feeds a
    norm returns its unit-scale product with the scales to apply: the same values as the
    scaled GEMM; above the limit, and with the limit 0, the scaled product itself."""
    from tandem.layers.quantization.fp8 import UnscaledProduct, fp8_linear

    layer = _row_parallel_fp8(monkeypatch, "8")
    assert layer.deferred_scales_max_rows == 8
    for rows in (1, 8, 9):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        want = fp8_linear(x, layer.weight, layer.weight_scale)
        got = layer(x)
        if rows > 8:
            assert isinstance(got, torch.Tensor) and torch.equal(got, want)
            continue
        assert isinstance(got, UnscaledProduct) and got.acc.dtype == torch.float32 and got.dtype == torch.bfloat16
        assert got.row_scale.shape == (rows, 1) and got.col_scale.shape == (32,)
        # Only the order of the two fp32 scalings may differ: one bf16 ulp at most.
        torch.testing.assert_close(got.apply_scales(), want, atol=0, rtol=2 ** -7)
    assert isinstance(layer(torch.randn(0, 64).to(torch.bfloat16)), torch.Tensor)
    assert _row_parallel_fp8(monkeypatch, "0").deferred_scales_max_rows == 0


@pytest.mark.parametrize("kwargs", [dict(bias=True), dict(tp_size=2, tp_rank=1)])
def test_no_deferred_scales_with_a_bias_or_tensor_parallelism(monkeypatch, kwargs):
    """A bias is added after the scales, and TP ranks' partial products have their own
    per-token scales before the all-reduce: such layers always scale their own product."""
    assert _row_parallel_fp8(monkeypatch, "256", **kwargs).deferred_scales_max_rows == 0


def test_unscaled_gemm_rejects_what_it_cannot_run():
    from tandem.layers.quantization.fp8 import fp8_linear_unscaled, quantize_weight_per_channel

    q, s = quantize_weight_per_channel(torch.randn(32, 64))
    with pytest.raises(ValueError, match="no rows"):
        fp8_linear_unscaled(torch.randn(0, 64), q, s)
    q, s = quantize_weight_per_channel(torch.randn(30, 64))
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_linear_unscaled(torch.randn(2, 64), q, s)


def test_deferring_scales_where_it_would_drop_work_is_an_error(monkeypatch):
    """defer_output_scales on a layer whose forward would skip an all-reduce or a bias."""
    for kwargs in (dict(bias=True), dict(tp_size=2, tp_rank=0)):
        layer = _row_parallel_fp8(monkeypatch, "256", **kwargs)
        assert not layer.can_defer_output_scales
        with pytest.raises(ValueError, match="cannot leave its output scales"):
            layer.defer_output_scales(256)
        layer.defer_output_scales(0)  # off is always allowed
    layer = RowParallelLinear(64, 32, tp_size=1, tp_rank=0)  # bf16 weight, output to a norm
    layer.output_feeds_norm = True
    with pytest.raises(ValueError, match="cannot leave its output scales"):
        layer.defer_output_scales(8)


def test_deferred_scales_need_a_2d_input(monkeypatch):
    """A [B, T, in] input keeps its leading dims: the scaled product."""
    layer = _row_parallel_fp8(monkeypatch, "256")
    y = layer(torch.randn(2, 3, 64).to(torch.bfloat16))
    assert isinstance(y, torch.Tensor) and y.shape == (2, 3, 32)
