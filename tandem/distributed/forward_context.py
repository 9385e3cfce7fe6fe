"""Per-forward facts read by layers that do not take them as arguments.

The model runner sets it around each forward (under dual-batch overlap: around each step of
each ubatch, :func:`tandem.worker.ubatching.run_ubatches`). Multi-rank all-to-all backends
pad the local tokens of a forward (a step, or one ubatch) to ``max_tokens_per_rank`` so that
every rank's collective has the same shape, whatever its own batch holds, and keep the
buffers of ubatch ``ubatch_id`` in their slot of that id. Layers whose kernel follows the
phase of a token (GGUF int4 layers on the CPU, :mod:`tandem.layers.quantization.gguf`) read
``row_phases``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RowPhases:
    """The rows of a forward by the phase of their token.

    ``generated`` rows hold tokens at or past their request's prompt length (decodes, and
    outputs recomputed after a preemption); ``prompt`` rows the prompt's tokens (and
    padding). Each is a ``slice`` when its rows are consecutive (the runner puts decodes
    first, so nearly always), else an int64 index tensor ``[num]``.
    """

    generated: slice | torch.Tensor
    prompt: slice | torch.Tensor
    num_generated: int
    num_rows: int

    @property
    def num_prompt(self) -> int:
        return self.num_rows - self.num_generated

    @classmethod
    def from_mask(cls, generated: np.ndarray, device: torch.device) -> RowPhases:
        """From ``generated [num_rows]`` bool (True: a generated token's row)."""
        n, g = len(generated), int(generated.sum())
        if generated[:g].all():
            return cls(slice(0, g), slice(g, n), g, n)
        idx = lambda m: torch.from_numpy(np.flatnonzero(m)).to(device, non_blocking=True)  # noqa: E731
        return cls(idx(generated), idx(~generated), g, n)


@dataclass(frozen=True)
class ForwardContext:
    """``max_tokens_per_rank``: tokens of the largest forward (or ubatch) on any DP rank;
    ``ubatch_id``: which ubatch of a dual-batch-overlap step runs (0 or 1; 0 unsplit);
    ``row_phases``: this forward's rows by token phase (None: not known, every row is
    taken as a generated token's)."""

    max_tokens_per_rank: int
    ubatch_id: int = 0
    row_phases: RowPhases | None = None


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext | None:
    return _current


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    prev, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = prev
