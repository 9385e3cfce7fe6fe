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
