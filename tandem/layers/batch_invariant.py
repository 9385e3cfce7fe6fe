"""Batch-invariant execution (``--deterministic``): a row's result does not depend on the
other rows computed with it.

A GEMM library picks its kernel, blocking and thread split from the matrix shapes, so the
sum behind one output row can be ordered differently when the batch has another row count
("Defeating Nondeterminism in LLM Inference", Thinking Machines, 2025). Measured on the
CPU (torch 2.13): MKL's fp32 GEMM gives other bits for 1, 2, 3, 5, 6, 7, 9, 10 and 11 rows
than for 4, 8 or 12 and more. In deterministic mode every CPU matmul of the model therefore
runs on blocks of exactly :data:`ROW_BLOCK` rows (the last one padded with zeros): each
row is computed by a call of the one shape, whatever the batch (the MoE router and experts
too, :mod:`tandem.layers.moe`). On CUDA, where cuBLAS also picks its kernel and split-K
from the row count, the matmuls run a Triton GEMM instead
(:func:`tandem.layers.matmul_triton.matmul_batch_invariant`: one tile configuration per
``(N, K, dtype)``, no split-K, one compiled variant for every row count). Row-wise
operations (RMSNorm, SiLU, RoPE, softmax) already reduce each row alone in a fixed order.
Not covered: FP8 GEMMs (their library kernels are kept).

The mode is one process-wide switch, set by the worker from ``ModelConfig.deterministic``
before the model is built (:func:`set_enabled`); kernels read it with :func:`enabled`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

ROW_BLOCK = 16
"""Rows per GEMM call in deterministic mode (at least the 12 rows from which MKL's fp32
kernel no longer changes with the row count; a multiple of the AVX-512 tiles)."""

_enabled = False


def enabled() -> bool:
    """Whether batch-invariant (deterministic) execution is on in this process."""
    return _enabled


def set_enabled(on: bool) -> None:
    """Switch batch-invariant execution on or off for the models run in this process."""
    global _enabled
    logger.info("Deterministic (batch-invariant) execution: %s", "on" if on else "off")
    _enabled = bool(on)


def row_blocked(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, out_features: int) -> torch.Tensor:
    """``fn`` (a row-wise map ``[M, K] -> [M, N]``, e.g. a GEMM) on ``x [..., K]`` computed
    :data:`ROW_BLOCK` rows at a time, the last block padded with zero rows, so that every
    row goes through a call of shape ``[ROW_BLOCK, K]``. Returns ``[..., out_features]``."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    padded = -(-m // ROW_BLOCK) * ROW_BLOCK
    if padded != m:
        x2 = torch.cat([x2, x2.new_zeros(padded - m, k)])
    else:
        x2 = x2.contiguous()
    blocks = [fn(x2[i:i + ROW_BLOCK]) for i in range(0, padded, ROW_BLOCK)]
    out = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
    return out[:m].reshape(*lead, out_features)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; batch-invariant when the mode is on: on CUDA through
    :func:`~tandem.layers.matmul_triton.matmul_batch_invariant` (fp16 / bf16 / fp32; it
    raises ValueError for other dtypes), on the CPU through :func:`row_blocked`. Other
    devices keep ``F.linear``."""
    if not _enabled or x.shape[:-1].numel() == 0:
        return torch.nn.functional.linear(x, weight, bias)
    if x.is_cuda:
        from tandem.layers.matmul_triton import matmul_batch_invariant  # lazy: Triton is optional (CPU installs)

        return matmul_batch_invariant(x, weight, bias)
    if x.device.type != "cpu":
        return torch.nn.functional.linear(x, weight, bias)
    return row_blocked(lambda rows: torch.nn.functional.linear(rows, weight, bias), x, weight.shape[0])
