"""Pieces shared by Tandem's Triton kernels (paged attention, MLA decode, fused MoE).

* :func:`dot`: ``a @ b`` accumulated in fp32 inside a kernel; ``UPCAST`` works around the
  interpreter's bf16 dot.
* :data:`INTERPRET`: whether the kernels run in Triton's CPU interpreter
  (``TRITON_INTERPRET=1`` when Triton was imported).
* :func:`num_sms`: streaming multiprocessors of a CUDA device (cached), to size split grids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32 (UPCAST works around the interpreter's bf16 dot)."""
    if UPCAST:
        res = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    else:
        res = tl.dot(a, b, input_precision=PRECISION)
    return res


def _interpreting() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return False
    return isinstance(dot, InterpretedFunction)


INTERPRET = _interpreting()
_NUM_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device`` (read once per device)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]
