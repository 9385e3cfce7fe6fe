"""The paged KV cache (vLLM's ``CacheConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tandem.config.utils import check_choices

CacheDType = Literal["auto", "fp8", "fp8_e4m3"]


@dataclass
class CacheConfig:
    """Block size, size and dtype of the paged KV cache, and prefix caching."""

    block_size: int = 16
    """Tokens per KV cache block (a power of two)."""

    num_kv_blocks: int | None = None
    """KV cache size in blocks (block 0 is reserved). None: from gpu_memory_utilization on
    CUDA, kv_cache_memory_gib on the CPU."""

    kv_cache_memory_gib: float = 1.0
    """KV cache size in GiB on the CPU (when num_kv_blocks is None), per rank: each tensor-
    or pipeline-parallel rank process holds its own (vLLM's VLLM_CPU_KVCACHE_SPACE)."""

    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory for weights, peak activations and the KV cache."""

    enable_prefix_caching: bool = True
    """Reuse the KV blocks of identical prompt prefixes."""

    kv_cache_dtype: CacheDType = "auto"
    """auto: the model dtype; fp8 or fp8_e4m3: float8_e4m3fn paged KV cache (per-layer scales
    from the checkpoint, else 1.0, as vLLM)."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}.")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be positive, got {self.kv_cache_memory_gib}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
