"""Rotary position embedding (RoFormer, Su et al. 2021), NeoX layout (halves rotated).

Inverse frequencies come from transformers' RoPE initialisers, so every scaling type a
checkpoint declares (llama3, yarn, linear, dynamic, longrope) matches the reference.
"""

from __future__ import annotations

import torch
from torch import nn


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

    cos/sin are precomputed for ``max_positions`` positions (fp32, cast to the input dtype).
    """

    def __init__(self, hf_config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, scaling = compute_inv_freq(hf_config, head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
