"""The Triton KV-cache write against the torch reference (``write_kv_cache``).

Without CUDA the kernel runs in the Triton interpreter (set before the import below)."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import triton_test_setup

DEVICE, INTERPRET = triton_test_setup("tandem.attention.triton_reshape_and_cache", fp8_rounding=True)

from tandem.attention.backend import write_kv_cache  # noqa: E402
from tandem.attention.triton_reshape_and_cache import reshape_and_cache  # noqa: E402

HQ, HK, D, NUM_BLOCKS, BLOCK = 4, 2, 32, 6, 4


def qkv_views(t: int, dtype: torch.dtype, hk: int = HK, d: int = D):
    """k, v as the model passes them: strided views of one qkv_proj output."""
    qkv = torch.randn(t, (HQ + 2 * hk) * d, device=DEVICE).to(dtype) * 3
    _, k, v = qkv.split([HQ * d, hk * d, hk * d], dim=-1)
    return k.view(t, hk, d), v.view(t, hk, d)


@pytest.mark.parametrize("cache_dtype,scales", [
    (torch.float32, (1.0, 1.0)), (torch.bfloat16, (1.0, 1.0)),
    (torch.float8_e4m3fn, (1.0, 1.0)), (torch.float8_e4m3fn, (0.37, 3.1)),
])
def test_writes_the_reference_bytes_from_strided_views_and_skips_padding(cache_dtype, scales):
    """Every written slot holds exactly the reference's bytes (FP8: x / scale saturated,
    rounded as torch rounds); padding tokens (-1) write nothing outside the null block, and
    no other slot changes."""
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    k, v = qkv_views(7, dtype)
    k[0, 0, 0] = 1000.0  # saturates in FP8 at scale 1
    slots = torch.tensor([5, 9, -1, 4, 23, -1, 13], device=DEVICE)
    fill = torch.randn(2, NUM_BLOCKS, BLOCK, HK, D, device=DEVICE).to(cache_dtype)
    ref, out = fill.clone(), fill.clone()
    write_kv_cache(k, v, ref, slots, *scales)
    reshape_and_cache(k, v, out, slots, *scales)
    as_bytes = (lambda c: c.view(torch.uint8)) if cache_dtype == torch.float8_e4m3fn else (lambda c: c)
    assert torch.equal(as_bytes(out[:, 1:]), as_bytes(ref[:, 1:]))
    assert torch.equal(as_bytes(out[:, 0]), as_bytes(fill[:, 0]))  # the null block: untouched


def test_padding_only_and_empty_steps_write_nothing():
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK, HK, D, device=DEVICE)
    k, v = qkv_views(3, torch.float32)
    reshape_and_cache(k, v, cache, torch.full((3,), -1, device=DEVICE))
    reshape_and_cache(k[:0], v[:0], cache, torch.empty(0, dtype=torch.long, device=DEVICE))
    assert not cache.any()


def test_non_power_of_two_heads_are_masked():
    k, v = qkv_views(3, torch.float32, hk=3)
    slots = torch.tensor([1, 2, 7], device=DEVICE)
    ref = torch.zeros(2, NUM_BLOCKS, BLOCK, 3, D, device=DEVICE)
    out = ref.clone()
    write_kv_cache(k, v, ref, slots)
    reshape_and_cache(k, v, out, slots)
    assert torch.equal(out, ref)


def test_bad_inputs_are_value_errors_naming_the_problem():
    k, v = qkv_views(2, torch.float32)
    slots = torch.tensor([1, 2], device=DEVICE)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK, HK, D, device=DEVICE)
    with pytest.raises(ValueError, match="dtypes"):
        reshape_and_cache(k, v, cache.bfloat16(), slots)
    with pytest.raises(ValueError, match="do not fit"):
        reshape_and_cache(k, v, cache, slots[:1])
    with pytest.raises(ValueError, match="do not fit"):
        reshape_and_cache(k, v[:, :1], cache, slots)
    with pytest.raises(ValueError, match="unit last stride"):
        reshape_and_cache(k.transpose(1, 2).contiguous().transpose(1, 2), v, cache, slots)
    kd, vd = qkv_views(2, torch.float32, d=24)
    with pytest.raises(ValueError, match="power of two"):
        reshape_and_cache(kd, vd, torch.zeros(2, NUM_BLOCKS, BLOCK, HK, 24, device=DEVICE), slots)
