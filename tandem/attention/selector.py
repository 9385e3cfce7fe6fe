"""Attention backend selection: imports the backends, which import only the interface
(:mod:`tandem.attention.backend`), so choosing one adds no import circle."""

from __future__ import annotations

import torch

from tandem.attention.backend import AttentionBackend
from tandem.attention.torch_backend import TorchAttentionBackend


def get_attention_backend(device: torch.device, max_model_len: int | None = None,
                          deterministic: bool = False, cpu_kernels: bool = False) -> AttentionBackend:
    """Torch backend on the CPU, Triton kernels on CUDA; batch-invariant with
    ``deterministic`` (``ModelConfig.deterministic``). ``cpu_kernels``: the CPU backend's
    decode attention by the C++ kernel (the model's fused-ops mode is ``cpu``)."""
    if device.type == "cuda":
        # Imported on use: Triton is optional on CPU-only installs.
        from tandem.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(max_model_len=max_model_len, deterministic=deterministic)
    return TorchAttentionBackend(deterministic=deterministic, cpu_kernels=cpu_kernels)
