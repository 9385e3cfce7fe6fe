"""GGUF weights run on the CPU as the file stores them: llama.cpp's blocks read by the C++
kernel ``torch.ops.tandem_cpu.gguf_linear`` (``tandem/csrc/cpu/gguf_linear.cpp``), at the
file's bits per weight.

The int4 planes of :mod:`tandem.layers.quantization.gguf` map a 4-bit type onto PyTorch's
int4 GEMM exactly (5 bits a weight with its bf16 scale and zero), but a 5- or 8-bit type takes
two planes (10 bits) and Q6_K none (it stays bf16, 16 bits), where the file holds 5.5 (Q5_0),
8.5 (Q8_0) and 6.56 (Q6_K) bits: a decode step of Qwen2.5-Coder-0.5B-Instruct Q4_K_M, mostly
Q5_0 with a Q8_0 LM head, read ~1.6x the file's bytes, and the 1.5B's Q6_K LM head and
down projections ran dense. The kernel here reads the blocks themselves, as llama.cpp's CPU
backend does: each row of the input quantized to int8 per 32 values (llama.cpp's Q8_0), each
group of 32 weights expanded to unsigned 8-bit values in registers and multiplied with
AVX512-VNNI's 8-bit dot product, the sums scaled in fp32 (the kernel's header has the
arithmetic). The one error besides fp32 rounding is the input's int8 rounding (llama.cpp's;
relative error ~5e-3 of a layer's largest output on random inputs, tests/layers/quantization/
test_gguf_blocks.py).

A layer takes this form when every part of it (q, k and v of a fused qkv_proj may differ) is
of :data:`BLOCK_TYPES`, at least one of them is not Q4_0 or Q4_1 (those stay on PyTorch's
int4 kernel, faster on them at one row), and the kernel was built with VNNI
(:func:`available`; without it the planes or the dense weight run as before). Generated rows
of a step of up to four go through the row kernel; prompt rows (any count:
:class:`~tandem.layers.quantization.phase_linear.PhaseLinear`) and a step of more generated
rows through the GEMM over the same blocks (``torch.ops.tandem_cpu.gguf_gemm``,
``tandem/csrc/cpu/gguf_gemm.cpp``: each tile of 16 weight rows unpacked to 8-bit values once
a call, then multiplied into every row), so no dequantized copy is kept. The blocks are kept as
one flat ``uint8`` tensor (the parts' rows in HF order) with a segment table (type, rows, byte
offset per part); the parameter cache stores both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from tandem.layers import cpu_ops
from tandem.layers.quantization.phase_linear import PhaseLinear

# The types the kernel reads (gguf_linear.cpp).
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# Types PyTorch's int4 kernel runs as one plane, faster than the block kernel on them (RESULTS):
# a layer all of these stays int4.
ONE_PLANE_TYPES = ("Q4_0", "Q4_1")


def available() -> bool:
    """Whether the block kernel runs at its speed here: the C++ kernels built (thread-safe,
    once; :func:`tandem.layers.cpu_ops.available`) with AVX512-VNNI."""
    return cpu_ops.available() and bool(torch.ops.tandem_cpu.gguf_linear_vnni())


def pack_blocks(parts: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF tensors' raw blocks as one layer's buffers.

    Args:
        parts: :class:`~tandem.model_loader.gguf_weights.RawWeight` of the layer's parts in
            row order, each of :data:`BLOCK_TYPES`, all of one ``cols``.

    Returns:
        ``blocks`` ``[bytes]`` uint8 (each part's rows in HF order, one after another) and
        ``segments`` ``[parts, 3]`` int64: each part's GGML type id, rows and byte offset.

    Raises:
        ValueError: a part of another type, parts of different widths, or a width the type's
            block does not divide.
    """
    chunks, segments, offset = [], [], 0
    for w in parts:
        if w.qtype not in BLOCK_TYPES or w.cols != parts[0].cols:
            raise ValueError(f"GGUF block layer part {w.qtype} [{w.rows}, {w.cols}]: need one of {BLOCK_TYPES}, "
                             f"all {parts[0].cols} wide")
        qtype = GGMLQuantizationType[w.qtype]
        block, size = GGML_QUANT_SIZES[qtype]
        if w.cols % block:
            raise ValueError(f"GGUF {w.qtype} tensor of {w.cols} columns: not whole blocks of {block}")
        rows = w.unpermute(np.asarray(w.data, dtype=np.uint8).reshape(w.rows, w.cols // block * size))
        chunks.append(rows.reshape(-1))
        segments.append((int(qtype), w.rows, offset))
        offset += rows.size
    return torch.from_numpy(np.concatenate(chunks)), torch.tensor(segments, dtype=torch.int64)


class GGUFBlockLinear(PhaseLinear):
    """A linear layer whose weight is GGUF blocks: ``torch.ops.tandem_cpu.gguf_linear`` for
    generated rows (the row kernel up to 4 rows, the GEMM above), ``gguf_gemm`` for prompt
    rows (module docstring).

    ``forward(x [..., in_features]) -> [..., out_features]`` in x's dtype
    (:class:`~tandem.layers.quantization.phase_linear.PhaseLinear`).

    Args:
        blocks: ``[bytes]`` uint8 and
        segments: ``[parts, 3]`` int64, as :func:`pack_blocks` gives them (kept without a
            copy: a memory-mapped cache's tensors stay mapped).
        bias: ``[out]`` or None.

    Raises:
        ValueError: a segment table that does not describe ``blocks`` (types, sizes, one
            width).
    """

    def __init__(self, blocks: torch.Tensor, segments: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = _shape(blocks, segments)
        self.register_buffer("blocks", blocks)
        self.register_buffer("segments", segments)
        self._set_dense(bias, None, None)

    @classmethod
    def from_parts(cls, parts: Sequence[Any], bias: torch.Tensor | None = None) -> GGUFBlockLinear:
        """The layer of GGUF tensors (:func:`pack_blocks`'s ``parts``; ``bias`` as the
        constructor's).

        Raises:
            ValueError: as :func:`pack_blocks` and the constructor.
        """
        return cls(*pack_blocks(parts), bias)

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = cpu_ops.gguf_linear(x2, self.blocks, self.segments, self.bias)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def _has_gemm(self) -> bool:
        return True

    def _gemm(self, x2: torch.Tensor) -> torch.Tensor:
        return cpu_ops.gguf_gemm(x2, self.blocks, self.segments, self.bias)

    def extra_repr(self) -> str:
        types = ",".join(GGMLQuantizationType(int(t)).name for t in self.segments[:, 0])
        return f"in_features={self.in_features}, out_features={self.out_features}, types={types}"


class GGUFEmbedding(nn.Module):
    """A token embedding whose table is GGUF blocks, looked up by
    ``torch.ops.tandem_cpu.gguf_get_rows``: each token's row dequantized when it is needed
    (the values of gguf's dequantization), so the table stays at the file's bits per weight.
    A tied LM head (:class:`GGUFBlockLinear`) shares the same blocks.

    ``forward(ids [...]) -> [..., embedding_dim]`` in ``dtype``.

    Args:
        blocks: ``[bytes]`` uint8 and
        segments: ``[parts, 3]`` int64 of the table's rows (:func:`pack_blocks`; kept without
            a copy).
        dtype: of the embeddings (the model's).

    Raises:
        ValueError: a segment table that does not describe ``blocks``.
    """

    def __init__(self, blocks: torch.Tensor, segments: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.embedding_dim, self.num_embeddings = _shape(blocks, segments)
        self.register_buffer("blocks", blocks)
        self.register_buffer("segments", segments)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = cpu_ops.gguf_get_rows(self.blocks, self.segments, ids.reshape(-1), self.embedding_dim, self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        types = ",".join(GGMLQuantizationType(int(t)).name for t in self.segments[:, 0])
        return f"{self.num_embeddings}, {self.embedding_dim}, types={types}"


def _shape(blocks: torch.Tensor, segments: torch.Tensor) -> tuple[int, int]:
    """(in_features, out_features) of a segment table over ``blocks``, checked."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 1 or segments.dtype != torch.int64 or segments.dim() != 2 \
            or segments.shape[0] == 0 or segments.shape[1] != 3:
        raise ValueError(f"GGUF blocks {tuple(blocks.shape)} {blocks.dtype} with segments {tuple(segments.shape)} "
                         f"{segments.dtype}: need uint8 [bytes] and int64 [parts >= 1, 3]")
    table = segments.tolist()
    if table[0][2] != 0:
        raise ValueError(f"GGUF block segments start at byte {table[0][2]}, not 0")
    ends = [offset for _, _, offset in table[1:]] + [blocks.numel()]
    widths = set()
    for (type_id, rows, offset), end in zip(table, ends):
        names = [t.name for t in GGMLQuantizationType if t.value == type_id]
        if not names or names[0] not in BLOCK_TYPES or rows <= 0 or end <= offset or (end - offset) % rows:
            raise ValueError(f"GGUF block segment (type {type_id}, {rows} rows, offset {offset}) does not fit "
                             f"the blocks ({blocks.numel()} bytes; types {BLOCK_TYPES})")
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        row_bytes = (end - offset) // rows
        if row_bytes % size:
            raise ValueError(f"GGUF block segment of type {names[0]}: {row_bytes} bytes a row, not whole blocks")
        widths.add(row_bytes // size * block)
    if len(widths) != 1:
        raise ValueError(f"GGUF block segments of different widths {sorted(widths)}")
    return widths.pop(), sum(rows for _, rows, _ in table)


__all__ = ["BLOCK_TYPES", "ONE_PLANE_TYPES", "GGUFBlockLinear", "GGUFEmbedding", "available", "pack_blocks"]
