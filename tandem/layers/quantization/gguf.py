"""GGUF weights run quantized on the CPU: llama.cpp's blocks mapped onto PyTorch's
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

Wider values are split into two int4 *planes* whose weights sum to the block's, each run
by the kernel (two calls, the outputs added): ``q = 16 hi + lo`` with ``lo`` the low
nibble. Two planes read 1 byte per weight, half of bf16's 2:

* ``Q5_0`` / ``Q5_1`` (``w = d * q - 16 d`` / ``d * q + m``, ``q`` 5 bits): the low nibbles
  (scale ``d``, zero 0) and the fifth bits ``hi`` in {0, 1} as ``hi + 8`` (scale ``16 d``,
  zero ``-8 d`` / ``m + 8 d``).
* ``Q8_0`` (``w = d * q``, ``q`` int8): the low nibbles (scale ``d``, zero 0) and the high
  ones ``hi`` in [-8, 7] as ``hi + 8`` (scale ``16 d``, zero ``8 d``).

(The zeros are split so that each plane is about centred: the sum of two bf16 outputs then
loses little to cancellation.) K-quants other than Q4_K and fp16/fp32 have no planes:
``Q6_K``'s groups of 16 would take four, as many bytes as bf16.

Where the C++ block kernel runs (:mod:`tandem.layers.quantization.gguf_blocks`: AVX512-VNNI),
every layer of the block types keeps the file's blocks instead, repacked
(:class:`~tandem.layers.quantization.gguf_blocks.GGUFBlockLinear`: the file's bits per weight,
Q6_K and Q5_K quantized at all, one kernel for every row count, faster than the int4 one on
Q4_0/Q4_1 too, no dequantized copy); :func:`quantize_gguf_linears` decides each layer's form.
What follows is about the int4 layers, the form on CPUs without VNNI.

The LM head runs the same way when its tensor (``output``, or the tied ``token_embd``) is of
these types: ``Q8_0`` in both real models (RESULTS). Where the head is blocks (or untied), a
token embedding of a block type becomes a
:class:`~tandem.layers.quantization.gguf_blocks.GGUFEmbedding` over repacked blocks (a tied
head's own tiles), whose looked-up rows are gguf's dequantized values: no dense table is kept.

Generated rows go through the int4 kernel only while a step has at most :data:`MAX_INT4_ROWS`
of them; a step with more runs every row on the kept bf16 weight. The kernel computes four rows
per read of the weight, so its time steps up at 5, 9, 13... rows, while the bf16 GEMM's
barely moves (``benchmarks/int4_rows.py``; RESULTS, "int4 kernel by row count": Qwen2.5-1.5B's
layers at 16 rows take 1.2-2.3x the bf16 GEMM's time, the LM head of SmolLM2 2x). So a
decode of a few sequences reads a quarter of the bytes, and a verification of several draft
tokens or a decode of many sequences runs the dense GEMM. (The one choice by row count: a
generated token's outputs differ in their last bits between a step of at most 4 generated
rows and a larger one, as the batched decode attention's already do by default; a repeated
request after a prefix-cache hit is unaffected, its prompt rows are dense either way.)

The kernel runs on bfloat16 activations: its float32 and float16 paths are tens of times
slower than ``F.linear`` (unvectorised in torch 2.13's CPU build), so inputs of another
dtype are cast to bfloat16 and the output back.

The kernel pays at decode sizes only: at one to a few rows it reads a quarter of the bf16
weight's bytes and runs ~2x faster than the bf16 GEMM, but from ~16 rows on oneDNN's bf16
GEMM is faster (2-3x at 64-512 rows on the 2-core AVX512/AMX development machine). A layer
therefore keeps the dequantized weight too (in the model dtype, the weight the dequantized
path loads) and picks the kernel by the phase of each row's token
(:class:`~tandem.distributed.forward_context.RowPhases`): prompt tokens go through
``F.linear`` on the dequantized weight whatever their count, generated tokens through the
int4 kernel (up to :data:`MAX_INT4_ROWS` of them, above). A prompt is then computed the same
way whether part of it came from the prefix cache or how it was chunked (a switch of prompt
rows by their count made a repeated greedy chat change its answer after a prefix-cache
hit). The int4 form costs a quarter more memory (two planes: half).

A load builds the planes from the file's raw blocks once (:func:`quantize_gguf_linears`);
the parameter cache (:mod:`tandem.model_loader.param_cache`) keeps the packed layers
(:func:`gguf_quantized_layers`) with the model's other tensors, and later loads rebuild the layers
from its mapped tensors (:func:`restore_gguf_linears`). The packed layout is the one of the
CPU capability ATen dispatches to (AVX512 and AVX2 interleave output rows differently), so
the cache file is one per capability. A change to which layers run int4 or to a type's
planes must bump the cache's ``PARAMS_FORMAT``: the cached planes would be served otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from tandem.layers.linear import ColumnShardedLinear, RowParallelLinear
from tandem.layers.quantization import gguf_blocks
from tandem.layers.quantization.gguf_blocks import GGUFBlockLinear, GGUFEmbedding
from tandem.layers.quantization.phase_linear import PhaseLinear

GROUP_SIZE = 32
KERNEL_DTYPE = torch.bfloat16
# innerKTiles of the CPU packing op: ignored by the CPU kernel's layout, 1 is what it takes.
_INNER_K_TILES = 1
# Int4 planes per GGUF type: 4-bit types are one plane, 5- and 8-bit types two (module docstring).
PLANES = {"Q4_0": 1, "Q4_1": 1, "Q4_K": 1, "Q5_0": 2, "Q5_1": 2, "Q8_0": 2}
INT4_TYPES = tuple(PLANES)
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}

Int4Plane = tuple[np.ndarray, np.ndarray, np.ndarray]
"""``(q [rows, cols] uint8 in [0, 15], scale [rows, cols/32] fp32, zero [rows, cols/32] fp32)``:
the weight ``(q - 8) * scale + zero`` (per group of 32 input features)."""


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes -> ``[..., 32]`` 4-bit values (low nibbles first, as llama.cpp)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fp16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """``[..., 4]`` bytes of a Q5 block's 32 fifth bits -> ``[..., 32]`` values 0 or 1."""
    bits = np.ascontiguousarray(qh).view(np.uint32)  # [..., 1], little-endian as in the file
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def int4_planes(data: np.ndarray, qtype: str, rows: int, cols: int) -> list[Int4Plane]:
    """A GGUF tensor's raw blocks as planes of PyTorch int4 groups whose weights sum to the
    tensor's (module docstring).

    Args:
        data: the tensor's bytes as the reader gives them (``uint8``, ``[rows, bytes per
            row]`` or flat).
        qtype: a type of :data:`INT4_TYPES`.
        rows, cols: the weight's shape (output x input features).

    Returns:
        :data:`PLANES` ``[qtype]`` planes (:data:`Int4Plane`).

    Raises:
        ValueError: another type, or a size that does not fit the blocks.
    """
    block_bytes = _BLOCK_BYTES.get(qtype)
    block_elems = 256 if qtype == "Q4_K" else 32
    if block_bytes is None:
        raise ValueError(f"GGUF type {qtype} has no int4 mapping (one of {INT4_TYPES})")
    if cols % block_elems or data.size != rows * cols // block_elems * block_bytes:
        raise ValueError(f"GGUF {qtype} tensor of {data.size} bytes does not hold a [{rows}, {cols}] weight")
    b = data.reshape(rows, cols // block_elems, block_bytes)
    planes = _BLOCK_PLANES[qtype](b)
    return [(q.reshape(rows, cols), scale.reshape(rows, -1), zero.reshape(rows, -1)) for q, scale, zero in planes]


def _q4_0(b: np.ndarray) -> list[Int4Plane]:
    d = _fp16(b[..., 0:2])  # w = d (q - 8)
    return [(_nibbles(b[..., 2:]), d, np.zeros_like(d))]


def _q4_1(b: np.ndarray) -> list[Int4Plane]:
    d, m = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])  # w = d q + m
    return [(_nibbles(b[..., 4:]), d, m + 8 * d)]


