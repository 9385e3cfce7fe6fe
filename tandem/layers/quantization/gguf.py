"""GGUF weights run quantized on the CPU: llama.cpp's 4-bit blocks mapped onto PyTorch's
weight-only int4 GEMM (``torch.ops.aten._weight_int4pack_mm_for_cpu``).

PyTorch's int4 kernel takes 4-bit values ``q`` in ``[0, 15]`` with one (scale, zero) pair
per group of ``group_size`` input features and output row, and computes with
``w = (q - 8) * scale + zero``. The GGUF formats map onto it exactly (group size 32,
the block size of every format below), up to the rounding of the scales and zeros to the
kernel's activation dtype (bfloat16):

* ``Q4_0``: blocks of 32 with one fp16 ``d``; ``w = d * (q - 8)``: scale ``d``, zero 0.
* ``Q4_1``: blocks of 32 with fp16 ``d`` and ``m``; ``w = d * q + m``: scale ``d``, zero
  ``m + 8 d``.
* ``Q4_K``: super-blocks of 256 with fp16 ``d``, ``dmin`` and 6-bit scales/mins per 32;
  ``w = d * sc * q - dmin * mn``: scale ``d sc``, zero ``8 d sc - dmin mn``.

``Q8_0`` (and every other format: K-quants other than Q4_K, fp16/fp32) is left
dequantized: the int8 kernel (``_weight_int8pack_mm``) takes one scale per output row, so
Q8_0's 32-wide block scales would have to be requantized (8-bit values rounded again),
and it runs no faster than the bf16 GEMM here (see the module's tests and
benchmarks/RESULTS.md).

The kernel runs on bfloat16 activations: its float32 and float16 paths are tens of times
slower than ``F.linear`` (unvectorised in torch 2.13's CPU build), so inputs of another
dtype are cast to bfloat16 and the output back.

The kernel pays at decode sizes only: at one to a few rows it reads a quarter of the bf16
weight's bytes and runs ~2x faster than the bf16 GEMM, but from ~16 rows on oneDNN's bf16
GEMM is faster (2-3x at 64-512 rows on the 2-core AVX512/AMX development machine). A layer
therefore keeps the dequantized weight too (in the model dtype, the weight the dequantized
path loads) and picks the kernel by the phase of each row's token, never by the row count
(:class:`~tandem.distributed.forward_context.RowPhases`): prompt tokens go through
``F.linear`` on the dequantized weight, generated tokens through the int4 kernel. A
prompt is then computed the same way whether part of it came from the prefix cache or
how it was chunked, and a generated token the same way whatever else is in the step
(the two kernels give a row the same bits whatever the row count; a switch by row count
made a repeated greedy chat change its answer after a prefix-cache hit). The int4 form
costs a quarter more memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed.forward_context import RowPhases, get_forward_context
from tandem.layers.linear import ColumnShardedLinear, RowParallelLinear

GROUP_SIZE = 32
KERNEL_DTYPE = torch.bfloat16
# innerKTiles of the CPU packing op: ignored by the CPU kernel's layout, 1 is what it takes.
_INNER_K_TILES = 1
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes -> ``[..., 32]`` 4-bit values (low nibbles first, as llama.cpp)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fp16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def int4_groups(data: np.ndarray, qtype: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF tensor's raw blocks as PyTorch int4 groups.

    Args:
        data: the tensor's bytes as the reader gives them (``uint8``, ``[rows, bytes per
            row]`` or flat).
        qtype: ``"Q4_0"``, ``"Q4_1"`` or ``"Q4_K"``.
        rows, cols: the weight's shape (output x input features).

    Returns:
        ``(q [rows, cols] uint8 in [0, 15], scale [rows, cols/32] fp32, zero [rows,
        cols/32] fp32)`` with ``w = (q - 8) * scale + zero``.

    Raises:
        ValueError: another type, or a size that does not fit the blocks.
    """
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}.get(qtype)
    block_elems = 256 if qtype == "Q4_K" else 32
    if block_bytes is None:
        raise ValueError(f"GGUF type {qtype} has no int4 mapping (one of {INT4_TYPES})")
    if cols % block_elems or data.size != rows * cols // block_elems * block_bytes:
        raise ValueError(f"GGUF {qtype} tensor of {data.size} bytes does not hold a [{rows}, {cols}] weight")
    b = data.reshape(rows, cols // block_elems, block_bytes)
    if qtype == "Q4_0":
        d = _fp16(b[..., 0:2])
        q, scale, zero = _nibbles(b[..., 2:]), d, np.zeros_like(d)
    elif qtype == "Q4_1":
        d, m = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])
        q, scale, zero = _nibbles(b[..., 4:]), d, m + 8 * d
    else:
        q, scale, zero = _q4_k_groups(b)
    return q.reshape(rows, cols), scale.reshape(rows, -1), zero.reshape(rows, -1)


def _q4_k_groups(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from gguf.quants import Q4_K

    rows, nsb = b.shape[:2]
    d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])
    sc, mn = Q4_K.get_scale_min(b[..., 4:16].reshape(rows * nsb, 12))
    scale = d[..., None] * sc.reshape(rows, nsb, 8).astype(np.float32)
    zero = 8 * scale - dmin[..., None] * mn.reshape(rows, nsb, 8).astype(np.float32)
    # 4 chunks of 64 values per super-block: 32 bytes, low nibbles the chunk's first 32.
    qs = b[..., 16:].reshape(rows, nsb, 4, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, nsb, 4, 64]
    return q, scale, zero


# Fused layer -> its checkpoint parts, in row order.
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _parts(module_name: str) -> list[str]:
    prefix, _, last = module_name.rpartition(".")
    return [f"model.{prefix}.{p}.weight" for p in _FUSED_PARTS.get(last, (last,))]


