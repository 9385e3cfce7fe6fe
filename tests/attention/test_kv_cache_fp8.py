"""FP8 (e4m3) paged KV cache in the torch backend: what is written (k / k_scale rounded to
e4m3, saturated), the round trip, and attention over it against attention over the
dequantized cache."""

from __future__ import annotations

import pytest
import torch

from tandem.attention.backend import quantize_kv, write_kv_cache
from tandem.attention.torch_backend import TorchAttentionBackend
from tests.models.paged_parity import step_metadata

FP8 = torch.float8_e4m3fn


def test_quantize_kv_scales_and_saturates():
    x = torch.tensor([[-1000.0, -0.3, 0.0, 0.26, 1000.0]])
    q = quantize_kv(x, 0.5, FP8)
    assert q.dtype == FP8 and q.float().tolist() == [[-448.0, -0.625, 0.0, 0.5, 448.0]]
    assert quantize_kv(x, 0.5, torch.float32) is x  # model-dtype cache: unchanged


@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.05, 0.02)])
def test_write_round_trip(k_scale, v_scale):
    torch.manual_seed(0)
    cache = torch.zeros(2, 4, 8, 2, 16, dtype=FP8)
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16) * 3
    slots = torch.tensor([9, 10, 31, 8, -1])  # -1: padding, written to the null block 0
    write_kv_cache(k, v, cache, slots, k_scale, v_scale)
    flat = cache.view(2, 32, 2, 16)
    for i, s in enumerate(slots[:4].tolist()):
        assert torch.equal(flat[0, s].view(torch.uint8), quantize_kv(k[i], k_scale, FP8).view(torch.uint8))
        assert torch.equal(flat[1, s].view(torch.uint8), quantize_kv(v[i], v_scale, FP8).view(torch.uint8))
    # e4m3 round trip within 2^-4 relative (plus the subnormal step) where nothing saturates
    back = flat[0, 9].float() * k_scale
    assert ((back - k[0]).abs() <= k[0].abs() * 2**-4 + k_scale * 2**-10).all()
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[[0, 8, 9, 10, 31]] = False
    assert not flat[:, untouched].float().any()


@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.5, 2.0)])
def test_attention_over_fp8_cache_equals_dequantized_cache(k_scale, v_scale):
    """Prefill chunks and decode over an FP8 cache == the same over its dequantized copy in
    fp32 (the scales fold into the softmax scale and the output)."""
    torch.manual_seed(0)
    bs, heads, kv_heads, dim = 8, 4, 2, 32
    backend = TorchAttentionBackend()
    fp8_cache = torch.zeros(2, 16, bs, kv_heads, dim, dtype=FP8)
    tables = [[3, 5, 7], [2, 4], [9]]
    computed, q_lens = [9, 0, 3], [1, 11, 4]
    meta = step_metadata([1, 11, 4], computed, tables, bs)
    # fill the cached prefixes
    prefix = step_metadata([9, 3], [0, 0], [tables[0], tables[2]], bs)
    write_kv_cache(torch.randn(12, kv_heads, dim), torch.randn(12, kv_heads, dim), fp8_cache, prefix.slot_mapping,
                   k_scale, v_scale)
    n = sum(q_lens)
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    out = backend.forward(q, k, v, fp8_cache, meta, dim**-0.5, k_scale, v_scale)
    deq = fp8_cache.float() * torch.tensor([k_scale, v_scale]).view(2, 1, 1, 1, 1)
    ref_cache = deq.clone()
    ref = backend.forward(q, (quantize_kv(k, k_scale, FP8).float() * k_scale),
                          (quantize_kv(v, v_scale, FP8).float() * v_scale), ref_cache, meta, dim**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # and close to attention over the unquantized values
    exact = backend.forward(q, k, v, deq.clone(), meta, dim**-0.5)
    assert ((out - exact).norm() / exact.norm()) < 0.1
