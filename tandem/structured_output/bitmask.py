"""The token bitmask of a step: built by the engine, applied by the model runner.

Layout is xgrammar's: ``int32 [rows, ceil(vocab / 32)]``, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed. This module needs only torch, so the runner
does not depend on the grammar library.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GrammarBitmask:
    """Allowed next tokens of the constrained sequences of one step (vLLM's
    ``GrammarOutput``): row ``i`` of ``bitmask`` (``int32 [K, ceil(V / 32)]``, host
    memory) belongs to sequence ``seq_ids[i]``."""

    seq_ids: list[int]
    bitmask: torch.Tensor


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf the logits of tokens a sequence's grammar does not allow, in place.

    Args:
        logits: ``[N, V]`` float, one row per sampling sequence.
        rows: ``[K]`` int64, the rows of ``logits`` the bitmask rows belong to.
        bitmask: ``int32 [K, W]`` on ``logits.device``, ``W * 32 >= V``; tokens past
            ``W * 32`` are not allowed.
    """
    k, w = bitmask.shape
    v = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().view(k, w * 32)
    if w * 32 < v:
        allowed = torch.cat([allowed, allowed.new_zeros(k, v - w * 32)], dim=1)
    logits[rows] = logits[rows].masked_fill(~allowed[:, :v], float("-inf"))
