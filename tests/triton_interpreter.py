"""Helpers for running Triton kernels in the interpreter on CPU-only machines.

A test module that runs kernels calls :func:`triton_test_setup` before importing anything
that decorates them::

    from tests.triton_interpreter import triton_test_setup
    DEVICE, INTERPRET = triton_test_setup("tandem.attention.triton_mla")
    from tandem.attention.triton_mla import mla_decode_attention  # noqa: E402
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch


def triton_test_setup(kernel_module: str | None = None, bf16_rounding: bool = False,
                      fp8_rounding: bool = False) -> tuple[torch.device, bool]:
    """Without CUDA, set ``TRITON_INTERPRET=1`` (the interpreter is chosen per ``@triton.jit``
    at decoration time) and patch the interpreter (``bf16_rounding``: also its fp32 -> bf16
    rounding, where bf16 results are compared tightly; ``fp8_rounding``: its fp32 -> e4m3
    rounding, where FP8 results are compared bit for bit). Skip the calling test module when
    Triton is missing, or when ``kernel_module`` was imported, so decorated, before the flag
    was set (run such a module on its own). Returns ``(device, interpreting)``."""
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    pytest.importorskip("triton")
    if interpret:
        patch_interpreter_for_numpy_2_4()
        if bf16_rounding:
            patch_interpreter_bf16_rounding()
        if fp8_rounding:
            patch_interpreter_fp8_rounding()
        if kernel_module is not None and not importlib.import_module(kernel_module)._INTERPRET:
            pytest.skip(f"{kernel_module} was imported before TRITON_INTERPRET was set; run this module on its own",
                        allow_module_level=True)
    return torch.device("cpu" if interpret else "cuda"), interpret


def patch_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns scalar tensors (1-element arrays) into Python ints
    with ``int(array)``, which NumPy >= 2.4 rejects ("only 0-dimensional arrays can be
    converted to Python scalars", triton-lang/triton#9171); this breaks ``range()`` over
    loaded values. Re-patch ``__index__`` with ``.item()`` after the interpreter's patch."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_tandem_patched", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._tandem_patched = True
    interpreter._patch_lang_tensor = patched


def patch_interpreter_bf16_rounding() -> None:
    """Triton 3.6's interpreter converts fp32 to bf16 by truncating the mantissa (a plain
    ``x.to(tl.bfloat16)``, which compiles to a round-to-nearest-even ``cvt.rn``), and its
    explicit RTNE path rounds half up without carrying into the exponent. Convert with torch
    (round to nearest even, as the GPU and ``tensor.to(torch.bfloat16)`` do) unless
    round-toward-zero is asked for explicitly."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    orig = interpreter._convert_float
    if getattr(orig, "_tandem_patched", False):
        return

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode != ir.ROUNDING_MODE.RTZ:
            src = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            return src.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(input.shape)
        return orig(input, input_dtype, output_dtype, rounding_mode)

    convert._tandem_patched = True
    interpreter._convert_float = convert


def patch_interpreter_fp8_rounding() -> None:
    """Triton 3.6's interpreter converts fp32 to e4m3 (``float8e4nv``) by truncating the
    mantissa and mishandles mantissa carries (-127.1 -> -64). Convert as the GPU's
    ``cvt.rn.satfinite.e4m3x2.f32`` does: round to nearest even (torch's conversion) after
    saturating to +-448 (where torch's would give NaN)."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    orig = interpreter._convert_float
    if getattr(orig, "_tandem_fp8_patched", False):
        return

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            src = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            fmax = torch.finfo(torch.float8_e4m3fn).max
            return src.clamp(-fmax, fmax).to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(input.shape)
        return orig(input, input_dtype, output_dtype, rounding_mode)

    convert._tandem_fp8_patched = True
    convert._tandem_patched = getattr(orig, "_tandem_patched", False)
    interpreter._convert_float = convert
