"""RMSNorm (Zhang & Sennrich 2019), computed in fp32 as the HF reference does."""

from __future__ import annotations

import torch
from torch import nn

from tandem.layers import fused_ops
from tandem.layers.fused_ops import fused_add_rms_norm, rms_norm, rms_norm_dynamic_per_token_quant
from tandem.layers.quantization.fp8 import QuantizedActivation, UnscaledProduct


class RMSNorm(nn.Module):
    """``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dim.

    ``forward(x)`` returns the normalised tensor; ``forward(x, residual)`` first adds the
    residual (in the input dtype) and returns ``(norm(x + residual), x + residual)``, as one
    fused kernel on CUDA (see :mod:`tandem.layers.fused_ops` for the dispatch: the layer
    keeps the fused-ops mode of the model it is built in as ``fused_ops_mode``).
    :meth:`forward_fp8` returns the same result quantized to FP8 per token for an FP8 linear.
    ``x`` may be an FP8 GEMM's :class:`UnscaledProduct` ``[T, N]``: the kernel applies its
    scales (as ``x.apply_scales()``) before the add.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # The model's mode, fixed at build time (tandem.layers.fused_ops.building).
        self.fused_ops_mode = fused_ops.build_mode()

    def forward(self, x: torch.Tensor | UnscaledProduct, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps, mode=self.fused_ops_mode)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, mode=self.fused_ops_mode)

    def forward_fp8(self, x: torch.Tensor | UnscaledProduct, residual: torch.Tensor | None = None
                    ) -> tuple[QuantizedActivation, torch.Tensor | None]:
        """The forward's normalized ``x [T, N]`` quantized to FP8 with per-token scales in
        the same kernel (:func:`~tandem.layers.fused_ops.rms_norm_dynamic_per_token_quant`),
        and the new residual ``x + residual`` (None without ``residual``)."""
        q, scale, residual_out = rms_norm_dynamic_per_token_quant(x, self.weight, self.eps, residual,
                                                                  mode=self.fused_ops_mode)
        in_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
        return QuantizedActivation(q, scale, torch.promote_types(in_dtype, self.weight.dtype)), residual_out