def _q4_k(b: np.ndarray) -> list[Int4Plane]:
    from gguf.quants import Q4_K

    rows, nsb = b.shape[:2]
    d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])  # w = d sc q - dmin mn, per 32 of a 256 super-block
    sc, mn = Q4_K.get_scale_min(b[..., 4:16].reshape(rows * nsb, 12))
    scale = d[..., None] * sc.reshape(rows, nsb, 8).astype(np.float32)
    zero = 8 * scale - dmin[..., None] * mn.reshape(rows, nsb, 8).astype(np.float32)
    # 4 chunks of 64 values per super-block: 32 bytes, low nibbles the chunk's first 32.
    qs = b[..., 16:].reshape(rows, nsb, 4, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, nsb, 4, 64]
    return [(q, scale, zero)]


def _q5(d: np.ndarray, offset: np.ndarray, qh: np.ndarray, qs: np.ndarray) -> list[Int4Plane]:
    """``w = d (lo + 16 hi) + offset``: the low nibbles and the fifth bits as two planes,
    each about centred (``lo - 8`` and ``hi - 1/2``) so their sums cancel little."""
    lo, hi = _nibbles(qs), _high_bits(qh)
    return [(lo, d, np.zeros_like(d)), (hi + 8, 16 * d, offset + 8 * d)]


