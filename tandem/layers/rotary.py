"""Rotary position embedding (RoFormer, Su et al. 2021), NeoX layout (halves rotated).

Inverse frequencies come from transformers' RoPE initialisers, so every scaling type a
checkpoint declares (llama3, yarn, linear, dynamic, longrope) matches the reference.
MLA (:mod:`tandem.layers.mla`) uses the same ``cos``/``sin`` tables with the interleaved
pair layout (``apply_rotary(..., interleaved=True)``).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.layers import cpu_ops, fused_ops
from tandem.layers.fused_ops import apply_rotary, use_triton


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
    contiguous tensors; see :func:`tandem.layers.fused_ops.apply_rotary`), in the fused-ops
    mode of the model it is built in (kept as ``fused_ops_mode``).

    On the CPU (torch ops, one kernel each) the rotation takes the full-width tables
    ``[cos, cos]`` and ``[-sin, sin]`` at the step's positions, gathered once per forward
    when the model calls :meth:`begin_step` (every layer rotates at the same positions):
    ``x * cos2 + roll(x, D/2) * sin2``, 5 ops per tensor and the same bits as
    :func:`~tandem.layers.fused_ops.apply_rotary_ref` (``x1 cos + x2 (-sin)`` is
    ``x1 cos - x2 sin`` exactly). In fused-ops mode ``cpu`` one C++ op does the same
    arithmetic on the fp32 tables directly
    (:func:`tandem.layers.cpu_ops.rotary_embedding_neox`), the same bits again.
    """

    def __init__(self, hf_config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, scaling = compute_inv_freq(hf_config, head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)
        # begin_step's positions and their [T, 1, D] tables (CPU path).
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # The model's mode, fixed at build time (tandem.layers.fused_ops.building).
        self.fused_ops_mode = fused_ops.build_mode()

    def begin_step(self, positions: torch.Tensor) -> None:
        """Gather the CPU path's tables for a forward at ``positions [T]`` (CUDA and the C++
        kernel: nothing)."""
        self._step = (None if use_triton(positions, self.fused_ops_mode) or positions.is_cuda or self._cpu_kernel()
                      else (positions, *self._tables(positions)))

    def _cpu_kernel(self) -> bool:
        # The kernel reads fp32 tables: a module cast to another dtype keeps the torch ops.
        return self.fused_ops_mode == "cpu" and self.cos.dtype == torch.float32 and not self.cos.is_cuda

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, s = self.cos[positions], self.sin[positions]
        return torch.cat([c, c], -1).unsqueeze(1), torch.cat([-s, s], -1).unsqueeze(1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if use_triton(q, self.fused_ops_mode) or q.is_cuda:
            return apply_rotary(q, k, self.cos, self.sin, positions, mode=self.fused_ops_mode)
        if self._cpu_kernel():
            return (cpu_ops.rotary_embedding_neox(positions, q, self.cos, self.sin),
                    cpu_ops.rotary_embedding_neox(positions, k, self.cos, self.sin))
        cos2, sin2 = self._step_tables(positions)
        return _rotate_neox(q, cos2, sin2), _rotate_neox(k, cos2, sin2)

    def forward_qk(self, positions: torch.Tensor, qk: torch.Tensor, num_q_heads: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` of q and k given as one tensor ``qk [T, Hq + Hk, D]`` (q's heads
        first, e.g. a view of the fused q/k/v projection): returns (q ``[T, Hq, D]``, k
        ``[T, Hk, D]``), the same bits. On the CPU both are rotated by one set of ops (5
        instead of 10 dispatched per layer)."""
        if use_triton(qk, self.fused_ops_mode) or qk.is_cuda:
            q, k = qk.split([num_q_heads, qk.shape[1] - num_q_heads], dim=1)
            return apply_rotary(q, k, self.cos, self.sin, positions, mode=self.fused_ops_mode)
        if self._cpu_kernel():
            return cpu_ops.rotary_embedding_neox(positions, qk, self.cos, self.sin).split(
                [num_q_heads, qk.shape[1] - num_q_heads], dim=1)
        cos2, sin2 = self._step_tables(positions)
        return _rotate_neox(qk, cos2, sin2).split([num_q_heads, qk.shape[1] - num_q_heads], dim=1)

    def _step_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        step = self._step
        return step[1:] if step is not None and step[0] is positions else self._tables(positions)


def _rotate_neox(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    # The fp32 tables promote each product to fp32 (a 16-bit x widens exactly): no cast of x.
    out = x * cos2
    out += torch.roll(x, x.shape[-1] // 2, -1) * sin2
    return out.to(x.dtype)
