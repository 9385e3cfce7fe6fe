"""Per-step facts every rank agreed on, read by layers that exchange data across ranks.

The model runner sets it around each forward (under dual-batch overlap: around each step of
each ubatch, :func:`tandem.worker.ubatching.run_ubatches`). Multi-rank all-to-all backends
pad the local tokens of a forward (a step, or one ubatch) to ``max_tokens_per_rank`` so that
every rank's collective has the same shape, whatever its own batch holds, and keep the
buffers of ubatch ``ubatch_id`` in their slot of that id.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardContext:
    """``max_tokens_per_rank``: tokens of the largest forward (or ubatch) on any DP rank;
    ``ubatch_id``: which ubatch of a dual-batch-overlap step runs (0 or 1; 0 unsplit)."""

    max_tokens_per_rank: int
    ubatch_id: int = 0


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