def _q5_0(b: np.ndarray) -> list[Int4Plane]:
    d = _fp16(b[..., 0:2])  # w = d (q - 16)
    return _q5(d, -16 * d, b[..., 2:6], b[..., 6:])


def _q5_1(b: np.ndarray) -> list[Int4Plane]:
    d, m = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])  # w = d q + m
    return _q5(d, m, b[..., 4:8], b[..., 8:])


def _q8_0(b: np.ndarray) -> list[Int4Plane]:
    """``w = d q`` for int8 ``q = 16 hi + lo`` (``hi`` in [-8, 7], ``lo`` in [0, 15])."""
    d = _fp16(b[..., 0:2])
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8)
    lo, hi = (q & 0x0F).astype(np.uint8), ((q >> 4) + 8).astype(np.uint8)
    return [(lo, d, np.zeros_like(d)), (hi, 16 * d, 8 * d)]


_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
# Generated rows above which a layer runs its dense weight (module docstring).
MAX_INT4_ROWS = 4

_BLOCK_PLANES = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0}


# Fused layer -> its checkpoint parts, in row order.
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _parts(module_name: str) -> list[str]:
    prefix, _, last = module_name.rpartition(".")
    return [f"model.{prefix}.{p}.weight" for p in _FUSED_PARTS.get(last, (last,))]


