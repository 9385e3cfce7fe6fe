"""The per-token latent write of DeepSeek-V2's MLA layer (:mod:`tandem.layers.mla`).

For each new token ``t`` at ``positions[t]``, from the ``kv_a_proj_with_mqa`` output
``kv [T, kv_lora_rank + rope]`` and the query's RoPE part ``q_pe [T, heads, rope]``:

* ``c_kv = kv_a_layernorm(kv[:, :kv_lora_rank])`` (RMSNorm, transformers' rounding order),
* ``k_pe = rope(kv[:, kv_lora_rank:])`` and ``q_pe = rope(q_pe)``, interleaved pairs
  ``(x[2i], x[2i+1])`` as transformers' DeepSeek-V2 rotates them, math in fp32,
* ``kv_cache[slot_mapping[t]] = concat(c_kv, k_pe)`` (FP8 caches: saturated to e4m3 with
  scale 1.0); padding tokens (slot -1) write into slot 0 of the reserved null block.

:func:`write_latents` runs this as one Triton kernel (one program per token; ``q_pe`` is
rotated in place, so a view of the ``q_proj`` output needs no copy) where the fused ops run
their kernels in the caller's fused-ops mode (:func:`tandem.layers.fused_ops.use_triton`:
CUDA under ``auto``), and otherwise as the separate torch ops it replaces (RMSNorm, RoPE,
concat, ``index_copy_``): the reference. vLLM splits the same work into its
rotary-embedding and ``concat_and_cache_mla`` kernels. No host sync; the grid is the token
count (CUDA-graph safe).
"""

from __future__ import annotations

import functools

import torch

from tandem.attention.backend import quantize_kv
from tandem.layers import fused_ops
from tandem.layers.fused_ops import apply_rotary_ref, rms_norm_ref
from tandem.layers.norm import RMSNorm

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without Triton
    triton = tl = None

_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def _mla_latent_kernel(
    q_pe_ptr,
    kv_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    cache_ptr,  # [num_slots, RANK + 2 * HALF], contiguous
    stride_qt,
    stride_qh,
    stride_kv,
    stride_cos,
    stride_sin,
    eps,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HALF: tl.constexpr,  # rope / 2: rotated pairs
    BLOCK_HALF: tl.constexpr,
    FP8_MAX: tl.constexpr,  # > 0: an FP8 cache, values saturated to +-FP8_MAX
):
    t = tl.program_id(0).to(tl.int64)
    dtype = q_pe_ptr.dtype.element_ty  # the model's dtype: the latent's before the cache cast
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.maximum(tl.load(slot_ptr + t).to(tl.int64), 0)  # padding (-1): the null block's slot 0
    dst = cache_ptr + slot * (RANK + 2 * HALF)
    cache_dtype = cache_ptr.dtype.element_ty

    # c_kv: RMSNorm in fp32, rounded to the input dtype before the weight multiplies.
    r = tl.arange(0, BLOCK_R)
    rmask = r < RANK
    x = tl.load(kv_ptr + t * stride_kv + r, mask=rmask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / RANK + eps)
    w = tl.load(w_ptr + r, mask=rmask, other=0.0).to(tl.float32)
    c_kv = ((x * rstd).to(kv_ptr.dtype.element_ty).to(tl.float32) * w).to(dtype).to(tl.float32)

    # k_pe and q_pe: interleaved RoPE at this token's position.
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + d, mask=dmask, other=0.0).to(tl.float32)
    k_src = kv_ptr + t * stride_kv + RANK
    k1 = tl.load(k_src + 2 * d, mask=dmask, other=0.0).to(tl.float32)
    k2 = tl.load(k_src + 2 * d + 1, mask=dmask, other=0.0).to(tl.float32)
    # The latent is rounded to the model's dtype first (the reference concatenates it in
    # that dtype), then an FP8 cache saturates it (quantize_kv).
    k_pe1 = (k1 * cos - k2 * sin).to(dtype).to(tl.float32)
    k_pe2 = (k2 * cos + k1 * sin).to(dtype).to(tl.float32)
    if FP8_MAX > 0:
        c_kv = tl.clamp(c_kv, -FP8_MAX, FP8_MAX)
        k_pe1 = tl.clamp(k_pe1, -FP8_MAX, FP8_MAX)
        k_pe2 = tl.clamp(k_pe2, -FP8_MAX, FP8_MAX)
    tl.store(dst + r, c_kv.to(cache_dtype), mask=rmask)
    tl.store(dst + RANK + 2 * d, k_pe1.to(cache_dtype), mask=dmask)
    tl.store(dst + RANK + 2 * d + 1, k_pe2.to(cache_dtype), mask=dmask)

    h = tl.arange(0, BLOCK_H)
    m = (h < NUM_HEADS)[:, None] & dmask[None, :]
    q_src = q_pe_ptr + t * stride_qt + h.to(tl.int64)[:, None] * stride_qh
    q1 = tl.load(q_src + 2 * d[None, :], mask=m, other=0.0).to(tl.float32)
    q2 = tl.load(q_src + 2 * d[None, :] + 1, mask=m, other=0.0).to(tl.float32)
    tl.store(q_src + 2 * d[None, :], (q1 * cos[None, :] - q2 * sin[None, :]).to(dtype), mask=m)
    tl.store(q_src + 2 * d[None, :] + 1, (q2 * cos[None, :] + q1 * sin[None, :]).to(dtype), mask=m)


