"""The decoder's RMSNorms as one-pass C++ kernels on the CPU (``tandem/csrc/cpu_ops.cpp``).

At decode sizes a CPU step is bound by per-op overhead, not arithmetic: ``F.rms_norm``
dispatches several ops, and each one that enters an OpenMP region wakes the pool's other
threads, ~30 us per norm of 576 values inside a step of the embedded model. The kernels run
a few rows on the calling thread (rows in tasks of 16 over torch's pool for a prompt), with
the arithmetic of :func:`tandem.layers.fused_ops.rms_norm_ref` (the sum of squares in another
order: fp32 results may differ in the last bits; 16-bit results round as the reference does).

The source is built on first use by ``torch.utils.cpp_extension.load`` (g++ and ninja, ~15 s)
into torch's extensions folder (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``)
and loaded from there afterwards (a rebuild only when the source or torch changes). Where the
build fails (no compiler), :func:`available` says so once in the log and the fused ops keep
the torch references. :func:`tandem.layers.fused_ops.resolve_mode` decides it once per model.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_ops.cpp"
_EXTENSION = "tandem_cpu_ops"

_lock = threading.Lock()
_loaded: bool | None = None


def available() -> bool:
    """Whether the kernels are loaded in this process, building them on the first call
    (thread-safe; later calls return the first answer). A failed build is logged once as a
    warning with its first line, and answered False."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> bool:
    try:
        from torch.utils.cpp_extension import load  # imports setuptools: only when building

        load(name=_EXTENSION, sources=[str(SOURCE)], extra_cflags=["-O3"], is_python_module=False)
    except Exception as e:  # noqa: BLE001 - any build failure falls back to the torch ops
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
        logger.warning("the C++ CPU kernels (%s) could not be built (%s): the RMSNorms run as torch ops",
                       SOURCE.name, first)
        return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * round(x * rsqrt(mean(x^2) + eps))`` over the last dim of ``x [..., N]``
    (fp32/fp16/bf16, any strides) -> a new contiguous tensor of x's shape and dtype.

    Raises:
        RuntimeError: :func:`available` is False, a tensor not on the CPU, or a ``weight``
            that is not ``[N]`` of x's dtype.
    """
    return torch.ops.tandem_cpu.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual`` (rounded to the dtype), ``(rms_norm(r, weight, eps), r)``, new
    contiguous tensors.

    Raises:
        RuntimeError: as :func:`rms_norm`, or a ``residual`` of another shape or dtype.
    """
    return torch.ops.tandem_cpu.fused_add_rms_norm(x, residual, weight, eps)


__all__ = ["SOURCE", "available", "fused_add_rms_norm", "rms_norm"]