def quantize_gguf_linears(model: nn.Module, raw: Mapping[str, Any], block_kernel: bool | None = None
                          ) -> dict[str, int]:
    """Replace every linear layer of a loaded (single-rank) model whose GGUF weights the CPU
    runs quantized by such a layer (the others keep their dequantized weights; the layers'
    biases and dequantized weights are kept as loaded), and give the model a quantized LM head
    (``model.lm_head_quant``, over ``lm_head.weight`` or, tied, the embedding) likewise:

    * a :class:`~tandem.layers.quantization.gguf_blocks.GGUFBlockLinear` (the file's blocks,
      repacked) with ``block_kernel`` when every part is of its types
      (:mod:`tandem.layers.quantization.gguf_blocks`);
    * else a :class:`GGUFInt4Linear` when every part is of :data:`INT4_TYPES`.

    A block head drops an untied model's dense ``lm_head``; a block token embedding
    (:class:`~tandem.layers.quantization.gguf_blocks.GGUFEmbedding`) replaces
    ``embed_tokens`` where nothing needs its dense table.

    Args:
        model: the model, its weights loaded (the decoder's linear layers are
            ``ColumnShardedLinear`` / ``RowParallelLinear``; it has ``lm_head_quant``).
        raw: HF weight name (``model.layers.0.self_attn.q_proj.weight``) -> the tensor's
            raw blocks (:class:`tandem.model_loader.gguf_weights.RawWeight`).
        block_kernel: whether the block kernel runs here; None:
            :func:`tandem.layers.quantization.gguf_blocks.available`.

    Returns:
        The number of linear layers per form: ``{"blocks": b, "int4": n, "dequantized": m}``
        (the LM head not counted).

    Raises:
        ValueError: a layer's checkpoint weight is missing or its shape differs.
    """
    if block_kernel is None:
        block_kernel = gguf_blocks.available()
    counts = {"blocks": 0, "int4": 0, "dequantized": 0}
    for name, mod in _linear_layers(model):
        parts = _parts(name)
        missing = [p for p in parts if p not in raw]
        if missing:
            raise ValueError(f"GGUF file has no tensor {missing[0]!r} for layer {name!r}")
        layer = _quantized_layer([raw[p] for p in parts], mod.bias, mod.weight.data, block_kernel)
        if layer is None:
            counts["dequantized"] += 1
            continue
        if (layer.out_features, layer.in_features) != tuple(mod.weight.shape):
            raise ValueError(f"GGUF weights of {name!r}: {(layer.out_features, layer.in_features)} vs the "
                             f"layer's {tuple(mod.weight.shape)}")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer)
        counts["blocks" if isinstance(layer, GGUFBlockLinear) else "int4"] += 1
    tied = not hasattr(model, "lm_head")
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    if head in raw:
        dense = (model.embed_tokens if tied else model.lm_head).weight.data
        model.lm_head_quant = _quantized_layer([raw[head]], None, dense, block_kernel)
    embedding = _block_embedding(model, raw, tied, block_kernel)
    if embedding is not None:
        model.embed_tokens = embedding
    _drop_dense_head(model)
    unloaded = [n for n, p in model.named_parameters() if p.is_meta]
    if unloaded:
        raise ValueError(f"{unloaded[0]!r} was left unloaded for blocks that it did not become")
    return counts


def defer_block_weights(model: nn.Module, raw: Mapping[str, Any], block_kernel: bool | None = None) -> set[str]:
    """Before a model's weights are loaded: move to the meta device the dense weights that
    :func:`quantize_gguf_linears` would replace by the file's blocks (the linear layers, the
    LM head and the token embedding it rebuilds as blocks), so that the load neither
    dequantizes nor stores them (:func:`tandem.models.llama.load_decoder_weights` skips meta
    parameters). The same decisions as :func:`quantize_gguf_linears`, which then builds
    those layers (and raises if one is left on the meta device).

    Returns:
        The checkpoint (HF) names of the deferred tensors, for the load to leave out.
    """
    if block_kernel is None:
        block_kernel = gguf_blocks.available()
    names: set[str] = set()
    deferred: list[nn.Module] = []
    for name, mod in _linear_layers(model):
        parts = _parts(name)
        if all(p in raw for p in parts) and _runs_as_blocks([raw[p] for p in parts], block_kernel):
            names.update(parts)
            deferred.append(mod)
    tied = not hasattr(model, "lm_head")
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    head_blocks = head in raw and _runs_as_blocks([raw[head]], block_kernel)
    embed = "model.embed_tokens.weight"
    if head_blocks and not tied:
        names.add(head)
        deferred.append(model.lm_head)
    if (embed in raw and isinstance(getattr(model, "embed_tokens", None), nn.Embedding)
            and (head_blocks if tied else _runs_as_blocks([raw[embed]], block_kernel))):
        names.add(embed)
        deferred.append(model.embed_tokens)
    for mod in deferred:
        mod.weight = nn.Parameter(mod.weight.to("meta"), requires_grad=False)
    return names


def _linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (ColumnShardedLinear, RowParallelLinear))]


