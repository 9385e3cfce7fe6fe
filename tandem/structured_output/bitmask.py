"""The token bitmask of a step: built by the engine, applied by the model runner.

Layout is xgrammar's: ``int32 [rows, ceil(vocab / 32)]``, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed. Unpacking the bits with torch shifts made
``[K, V]`` int32 temporaries, ~0.5 GB per step at 256 rows of a 128K vocabulary, the
largest cost of a constrained step on the CPU (benchmarks/RESULTS.md, "Session 7 —
constrained decoding cost per step"). Now a CUDA device applies it with xgrammar's Triton
kernel (what vLLM uses; one pass, no temporaries), and the CPU unpacks the bits with numpy's
table-driven ``unpackbits`` into one bool mask (1 byte per token) for one ``masked_fill_``:
xgrammar's CPU loop is ~3x slower than that on this 128K shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    v = logits.shape[1]
    width = min(v, bitmask.shape[1] * 32)
    if logits.device.type == "cpu":
        _apply_on_cpu(logits, rows, bitmask, width)
    else:
        _apply_with_xgrammar(logits, rows, bitmask, width)
    if width < v:
        logits[slice(None) if rows is None else rows, width:] = float("-inf")


def _apply_on_cpu(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor, width: int) -> None:
    # Words of the complement, bytes in memory order: on a little-endian host, bit j of byte
    # b is token 8 * b + j, which unpackbits(bitorder="little") puts at column 8 * b + j.
    denied = np.unpackbits((~bitmask).numpy().view(np.uint8), axis=1, bitorder="little")
    denied = torch.from_numpy(denied.view(np.bool_))[:, :width]
    if rows is None:
        logits[:, :width].masked_fill_(denied, float("-inf"))
    else:
        logits[rows, :width] = logits[rows, :width].masked_fill(denied, float("-inf"))


def _apply_with_xgrammar(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor, width: int) -> None:
    import xgrammar as xgr

    if rows is not None:
        # xgrammar's kernel reads bitmask row r for logits row r: scatter the rows into
        # batch order (a [N, W] int32 copy on the device, 4 MB at 256 rows of 128K tokens).
        full = bitmask.new_full((logits.shape[0], bitmask.shape[1]), -1)
        full[rows] = bitmask
        bitmask = full
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=rows)
