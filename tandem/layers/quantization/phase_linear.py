"""A linear layer with two paths for one weight, chosen per row by the phase of the row's
token: a decode kernel for generated tokens (a step reads few bytes for few rows) and a GEMM
for prompt tokens (faster from a few rows on; a prompt is then computed the same way however
it was chunked or cached). The GGUF int4 layers of the CPU (:mod:`tandem.layers.quantization.gguf`)
run their prompt rows on a kept dequantized weight; the block layers
(:mod:`tandem.layers.quantization.gguf_blocks`) have one kernel for every row, no second path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed.forward_context import RowPhases, get_forward_context


class PhaseLinear(nn.Module):
    """``forward(x [..., in_features]) -> [..., out_features]`` in ``x``'s dtype: rows of
    generated tokens through :meth:`_quantized`, rows of prompt tokens through :meth:`_gemm`
    (``F.linear`` on ``dense`` unless a subclass has its own), as the forward context's
    :class:`~tandem.distributed.forward_context.RowPhases` says (no context, or no GEMM:
    every row quantized). With ``max_quantized_rows``, a forward with more generated rows than
    that runs them all through the GEMM too (the decode kernel's time grows with the rows, the
    GEMM's hardly).

    Subclasses set ``in_features`` and ``out_features``, then ``bias`` ([out] or None),
    ``dense`` ([out, in] or None) and ``max_quantized_rows`` (int or None) by
    :meth:`_set_dense`, and define :meth:`_quantized`.

    Raises:
        ValueError: at forward, an input whose row count differs from the forward context's
            rows.
    """

    # What the decoder asks a linear layer (tandem.layers.linear): plain tensors in and out.
    takes_quantized_input = False
    output_feeds_norm = False
    # The model runner passes each forward's RowPhases to models with such layers.
    uses_row_phases = True

    in_features: int
    out_features: int
    bias: torch.Tensor | None
    dense: torch.Tensor | None
    max_quantized_rows: int | None

    def _set_dense(self, bias: torch.Tensor | None, dense: torch.Tensor | None,
                   max_quantized_rows: int | None) -> None:
        """Keep the bias, the dense weight for prompt rows and the row limit (frozen, without a
        copy).

        Raises:
            ValueError: a dense weight that is not ``[out_features, in_features]``.
        """
        if dense is not None and tuple(dense.shape) != (self.out_features, self.in_features):
            raise ValueError(f"dense weight {tuple(dense.shape)} for a {type(self).__name__} of "
                             f"{(self.out_features, self.in_features)}")
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.dense = None if dense is None else nn.Parameter(dense.detach(), requires_grad=False)
        self.max_quantized_rows = max_quantized_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        phases = None if ctx is None or not self._has_gemm() else ctx.row_phases
        if phases is None or phases.num_prompt == 0 and not self._over_max(phases):
            return self._quantized(x)
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] != phases.num_rows:
            raise ValueError(f"GGUF quantized layer got {x2.shape[0]} rows in a forward of {phases.num_rows}")
        if phases.num_generated == 0 or self._over_max(phases):
            return self._gemm(x2).reshape(*x.shape[:-1], self.out_features)
        return self._mixed(x2, phases).reshape(*x.shape[:-1], self.out_features)

    def _over_max(self, phases: RowPhases) -> bool:
        return self.max_quantized_rows is not None and phases.num_generated > self.max_quantized_rows

    def _mixed(self, x2: torch.Tensor, phases: RowPhases) -> torch.Tensor:
        out = x2.new_empty(x2.shape[0], self.out_features)
        out[phases.generated] = self._quantized(x2[phases.generated])
        out[phases.prompt] = self._gemm(x2[phases.prompt])
        return out

    def _has_gemm(self) -> bool:
        """Whether :meth:`_gemm` runs (here: a dense weight is kept)."""
        return self.dense is not None

    def _gemm(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [T, in]`` -> ``[T, out]`` in x2's dtype, the bias added, for many rows."""
        return F.linear(x2, self.dense, self.bias)

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]`` in x's dtype, the bias added, by the quantized form."""
        raise NotImplementedError


__all__ = ["PhaseLinear"]
