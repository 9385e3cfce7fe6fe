"""Allocation of the paged KV cache tensors."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Vector loads and the GEMM kernels' packing want cache-line-aligned rows.
_ALIGN_BYTES = 64


def _zeros_on_demand(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose pages are zeroed by the kernel when first touched.

    ``torch.zeros`` writes every byte up front: for a 1 GiB CPU cache that is a page fault
    and a memset per page at start-up, for blocks most runs never use. ``calloc`` (numpy's
    ``zeros``) hands out fresh anonymous pages for large sizes, which read as zero and cost
    nothing until written (in a process whose heap holds no large freed block; one that has
    run for a while may be given resident memory, zeroed up front).
    """
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buf = np.zeros(nbytes + _ALIGN_BYTES, dtype=np.uint8)
    offset = -buf.ctypes.data % _ALIGN_BYTES
    return torch.from_numpy(buf[offset:offset + nbytes]).view(dtype).view(tuple(shape))


def commit_kv_caches(kv_caches: Sequence[torch.Tensor]) -> None:
    """Make every page of the CPU tensors among ``kv_caches`` resident now (GPU ones are).

    A CPU cache is zeroed on demand (:func:`_zeros_on_demand`), which suits a short offline
    run; a server's prefix cache, though, writes every block within its first minutes of
    load (freed blocks keep their contents and queue behind the others), so its RSS would
    climb by the whole cache while serving. A process that serves until stopped commits the
    cache at start instead: its RSS from the first request on is its footprint (the cost of
    committing: benchmarks/RESULTS.md, "engine core memory").
    """
    for cache in kv_caches:
        if cache.device.type == "cpu":
            cache.zero_()


def allocate_kv_caches(num_layers: int, shape: Sequence[int], dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed KV cache tensor of ``shape`` (``[planes, num_blocks, block_size,
    num_kv_heads, head_dim]``) and ``dtype`` per layer, on ``device``.

    Zeroed because attention kernels may read a block's unwritten slots before masking
    them, and uninitialised memory can hold NaN (NaN times a zero weight is NaN).
    """
    if device.type == "cpu":
        return [_zeros_on_demand(shape, dtype) for _ in range(num_layers)]
    return [torch.zeros(*shape, dtype=dtype, device=device) for _ in range(num_layers)]