def _runs_as_blocks(parts: list[Any], block_kernel: bool) -> bool:
    """Whether a layer of GGUF tensors ``parts`` runs as the file's blocks here."""
    return block_kernel and {w.qtype for w in parts} <= set(gguf_blocks.BLOCK_TYPES)


def _drop_dense_head(model: nn.Module) -> None:
    """An untied model's dense ``lm_head`` goes when its quantized head is blocks, which run
    every row (an int4 head keeps it for its prompt rows)."""
    if hasattr(model, "lm_head") and isinstance(getattr(model, "lm_head_quant", None), GGUFBlockLinear):
        del model.lm_head


def _block_embedding(model: nn.Module, raw: Mapping[str, Any], tied: bool, block_kernel: bool
                     ) -> GGUFEmbedding | None:
    """The token embedding as the file's blocks where they run here and nothing needs its
    dense table: an untied model (its own tiles), or a tied one whose LM head is blocks
    (sharing its tiles)."""
    embed, name = getattr(model, "embed_tokens", None), "model.embed_tokens.weight"
    if not (isinstance(embed, nn.Embedding) and name in raw and _runs_as_blocks([raw[name]], block_kernel)):
        return None
    if not tied:
        return GGUFEmbedding.from_parts([raw[name]], embed.weight.dtype)
    head = getattr(model, "lm_head_quant", None)
    return GGUFEmbedding(head.repacked, head.segments, embed.weight.dtype) if isinstance(head, GGUFBlockLinear) else None


def _quantized_layer(parts: list[Any], bias: torch.Tensor | None, dense: torch.Tensor,
                     block_kernel: bool) -> PhaseLinear | None:
    """The quantized form of a layer of GGUF tensors ``parts`` (:func:`quantize_gguf_linears`
    says which), or None: it stays dense."""
    if _runs_as_blocks(parts, block_kernel):
        return GGUFBlockLinear.from_parts(parts, bias)
    if {w.qtype for w in parts} <= set(INT4_TYPES):
        return GGUFInt4Linear.from_planes(_fused_planes(parts), bias, dense, MAX_INT4_ROWS)
    return None