@functools.cache
def _kernel():
    # jit-ed on first use: the Triton interpreter is chosen at decoration time (see fused_ops).
    return triton.jit(_mla_latent_kernel)


def write_latent_cache(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``latent [T, D]`` into plane 0 of ``kv_cache [1, num_blocks, block_size, 1,
    D]``; padding slots (-1) write into the reserved null block's slot 0 (no host sync).
    An FP8 cache stores the latents saturated to e4m3 with scale 1.0 (readers convert
    back to the query dtype)."""
    flat = kv_cache[0].view(-1, kv_cache.shape[-1])
    latent = quantize_kv(latent, 1.0, kv_cache.dtype).to(kv_cache.dtype)
    if kv_cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no float8 CPU kernel: copy the bytes
        flat, latent = flat.view(torch.uint8), latent.view(torch.uint8)
    flat.index_copy_(0, slot_mapping.clamp(min=0), latent)


def write_latents(q_pe: torch.Tensor, kv: torch.Tensor, kv_a_layernorm: RMSNorm, cos: torch.Tensor,
                  sin: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, *, mode: str = "auto") -> torch.Tensor:
    """Normalise, rotate and cache the new tokens' latents; rotate their ``q_pe``.

    Args:
        q_pe: ``[T, heads, rope]`` query RoPE part (any strides with a unit last one, e.g.
            a view of the ``q_proj`` output); rotated in place on the kernel path.
        kv: ``[T, kv_lora_rank + rope]`` ``kv_a_proj_with_mqa`` output (unit last stride),
            q_pe's dtype.
        kv_a_layernorm: the RMSNorm over ``kv[:, :kv_lora_rank]``.
        cos, sin: ``[max_positions, rope / 2]`` RoPE tables.
        positions: ``[T]`` token positions (in ``[0, max_positions)``, unchecked: no sync).
        kv_cache: ``[1, num_blocks, block_size, 1, kv_lora_rank + rope]`` contiguous, q_pe's
            dtype or ``float8_e4m3fn``.
        slot_mapping: ``[T]`` cache slots, -1 for padding tokens.
        mode: the caller's fused-ops mode (:func:`tandem.layers.fused_ops.use_triton` of
            ``kv``): the kernel or the torch reference.

    Returns:
        The rotated ``q_pe`` (``q_pe`` itself on the kernel path, a new tensor otherwise).

    Raises:
        ValueError: (kernel path) shapes, dtypes or strides the kernel does not take; an
            unknown ``mode``.
    """
    rank = kv_a_layernorm.weight.shape[0]
    if not fused_ops.use_triton(kv, mode):
        # The ops' torch references: in a mode and on a device where this kernel does not run,
        # neither do theirs.
        c_kv, k_pe = kv.split([rank, kv.shape[-1] - rank], dim=-1)
        q_pe, k_pe = apply_rotary_ref(q_pe, k_pe[:, None], cos, sin, positions, interleaved=True)
        c_kv = rms_norm_ref(c_kv, kv_a_layernorm.weight, kv_a_layernorm.eps)
        write_latent_cache(torch.cat((c_kv, k_pe[:, 0]), dim=-1), kv_cache, slot_mapping)
        return q_pe
    t, heads, rope = q_pe.shape
    if (kv.shape != (t, rank + rope) or kv_cache.shape[-1] != rank + rope or rope % 2
            or cos.shape[1] * 2 != rope or sin.shape != cos.shape or positions.shape != (t,)
            or slot_mapping.shape != (t,)):
        raise ValueError(f"write_latents: q_pe {tuple(q_pe.shape)}, kv {tuple(kv.shape)}, kv_cache "
                         f"{tuple(kv_cache.shape)}, cos {tuple(cos.shape)}, positions {tuple(positions.shape)}, "
                         f"slot_mapping {tuple(slot_mapping.shape)} do not fit kv_lora_rank {rank}")
    if kv.dtype != q_pe.dtype or kv_cache.dtype not in (q_pe.dtype, torch.float8_e4m3fn):
        raise ValueError(f"write_latents: dtypes q_pe={q_pe.dtype} kv={kv.dtype} kv_cache={kv_cache.dtype}")
    if q_pe.stride(-1) != 1 or kv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 \
            or not kv_cache.is_contiguous():
        raise ValueError("write_latents: q_pe, kv, cos, sin need a unit last stride and kv_cache contiguity")
    if t == 0:
        return q_pe
    kernel = _kernel()
    fused_ops._check_launch(kernel, q_pe, kv, kv_cache)
    w = kv_a_layernorm.weight
    half = rope // 2
    kernel[(t,)](
        q_pe, kv, w, cos, sin, positions, slot_mapping, kv_cache,
        q_pe.stride(0), q_pe.stride(1), kv.stride(0), cos.stride(0), sin.stride(0), float(kv_a_layernorm.eps),
        NUM_HEADS=heads, BLOCK_H=triton.next_power_of_2(heads), RANK=rank, BLOCK_R=triton.next_power_of_2(rank),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        FP8_MAX=_FP8_MAX if kv_cache.dtype == torch.float8_e4m3fn else 0.0, num_warps=4,
    )
    return q_pe
