"""The paged KV-cache write of the Triton backend as one kernel (vLLM's
``reshape_and_cache_flash``): the new tokens' keys and values scattered into their slots of
``kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]``, quantized on the way for
an FP8 cache.

It replaces :func:`tandem.attention.backend.write_kv_cache` (the torch reference, still the
torch backend's) on the Triton backend, where that function costs a ``.contiguous()`` copy
of ``v``, a clamp of the slot mapping and two ``index_copy_`` per layer, and for an FP8
cache four more elementwise kernels per tensor; here K and V of a token are read through
their strides (the views of the ``qkv_proj`` output need no copy) and written by one
program. Values stored are bit-identical to the reference's: an FP8 cache holds
``clamp(x / scale, -448, 448)`` in e4m3, the division rounded to nearest as torch's.
Padding tokens (slot -1) write nothing (the reference writes them into the null block's
slot 0, which no request reads). No host sync; the grid is the token count (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.triton_utils import INTERPRET as _INTERPRET

_FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


@triton.jit
def _copy_heads(src, dst, mask, scale, FP8_MAX: tl.constexpr):
    """``dst[...] = src[...]`` for one token's ``[BLOCK_H, HEAD_DIM]`` pointer tiles."""
    x = tl.load(src, mask=mask)
    if FP8_MAX > 0:
        x = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -FP8_MAX, FP8_MAX)
    tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,  # > 0: an FP8 cache, x / scale saturated to +-FP8_MAX
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return  # padding token
    h = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = h < NUM_KV_HEADS
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    _copy_heads(k_ptr + t * stride_kt + h * stride_kh + d, k_cache_ptr + dst, mask, k_scale, FP8_MAX)
    _copy_heads(v_ptr + t * stride_vt + h * stride_vh + d, v_cache_ptr + dst, mask, v_scale, FP8_MAX)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write ``k``, ``v [T, num_kv_heads, head_dim]`` (any token / head strides, unit last
    stride) into ``kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]`` (unit
    last stride) at ``slot_mapping [T]`` (int64 slots ``block * block_size + offset``; -1:
    padding, not written). An FP8 (``float8_e4m3fn``) cache stores ``x / k_scale`` and
    ``x / v_scale`` saturated to +-448; other caches must have k's dtype.

    Raises:
        ValueError: mismatched shapes, a dtype pair other than (x, x) or (x, float8_e4m3fn),
            a non-unit last stride, or a non-power-of-two head_dim.
        RuntimeError: CPU tensors without the Triton interpreter (``TRITON_INTERPRET=1``).
    """
    t, hk, d = k.shape
    if v.shape != k.shape or kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (hk, d) \
            or slot_mapping.shape != (t,):
        raise ValueError(f"reshape_and_cache: k {tuple(k.shape)}, v {tuple(v.shape)}, kv_cache "
                         f"{tuple(kv_cache.shape)}, slot_mapping {tuple(slot_mapping.shape)} do not fit")
    if v.dtype != k.dtype or kv_cache.dtype not in (k.dtype, torch.float8_e4m3fn):
        raise ValueError(f"reshape_and_cache: dtypes k={k.dtype} v={v.dtype} kv_cache={kv_cache.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("reshape_and_cache: k, v and kv_cache need a unit last stride")
    if d & (d - 1):
        raise ValueError(f"reshape_and_cache: head_dim must be a power of two, got {d}")
    if not kv_cache.is_cuda and not _INTERPRET:
        raise RuntimeError("reshape_and_cache on CPU tensors needs the Triton interpreter (TRITON_INTERPRET=1)")
    if t == 0:
        return
    kc, vc = kv_cache[0], kv_cache[1]
    fp8_max = _FP8_MAX if kv_cache.dtype == torch.float8_e4m3fn else 0.0
    _reshape_and_cache_kernel[(t,)](
        k, v, kc, vc, slot_mapping, float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        NUM_KV_HEADS=hk, BLOCK_H=triton.next_power_of_2(hk), HEAD_DIM=d, BLOCK_SIZE=kv_cache.shape[2],
        FP8_MAX=fp8_max, num_warps=_num_warps(hk * d),
    )


def _num_warps(elems: int) -> int:
    return min(8, max(1, elems // 256))