def _fused_planes(weights: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The planes of checkpoint parts stacked in row order (HF order); a part with fewer
    planes than another gets zero planes (``q = 8``, scale and zero 0)."""
    per_part = [[tuple(w.unpermute(a) for a in plane) for plane in int4_planes(w.data, w.qtype, w.rows, w.cols)]
                for w in weights]
    n = max(len(p) for p in per_part)
    for planes in per_part:
        q, scale, _ = planes[0]
        planes += [(np.full_like(q, 8), np.zeros_like(scale), np.zeros_like(scale))] * (n - len(planes))
    return [tuple(torch.from_numpy(np.concatenate([p[i][j] for p in per_part])) for j in range(3)) for i in range(n)]


def gguf_quantized_layers(model: nn.Module) -> dict[str, int | None]:
    """The model's GGUF quantized layers (:class:`GGUFInt4Linear`,
    :class:`~tandem.layers.quantization.gguf_blocks.GGUFBlockLinear`, and a
    :class:`~tandem.layers.quantization.gguf_blocks.GGUFEmbedding`): module name ->
    ``max_quantized_rows`` (None for the embedding) (with their buffers and parameters, what
    :func:`restore_gguf_linears` rebuilds them from)."""
    return {name: getattr(m, "max_quantized_rows", None) for name, m in model.named_modules()
            if isinstance(m, GGUFInt4Linear | GGUFBlockLinear | GGUFEmbedding)}


def restore_gguf_linears(model: nn.Module, layers: Mapping[str, int | None],
                         tensors: Mapping[str, torch.Tensor]) -> None:
    """Put back the quantized layers of a model that :func:`quantize_gguf_linears` rebuilt,
    from their saved tensors, without a copy (a parameter cache's mapped tensors): what a
    model built alike holds after loading and quantizing the same file.

    Args:
        model: the model as built (the decoder's linear layers dense; ``lm_head_quant``
            None); an untied model loses its dense ``lm_head`` where the head is blocks.
        layers: :func:`gguf_quantized_layers` of the quantized model.
        tensors: the quantized model's tensors by name: ``<layer>.repacked`` and
            ``<layer>.segments`` of a block layer or embedding (the model's module of that
            name is an ``nn.Embedding``), ``<layer>.packed`` and
            ``<layer>.scales_and_zeros`` of an int4 one, ``<layer>.bias`` and
            ``<layer>.dense`` where it has them.

    Raises:
        AttributeError: a layer's parent module is missing.
        KeyError: a layer's buffers are missing.
        ValueError: a layer's tensors do not fit each other.
        (All checked for every layer before any is replaced.)
    """
    swaps = []
    for name, max_rows in layers.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        bias, built = tensors.get(f"{name}.bias"), getattr(parent, child, None)
        if f"{name}.repacked" in tensors and isinstance(built, nn.Embedding):
            layer = GGUFEmbedding(tensors[f"{name}.repacked"], tensors[f"{name}.segments"], built.weight.dtype)
        elif f"{name}.repacked" in tensors:
            layer = GGUFBlockLinear(tensors[f"{name}.repacked"], tensors[f"{name}.segments"], bias)
        else:
            layer = GGUFInt4Linear(tensors[f"{name}.packed"], tensors[f"{name}.scales_and_zeros"], bias,
                                   tensors.get(f"{name}.dense"), max_rows)
        swaps.append((parent, child, layer))
    for parent, child, layer in swaps:
        setattr(parent, child, layer)
    _drop_dense_head(model)


def pack_int4_planes(planes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4 planes in the CPU kernel's layout (the buffers of a :class:`GGUFInt4Linear`).

    Args:
        planes: ``(q [out, in] uint8/int values in [0, 15], scale [out, in/32], zero
            [out, in/32])`` per plane; the weight is the sum of ``(q - 8) * scale + zero``.

    Returns:
        ``packed`` ``[planes, out, in/2]`` uint8 (``_convert_weight_to_int4pack_for_cpu``'s
        layout, which depends on the CPU capability ATen dispatches to:
        ``torch.backends.cpu.get_cpu_capability()``) and ``scales_and_zeros``
        ``[planes, in/32, out, 2]`` in :data:`KERNEL_DTYPE`.

    Raises:
        ValueError: no planes, ``in`` not divisible by :data:`GROUP_SIZE`, or planes of
            different shapes.
    """
    if not planes:
        raise ValueError("an int4 layer needs at least one plane")
    out_features, in_features = planes[0][0].shape
    groups = (out_features, in_features // GROUP_SIZE)
    packed, sz = [], []
    for q, scale, zero in planes:
        if in_features % GROUP_SIZE or q.shape != planes[0][0].shape or scale.shape != groups \
                or zero.shape != groups:
            raise ValueError(f"int4 weight {tuple(q.shape)} with scales {tuple(scale.shape)} / zeros "
                             f"{tuple(zero.shape)}: need [out, in/{GROUP_SIZE}] for in divisible by {GROUP_SIZE}, "
                             f"and every plane of one shape")
        packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(),
                                                                           _INNER_K_TILES))
        # The kernel's layout: [in/32, out, 2] of (scale, zero).
        sz.append(torch.stack([scale.float(), zero.float()], dim=-1).transpose(0, 1).to(KERNEL_DTYPE))
    return torch.stack(packed), torch.stack(sz).contiguous()


