"""Pieces shared by Tandem's Triton kernels (paged attention, MLA decode, fused MoE).

* :func:`dot`: ``a @ b`` accumulated in fp32 inside a kernel; ``UPCAST`` works around the
  interpreter's bf16 dot.
* :data:`INTERPRET`: whether the kernels run in Triton's CPU interpreter
  (``TRITON_INTERPRET=1`` when Triton was imported).
* :func:`num_sms`: streaming multiprocessors of a CUDA device (cached), to size split grids.
* :func:`program_slots`: programs a device runs at once, for split-KV decode grids.
* :func:`record_jit_compiles`: the kernel specialisations first launched while it is
  active (what a benchmark's warm-up missed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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


def program_slots(device: torch.device, programs_per_sm: int) -> int:
    """Programs ``device`` runs at once when ``programs_per_sm`` fit an SM (what a
    kernel's registers and shared memory allow); 256 off CUDA (the interpreter), so that
    tests see GPU-like split counts."""
    return programs_per_sm * num_sms(device) if device.type == "cuda" else 256


@contextlib.contextmanager
def record_jit_compiles() -> Iterator[list[str]]:
    """Collect, in the yielded list, one description (kernel name, then the arguments it
    was specialised on: constants, and attributes such as 16-divisibility) per Triton
    kernel variant this process builds while the context is active: every in-memory cache
    miss of a ``triton.jit`` function, whether the binary then comes from Triton's disk
    cache or a fresh compile. Chains any
    ``triton.knobs.runtime.jit_cache_hook`` already set and restores it on exit. The
    interpreter (``TRITON_INTERPRET=1``) builds nothing, so the list stays empty there.
    """
    knobs = triton.knobs.runtime
    previous = knobs.jit_cache_hook
    seen: list[str] = []

    def hook(*args, **kwargs):
        seen.append(_variant_name(kwargs))
        return previous(*args, **kwargs) if previous is not None else False

    knobs.jit_cache_hook = hook
    try:
        yield seen
    finally:
        knobs.jit_cache_hook = previous


def _variant_name(hook_kwargs: dict) -> str:
    name = str(hook_kwargs.get("repr", "?")).split("[", 1)[0]
    compiled = hook_kwargs.get("compile") or {}
    params = list((compiled.get("signature") or {}).keys())

    def named(specs: dict) -> str:
        return ", ".join(f"{params[k[0]] if isinstance(k, tuple) and k and k[0] < len(params) else k}={v}"
                         for k, v in specs.items())

    configs = compiled.get("configs") or [{}]
    constants = {k: v for k, v in (compiled.get("constants") or {}).items()
                 if not isinstance(k, str)}  # argument paths ((index,), constexprs included); not other keys
    parts = [p for p in (named(constants), named(configs[0] or {})) if p]
    return f"{name}({'; '.join(parts)})"
