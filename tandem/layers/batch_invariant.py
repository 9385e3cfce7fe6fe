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

The mode belongs to a model, not to the process: it is decided once, from
``ModelConfig.deterministic``, and handed over when the model is built. The attention
backend takes it as a constructor argument (``deterministic``); the loader builds the
model inside :func:`building` with its backend's mode
(:func:`tandem.model_loader.loader.build_model`), and every layer that computes
differently in the mode reads :func:`build_mode` once in its constructor and keeps it as
its ``deterministic`` attribute. Nothing reads a mode at forward time, so two engines of
one process may run in different modes.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch

ROW_BLOCK = 16
"""Rows per GEMM call in deterministic mode (at least the 12 rows from which MKL's fp32
kernel no longer changes with the row count; a multiple of the AVX-512 tiles)."""

# A context variable, not a module flag: it is set only while a model is constructed, and
# each thread (an engine's step thread) and asyncio task sees its own value.
_build_mode: contextvars.ContextVar[bool] = contextvars.ContextVar("tandem_deterministic_build", default=False)


@contextlib.contextmanager
def building(deterministic: bool) -> Iterator[None]:
    """Construct layers in (or out of) deterministic mode: each layer built inside the block
    keeps ``deterministic`` as its own mode (:func:`build_mode`). The previous value is back
    on exit; blocks nest."""
    token = _build_mode.set(bool(deterministic))
    try:
        yield
    finally:
        _build_mode.reset(token)


def build_mode() -> bool:
    """The deterministic mode of the model under construction (the innermost
    :func:`building` block of this thread; False outside any). For layer constructors:
    a forward uses the layer's own ``deterministic`` attribute."""
    return _build_mode.get()


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           deterministic: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x [..., K]``, ``weight [N, K]``, ``bias [N]`` ->
    ``[..., N]``); batch-invariant when ``deterministic`` (a layer passes its own mode): on
    CUDA through :func:`~tandem.layers.matmul_triton.matmul_batch_invariant` (fp16 / bf16 /
    fp32; it raises ValueError for other dtypes), on the CPU through :func:`row_blocked`.
    Other devices, and ``deterministic=False``, keep ``F.linear``."""
    if not deterministic or x.shape[:-1].numel() == 0:
        return torch.nn.functional.linear(x, weight, bias)
    if x.is_cuda:
        from tandem.layers.matmul_triton import matmul_batch_invariant  # lazy: Triton is optional (CPU installs)

        return matmul_batch_invariant(x, weight, bias)
    if x.device.type != "cpu":
        return torch.nn.functional.linear(x, weight, bias)
    return row_blocked(lambda rows: torch.nn.functional.linear(rows, weight, bias), x, weight.shape[0])
