"""Attention backend interface (selection: :mod:`tandem.attention.selector`)."""

from __future__ import annotations

from typing import Protocol

import torch

from tandem.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Writes a step's new K/V into the paged cache, then attends over the cache.

    ``forward(q, k, v, kv_cache, meta, scale)``:
        q: ``[num_tokens, num_heads, head_dim]``; k, v: ``[num_tokens, num_kv_heads,
        head_dim]`` (same dtype as the cache); kv_cache: ``[2, num_blocks, block_size,
        num_kv_heads, head_dim]``; scale: softmax scale (usually ``head_dim ** -0.5``).
        Returns ``[num_tokens, num_heads, head_dim]``. ``num_heads`` must be a multiple of
        ``num_kv_heads`` (grouped-query attention).

    A float8_e4m3fn cache (``--kv-cache-dtype fp8``) stores ``k / k_scale`` and ``v /
    v_scale`` (per-layer floats, vLLM's ``k_scale`` / ``v_scale``); attention reads them
    back times the scales.

    ``deterministic`` (set when the backend is built, from ``ModelConfig.deterministic``):
    a token's output must not depend on the batch or the phase it is computed in (the
    batch-invariant mode of :mod:`tandem.layers.batch_invariant`); the model built over the
    backend takes the same mode (:func:`tandem.model_loader.loader.build_model`).
    """

    name: str
    deterministic: bool

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor: ...


def quantize_kv(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the cache's dtype: for an FP8 cache ``x / scale`` saturated to +-448 (vLLM's
    ``scaled_fp8_conversion``), else ``x`` unchanged."""
    if cache_dtype != torch.float8_e4m3fn:
        return x
    fmax = torch.finfo(cache_dtype).max
    # A tensor divisor: torch's CUDA division by a Python scalar multiplies by its
    # reciprocal, which rounds differently from the kernels' (and the CPU's) true division.
    return (x.float() / torch.full((), scale, device=x.device)).clamp(-fmax, fmax).to(cache_dtype)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter new keys/values ``[num_tokens, num_kv_heads, head_dim]`` into their slots
    (quantized with :func:`quantize_kv` for an FP8 cache).

    Padding tokens (slot -1) write into slot 0, which belongs to the reserved null block
    (block 0 is never handed to a request), so the call has no host sync and a fixed
    shape (CUDA-graph safe).
    """
    write_kv_cache_at(k, v, kv_cache, slot_mapping.clamp(min=0), k_scale, v_scale)


def write_kv_cache_at(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """:func:`write_kv_cache` given the clamped slot mapping ``slots [num_tokens]`` int64
    (padding at slot 0), which a backend can compute once per step for every layer."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    k, v = quantize_kv(k, k_scale, kv_cache.dtype), quantize_kv(v, v_scale, kv_cache.dtype)
    if kv_cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no float8 CPU kernel: copy the bytes
        flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)
