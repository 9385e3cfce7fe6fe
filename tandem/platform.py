"""What the device computes natively, and the model dtype ``dtype="auto"`` resolves to.

One place for the decision (read by ``EngineConfig.torch_dtype``):

- CUDA: bfloat16.
- CPU with native bfloat16 matrix arithmetic (AMX-BF16 or AVX512-BF16, where oneDNN runs
  bf16 GEMMs several times faster than MKL's fp32 ones): bfloat16 for checkpoints that are
  16-bit or quantized (a ``torch_dtype``/``dtype`` of bfloat16 or float16 in the HF config,
  or a GGUF file), as vLLM's CPU backend runs bf16 by default. An fp32 checkpoint, or one
  that declares no dtype (the tiny random models of the tests), stays fp32: exact, and
  what the checkpoint asked for.
- Any other CPU: float32 (bf16 arithmetic would be emulated, slower than fp32).
"""

from __future__ import annotations

import functools

import torch

_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """The CPU has AMX tiles or AVX512-BF16 (bf16 GEMMs run natively in oneDNN)."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, p, lambda: False)() for p in probes)


def declared_dtype(hf_config) -> torch.dtype | None:
    """The dtype a HF config declares (``dtype``, or the older ``torch_dtype``), or None."""
    fields = vars(hf_config)  # not getattr: transformers warns on reading ``torch_dtype``
    for name in ("dtype", "torch_dtype"):
        value = fields.get(name)
        if isinstance(value, str):
            value = getattr(torch, value, None)
        if isinstance(value, torch.dtype):
            return value
    return None


def auto_dtype(device: torch.device, model: str | None) -> torch.dtype:
    """The model dtype of ``dtype="auto"`` on ``device`` for the checkpoint at ``model``
    (see the module docstring). ``model`` None or unreadable counts as an fp32 checkpoint."""
    if device.type == "cuda":
        return torch.bfloat16
    if device.type != "cpu" or model is None or not cpu_has_native_bf16():
        return torch.float32
    from tandem.model_loader.loader import is_gguf, load_hf_config

    if is_gguf(model):
        return torch.bfloat16
    try:
        declared = declared_dtype(load_hf_config(model))
    except (ValueError, OSError):
        return torch.float32
    return torch.bfloat16 if declared in _HALF else torch.float32


__all__ = ["auto_dtype", "cpu_has_native_bf16", "declared_dtype"]
