"""GGUF weights run on the CPU at the file's bits, as llama.cpp runs them: each layer's blocks
repacked once, at load, into tiles of 16 weight rows laid out for AVX512-VNNI's 8-bit dot
product (``torch.ops.tandem_cpu.gguf_repack``; llama.cpp repacks its CPU weights likewise),
multiplied by ``torch.ops.tandem_cpu.gguf_repacked_linear`` (``tandem/csrc/cpu/gguf_repacked.cpp``)
at every row count: each row of the input quantized to int8 per 32 values (llama.cpp's Q8_0),
integer dot products per group, the sums scaled in fp32 (the kernel's header has the
arithmetic). The one error besides fp32 rounding is the input's int8 rounding (relative error
~5e-3 of a layer's largest output on random inputs, tests/layers/quantization/test_gguf_blocks.py).

One kernel for generated and prompt rows alike: a decode step, a speculative verification of
several rows and a prompt compute each row the same way (batch-invariant), and no dequantized
copy is kept. The tiles hold each weight at the file's bits (4, 5, 6 or 8, with the file's
scales: ~1.0-1.03x the GGUF's bytes). A layer takes this form when every part of it (q, k and
v of a fused qkv_proj may differ) is of :data:`BLOCK_TYPES` and the kernels were built with
VNNI (:func:`available`; faster than PyTorch's int4 kernel on Q4_0/Q4_1 too, at every row
count, RESULTS; without VNNI the int4 planes or the dense weight of
:mod:`tandem.layers.quantization.gguf` run). The token embedding keeps the file's bits too
(:class:`GGUFEmbedding`: rows dequantized from the tiles as they are looked up; a tied LM
head's tiles serve both). The parameter cache stores
the tiles and their segment table (type, rows, byte offset per part).
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

# The types the kernels read (gguf_quants.h).
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def available() -> bool:
    """Whether the block kernel runs at its speed here: the C++ kernels built (thread-safe,
    once; :func:`tandem.layers.cpu_ops.available`) with AVX512-VNNI."""
    return cpu_ops.available() and bool(torch.ops.tandem_cpu.gguf_vnni())


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
    """A linear layer whose weight is GGUF blocks repacked into tiles
    (:func:`~tandem.layers.cpu_ops.gguf_repack`), every row through
    ``torch.ops.tandem_cpu.gguf_repacked_linear`` (module docstring).

    ``forward(x [..., in_features]) -> [..., out_features]`` in x's dtype. A
    :class:`~tandem.layers.quantization.phase_linear.PhaseLinear` without a second path: its
    rows need no phases.

    Args:
        repacked: ``[bytes]`` uint8 tiles and
        segments: ``[parts, 3]`` int64 (type, rows, byte offset in ``repacked``), as
            :func:`~tandem.layers.cpu_ops.gguf_repack` gives them (kept without a copy: a
            memory-mapped cache's tensors stay mapped).
        bias: ``[out]`` or None.

    Raises:
        ValueError: a segment table that does not describe ``repacked`` (types, sizes, one
            width).
    """

    def __init__(self, repacked: torch.Tensor, segments: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features = _repacked_width(repacked, segments)
        self.out_features = int(segments[:, 1].sum())
        self.register_buffer("repacked", repacked)
        self.register_buffer("segments", segments)
        self._set_dense(bias, None, None)

    @classmethod
    def from_parts(cls, parts: Sequence[Any], bias: torch.Tensor | None = None) -> GGUFBlockLinear:
        """The layer of GGUF tensors (:func:`pack_blocks`'s ``parts``; ``bias`` as the
        constructor's), repacked.

        Raises:
            ValueError: as :func:`pack_blocks`.
        """
        return cls(*_repack(parts), bias)

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = cpu_ops.gguf_repacked_linear(x2, self.repacked, self.segments, self.bias)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        types = ",".join(GGMLQuantizationType(int(t)).name for t in self.segments[:, 0])
        return f"in_features={self.in_features}, out_features={self.out_features}, types={types}"


class GGUFEmbedding(nn.Module):
    """A token embedding whose table is GGUF blocks, repacked (a tied LM head's own tiles, or
    its own), looked up by ``torch.ops.tandem_cpu.gguf_repacked_get_rows``: each token's row
    dequantized when it is needed (the values of gguf's dequantization), so the table stays
    at the file's bits per weight.

    ``forward(ids [...]) -> [..., embedding_dim]`` in ``dtype``.

    Args:
        repacked: ``[bytes]`` uint8 tiles and
        segments: ``[parts, 3]`` int64 of the table's rows (as :class:`GGUFBlockLinear`'s;
            kept without a copy).
        dtype: of the embeddings (the model's).

    Raises:
        ValueError: a segment table that does not describe ``repacked``.
    """

    def __init__(self, repacked: torch.Tensor, segments: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.embedding_dim = _repacked_width(repacked, segments)
        self.num_embeddings = int(segments[:, 1].sum())
        self.register_buffer("repacked", repacked)
        self.register_buffer("segments", segments)
        self.dtype = dtype

    @classmethod
    def from_parts(cls, parts: Sequence[Any], dtype: torch.dtype) -> GGUFEmbedding:
        """The table of a GGUF tensor (:func:`pack_blocks`'s ``parts``), repacked.

        Raises:
            ValueError: as :func:`pack_blocks`.
        """
        return cls(*_repack(parts), dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = cpu_ops.gguf_repacked_get_rows(self.repacked, self.segments, ids.reshape(-1), self.embedding_dim,
                                              self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        types = ",".join(GGMLQuantizationType(int(t)).name for t in self.segments[:, 0])
        return f"{self.num_embeddings}, {self.embedding_dim}, types={types}"


def _repack(parts: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack_blocks`'s blocks of ``parts`` as tiles (:func:`~tandem.layers.cpu_ops.gguf_repack`)."""
    blocks, segments = pack_blocks(parts)
    return cpu_ops.gguf_repack(blocks, segments, _shape(blocks, segments)[0])


def _repacked_width(repacked: torch.Tensor, segments: torch.Tensor) -> int:
    """The width of tiles and their table, checked (ValueError otherwise)."""
    try:
        return cpu_ops.gguf_repacked_width(repacked, segments)
    except RuntimeError as e:
        raise ValueError(f"GGUF repacked tiles {tuple(repacked.shape)} {repacked.dtype} with segments "
                         f"{tuple(segments.shape)} {segments.dtype}: {str(e).splitlines()[0]}") from None


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


__all__ = ["BLOCK_TYPES", "GGUFBlockLinear", "GGUFEmbedding", "available", "pack_blocks"]
