"""The token bitmask of a step: built by the engine, applied by the model runner.

Layout is xgrammar's: ``int32 [rows, ceil(vocab / 32)]``, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed. The mask is applied by xgrammar's in-place
kernels (a C++ loop on the CPU, a Triton kernel on CUDA: what vLLM applies): unpacking the
bits with torch ops made ``[K, V]`` int32 temporaries, ~0.5 GB per step at 256 rows of a
128K vocabulary, the largest cost of a constrained step on the CPU (benchmarks/RESULTS.md,
"Session 7 — constrained decoding cost per step").
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


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor) -> None:
    """Set to -inf the logits of tokens a sequence's grammar does not allow, in place.

    Args:
        logits: ``[N, V]`` float32, bfloat16 or float16, one row per sampling sequence.
        rows: ``[K]`` int64 on ``logits.device``, the distinct rows of ``logits`` the bitmask
            rows belong to; None when bitmask row ``i`` is logits row ``i`` (``K == N``).
        bitmask: ``int32 [K, W]`` on ``logits.device``, contiguous; tokens past ``W * 32``
            are not allowed.
    """
    import xgrammar as xgr

    n, v = logits.shape
    w = bitmask.shape[1]
    if rows is not None:
        # xgrammar's kernels read bitmask row r for logits row r: scatter the rows into
        # batch order (a [N, W] int32 copy, 4 MB at 256 rows of a 128K vocabulary).
        full = bitmask.new_full((n, w), -1)
        full[rows] = bitmask
        bitmask = full
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(v, w * 32), indices=rows)
    if w * 32 < v:
        logits[slice(None) if rows is None else rows, w * 32:] = float("-inf")