class GGUFInt4Linear(PhaseLinear):
    """A linear layer whose weight is the sum of int4 planes (:func:`int4_planes`), run with
    PyTorch's CPU int4 kernel, one call per plane.

    ``forward(x [..., in_features]) -> [..., out_features]`` in ``x``'s dtype: rows of
    generated tokens through the int4 kernel (in bfloat16), rows of prompt tokens through
    ``F.linear`` on ``dense``, as the forward context's
    :class:`~tandem.distributed.forward_context.RowPhases` says (module docstring; no
    context: every row int4).

    Args:
        packed: ``[planes, out, in/2]`` uint8 and
        scales_and_zeros: ``[planes, in/32, out, 2]`` bfloat16: the planes in the kernel's
            layout (:func:`pack_int4_planes`; :meth:`from_planes` packs them), kept as the
            layer's buffers without a copy (a memory-mapped cache's tensors stay mapped).
        bias: ``[out]`` or None.
        dense: ``[out, in]`` the dequantized weight for prompt tokens; None: always int4.
        max_quantized_rows: with ``dense``, a forward with more generated rows than this runs
            them all through ``F.linear`` too (the LM head: the int4 kernel's time grows
            with the rows, the dense GEMM's hardly); None: no limit.

    Raises:
        ValueError: buffers whose shapes or dtypes do not fit each other, no planes, a
            dense weight of another shape; at forward, an input whose row count differs
            from the forward context's rows.
    """

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None, max_quantized_rows: int | None = None) -> None:
        super().__init__()
        if scales_and_zeros.dim() != 4 or scales_and_zeros.shape[0] == 0:
            raise ValueError(f"int4 scales and zeros {tuple(scales_and_zeros.shape)}: an int4 layer needs at least "
                             f"one plane, [planes, in/{GROUP_SIZE}, out, 2]")
        planes, groups, self.out_features, _ = scales_and_zeros.shape
        self.in_features = groups * GROUP_SIZE
        if packed.shape != (planes, self.out_features, self.in_features // 2) or packed.dtype != torch.uint8 \
                or scales_and_zeros.dtype != KERNEL_DTYPE:
            raise ValueError(f"packed int4 weight {tuple(packed.shape)} {packed.dtype} with scales and zeros "
                             f"{tuple(scales_and_zeros.shape)} {scales_and_zeros.dtype}: need uint8 [planes, out, "
                             f"in/2] and {KERNEL_DTYPE} [planes, in/{GROUP_SIZE}, out, 2]")
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        # Each plane's kernel arguments, views of the buffers (a CPU-only layer: never moved).
        self._planes = [(p, GROUP_SIZE, sz) for p, sz in zip(self.packed, self.scales_and_zeros)]
        self._set_dense(bias, dense, max_quantized_rows)

    @classmethod
    def from_planes(cls, planes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                    bias: torch.Tensor | None = None, dense: torch.Tensor | None = None,
                    max_quantized_rows: int | None = None) -> GGUFInt4Linear:
        """The layer of int4 planes (:func:`pack_int4_planes`'s ``planes``; the other
        arguments as the constructor's).

        Raises:
            ValueError: as :func:`pack_int4_planes` and the constructor.
        """
        return cls(*pack_int4_planes(planes), bias, dense, max_quantized_rows)

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        return self._int4(x)

    def _int4(self, x: torch.Tensor) -> torch.Tensor:
        # Every dispatched op costs ~1-3 us at decode sizes (tens per step and layer): no
        # reshape, cast or plane indexing that would not change anything.
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x2.dtype != KERNEL_DTYPE:
            x2 = x2.to(KERNEL_DTYPE)
        planes = self._planes
        y = _INT4_MM(x2.contiguous(), *planes[0])
        for plane in planes[1:]:
            y += _INT4_MM(x2, *plane)
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], self.out_features)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def dequantized_weight(self) -> torch.Tensor:
        """``[out, in]`` fp32: the weight the kernel computes with (identity matrix through
        the kernel, in bfloat16, summed over the planes in fp32)."""
        eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE)
        w = sum(_INT4_MM(eye, p, GROUP_SIZE, sz).float() for p, sz in zip(self.packed, self.scales_and_zeros))
        return w.t().contiguous()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={GROUP_SIZE}, "
                f"planes={self.packed.shape[0]}")


__all__ = ["GROUP_SIZE", "INT4_TYPES", "KERNEL_DTYPE", "MAX_INT4_ROWS", "PLANES", "GGUFInt4Linear", "Int4Plane",
           "gguf_quantized_layers", "int4_planes", "pack_int4_planes", "quantize_gguf_linears",
           "restore_gguf_linears"]