def quantize_gguf_linears(model: nn.Module, raw: Mapping[str, Any]) -> dict[str, int]:
    """Replace every linear layer of a loaded (single-rank) model whose GGUF weights are all
    Q4_0 / Q4_1 / Q4_K by a :class:`GGUFInt4Linear` of those blocks; the others keep their
    dequantized weights. The layers' biases are kept (as loaded).

    Args:
        model: the model, its weights loaded (the decoder's linear layers are
            ``ColumnShardedLinear`` / ``RowParallelLinear``).
        raw: HF weight name (``model.layers.0.self_attn.q_proj.weight``) -> the tensor's
            raw blocks (:class:`tandem.model_loader.gguf_weights.RawWeight`).

    Returns:
        The number of linear layers per mode: ``{"int4": n, "dequantized": m}``.

    Raises:
        ValueError: a layer's checkpoint weight is missing or its shape differs.
    """
    counts = {"int4": 0, "dequantized": 0}
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, (ColumnShardedLinear, RowParallelLinear))]
    for name, mod in targets:
        parts = _parts(name)
        missing = [p for p in parts if p not in raw]
        if missing:
            raise ValueError(f"GGUF file has no tensor {missing[0]!r} for layer {name!r}")
        if any(raw[p].qtype not in INT4_TYPES for p in parts):
            counts["dequantized"] += 1
            continue
        groups = [_unpermuted_groups(raw[p]) for p in parts]
        q, scale, zero = (torch.from_numpy(np.concatenate([g[i] for g in groups])) for i in range(3))
        if tuple(q.shape) != tuple(mod.weight.shape):
            raise ValueError(f"GGUF weights of {name!r}: {tuple(q.shape)} vs the layer's {tuple(mod.weight.shape)}")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, GGUFInt4Linear(q, scale, zero, mod.bias, mod.weight.data))
        counts["int4"] += 1
    return counts


def _unpermuted_groups(w: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(w.unpermute(a) for a in int4_groups(w.data, w.qtype, w.rows, w.cols))


class GGUFInt4Linear(nn.Module):
    """A linear layer whose weight is int4 groups of 32 (:func:`int4_groups`), run with
    PyTorch's CPU int4 kernel.

    ``forward(x [..., in_features]) -> [..., out_features]`` in ``x``'s dtype: rows of
    generated tokens through the int4 kernel (in bfloat16), rows of prompt tokens through
    ``F.linear`` on ``dense``, as the forward context's
    :class:`~tandem.distributed.forward_context.RowPhases` says (module docstring; no
    context: every row int4).

    Args:
        q: ``[out, in]`` uint8/int values in [0, 15].
        scale, zero: ``[out, in/32]`` float (``w = (q - 8) * scale + zero``).
        bias: ``[out]`` or None.
        dense: ``[out, in]`` the dequantized weight for prompt tokens; None: always int4.

    Raises:
        ValueError: shapes that do not fit; at forward, an input whose row count differs
            from the forward context's rows.
    """

    # What the decoder asks a linear layer (tandem.layers.linear): plain tensors in and out.
    takes_quantized_input = False
    output_feeds_norm = False
    # The model runner passes each forward's RowPhases to models with such layers.
    uses_row_phases = True

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bias: torch.Tensor | None = None, dense: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        if self.in_features % GROUP_SIZE or scale.shape != (self.out_features, self.in_features // GROUP_SIZE) \
                or zero.shape != scale.shape:
            raise ValueError(f"int4 weight {tuple(q.shape)} with scales {tuple(scale.shape)} / zeros "
                             f"{tuple(zero.shape)}: need [out, in/{GROUP_SIZE}] for in divisible by {GROUP_SIZE}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), _INNER_K_TILES)
        self.register_buffer("packed", packed)
        # The kernel's layout: [in/32, out, 2] of (scale, zero).
        sz = torch.stack([scale.float(), zero.float()], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", sz.to(KERNEL_DTYPE))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        if dense is not None and tuple(dense.shape) != tuple(q.shape):
            raise ValueError(f"dense weight {tuple(dense.shape)} for an int4 weight {tuple(q.shape)}")
        self.dense = None if dense is None else nn.Parameter(dense.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        phases = None if ctx is None or self.dense is None else ctx.row_phases
        if phases is None or phases.num_prompt == 0:
            return self._int4(x)
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] != phases.num_rows:
            raise ValueError(f"GGUF int4 layer got {x2.shape[0]} rows in a forward of {phases.num_rows}")
        if phases.num_generated == 0:
            return F.linear(x, self.dense, self.bias)
        return self._mixed(x2, phases).reshape(*x.shape[:-1], self.out_features)

    def _mixed(self, x2: torch.Tensor, phases: RowPhases) -> torch.Tensor:
        out = x2.new_empty(x2.shape[0], self.out_features)
        out[phases.generated] = self._int4(x2[phases.generated])
        out[phases.prompt] = F.linear(x2[phases.prompt], self.dense, self.bias)
        return out

    def _int4(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != KERNEL_DTYPE:
            x2 = x2.to(KERNEL_DTYPE)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), self.packed, GROUP_SIZE,
                                                        self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def dequantized_weight(self) -> torch.Tensor:
        """``[out, in]`` fp32: the weight the kernel computes with (identity matrix through
        the kernel, in bfloat16)."""
        eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE)
        w = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return w.float().t().contiguous()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={GROUP_SIZE}"


__all__ = ["GROUP_SIZE", "INT4_TYPES", "KERNEL_DTYPE", "GGUFInt4Linear", "int4_groups", "quantize_gguf_linears"]
