"""Rotary position embedding (RoFormer, Su et al. 2021), NeoX layout (halves rotated).

Inverse frequencies come from transformers' RoPE initialisers, so every scaling type a
checkpoint declares (llama3, yarn, linear, dynamic, longrope) matches the reference.
MLA (:mod:`tandem.layers.mla`) uses the same ``cos``/``sin`` tables with the interleaved
pair layout (``apply_rotary(..., interleaved=True)``).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.layers.fused_ops import apply_rotary


def rope_parameters(hf_config) -> dict:
    """RoPE settings of a HF config, for transformers 4.x (``rope_theta`` +
    ``rope_scaling``) and 5.x (``rope_parameters``) alike."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return params


def compute_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Returns (inverse frequencies ``[head_dim // 2]`` fp32, attention scaling)."""
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q ``[T, Hq, D]`` and k ``[T, Hk, D]`` at integer ``positions [T]``.

    cos/sin ``[max_positions, D/2]`` are precomputed in fp32; the rotation is computed in
    fp32 and cast to the input dtype, as one fused kernel on CUDA (outputs are new
    contiguous tensors; see :func:`tandem.layers.fused_ops.apply_rotary`).
    """

    def __init__(self, hf_config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, scaling = compute_inv_freq(hf_config, head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, k, self.cos, self.sin, positions)
