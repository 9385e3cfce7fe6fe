"""Tensor-parallel linear layers (Megatron-LM, Shoeybi et al. 2019, section 3).

A column-parallel layer splits the output features over the TP ranks (each rank computes
its slice, no communication); a row-parallel layer splits the input features, each rank
computes a partial product and an all-reduce over the TP group sums them. An attention
block is column-parallel q/k/v (whole heads per rank) followed by a row-parallel output
projection; a SwiGLU MLP is a column-parallel gate/up and a row-parallel down projection:
one all-reduce per block.

With ``tp_size == 1`` every layer is an ``nn.Linear`` (same parameter names ``weight`` /
``bias``, same math). A layer built in deterministic mode (``deterministic``, the model's:
:func:`tandem.layers.batch_invariant.build_mode`) runs its high-precision GEMMs batch-invariant
(:func:`tandem.layers.batch_invariant.linear`), so a row's result does not depend on the batch.
The TP size and rank default to :mod:`tandem.distributed.parallel_state`.

Every sharded parameter carries
* ``weight_loader(tensor, shard_id=None)``: copies a *full* checkpoint tensor (or one
  logical shard of a fused parameter: q/k/v, gate/up) into this rank's slice;
* ``full_shape`` and ``shard(full) -> local``: the unsharded shape and the slicing, so
  that dummy weights are drawn at the full shape and sliced, identical on every TP size
  (:func:`tandem.model_loader.loader.init_dummy_weights`).

FP8 (:mod:`tandem.layers.quantization`): ``create_fp8_weights`` turns ``weight`` into a
``float8_e4m3fn`` parameter of the same shape and adds ``weight_scale`` (``[out]`` fp32
per output channel; a checkpoint's per-tensor scale is expanded to its shard's rows, or
``[out/bn, ceil(in/bk)]`` block scales) and, for static activation scales, ``input_scale``
(one per logical shard; the largest is used, as vLLM). The forward then runs
:func:`~tandem.layers.quantization.fp8.fp8_linear` / ``block_fp8_linear``. A layer with
``takes_quantized_input`` (set after loading by
:func:`~tandem.layers.quantization.apply.finish_fp8_model`) also accepts a
:class:`~tandem.layers.quantization.fp8.QuantizedActivation`: its input already quantized
per token by the kernel that produced it. A row-parallel layer whose output goes straight
into an RMSNorm (``output_feeds_norm``, set by the decoder layer that owns both) is told to
``defer_output_scales`` by ``finish_fp8_model`` where it can: at decode sizes its forward then
returns an :class:`~tandem.layers.quantization.fp8.UnscaledProduct`, whose scales the norm
applies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from tandem.distributed import parallel_state as ps
from tandem.layers import batch_invariant
from tandem.layers.quantization.fp8 import (FP8_DTYPE, QuantizedActivation, UnscaledProduct, block_fp8_linear,
                                            fp8_linear, fp8_linear_takes_quantized_input, fp8_linear_unscaled)


def set_weight_attrs(param: nn.Parameter, full_shape: Sequence[int], shard: Callable[[torch.Tensor], torch.Tensor],
                     weight_loader: Callable[..., None]) -> None:
    param.full_shape = tuple(full_shape)
    param.shard = shard
    param.weight_loader = weight_loader


def check_fp8_source(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Raises ValueError when a high-precision checkpoint tensor would be cast into FP8
    weights (a layer the checkpoint left unquantized without listing it in ``ignore``)."""
    if dst.dtype == FP8_DTYPE and src.dtype != FP8_DTYPE:
        raise ValueError(f"checkpoint weight is {src.dtype} where the FP8 scheme expects float8_e4m3fn (a layer "
                         f"missing from quantization_config's ignore list?)")


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape of {what}: checkpoint slice {tuple(src.shape)} vs model {tuple(dst.shape)}")
    check_fp8_source(dst, src)
    with torch.no_grad():
        dst.copy_(src)


def _scale_vector(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint weight scale as one fp32 value per output row: per-channel ``[rows, 1]``
    / ``[rows]`` as is, per-tensor ``[]`` / ``[1]`` repeated (exact: the rows share it)."""
    t = tensor.float().reshape(-1)
    if t.numel() == 1:
        return t.expand(rows)
    if t.numel() != rows:
        raise ValueError(f"weight scale of {tuple(tensor.shape)} for {rows} output rows (per-tensor or per-channel)")
    return t


def _fp8_param(shape: Sequence[int], dtype: torch.dtype) -> nn.Parameter:
    # Scales start as NaN: one that no checkpoint tensor wrote is caught after loading.
    data = torch.empty(tuple(shape), dtype=dtype) if dtype == FP8_DTYPE else torch.full(tuple(shape), float("nan"),
                                                                                       dtype=dtype)
    return nn.Parameter(data, requires_grad=False)


class _FP8Forward:
    """The matmul of a linear layer, FP8 when its weight is (see the module docstring)."""

    weight_block: tuple[int, int] | None = None
    # Whether forward accepts a QuantizedActivation (module docstring): a plain attribute,
    # decided once after loading, so that the model's check per forward costs nothing.
    takes_quantized_input: bool = False
    # use_fast_accum of the FP8 GEMM (tandem.layers.quantization.fp8.fp8_linear), set after loading.
    fp8_fast_accum: bool = False

    def __init__(self) -> None:
        super().__init__()
        # The model's mode, fixed at build time (tandem.layers.batch_invariant.building).
        self.deterministic = batch_invariant.build_mode()

    def _matmul(self, x: torch.Tensor | QuantizedActivation, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight.dtype != FP8_DTYPE:
            return batch_invariant.linear(x, self.weight, bias, deterministic=self.deterministic)
        if self.weight_block is not None:
            return block_fp8_linear(x, self.weight, self.weight_scale, self.weight_block, bias)
        return fp8_linear(x, self.weight, self.weight_scale, getattr(self, "input_scale", None), bias,
                          fast_accum=self.fp8_fast_accum)


def _tp(tp_size: int | None, tp_rank: int | None) -> tuple[int, int]:
    size = ps.get_tp_size() if tp_size is None else tp_size
    rank = ps.get_tp_rank() if tp_rank is None else tp_rank
    return size, rank


class ColumnShardedLinear(_FP8Forward, nn.Module):
    """Column-parallel linear over one or more logical outputs fused in one matrix.

    ``segments``: per logical output (e.g. q, k, v), ``(full_rows, start, rows)``: its size
    in the unsharded matrix and the row range this rank keeps. The local weight is the
    concatenation of the kept ranges: ``[sum(rows), in_features]``.
    ``forward(x [..., in]) -> [..., sum(rows)]`` (no communication).
    """

    def __init__(self, in_features: int, segments: Sequence[tuple[int, int, int]], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.segments = [tuple(s) for s in segments]
        for full, start, rows in self.segments:
            if not (0 <= start and start + rows <= full):
                raise ValueError(f"bad shard segment {full, start, rows}")
        self.out_features = sum(r for _, _, r in self.segments)
        self.full_out = sum(f for f, _, _ in self.segments)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features))
        set_weight_attrs(self.weight, (self.full_out, in_features), self._shard_rows, self._loader(self.weight))
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features))
            set_weight_attrs(self.bias, (self.full_out,), self._shard_rows, self._loader(self.bias))
        else:
            self.register_parameter("bias", None)

    def _shard_rows(self, full: torch.Tensor, unit: int = 1) -> torch.Tensor:
        """This rank's rows of a full tensor; ``unit``: layer rows per tensor row."""
        parts, off = [], 0
        for f, start, rows in self.segments:
            parts.append(full[off + start // unit: off + (start + rows) // unit])
            off += f // unit
        return torch.cat(parts)

    def _loader(self, param: nn.Parameter, unit: int = 1) -> Callable[..., None]:
        """Loader of a row-sharded parameter; ``unit``: rows of the layer per parameter row
        (block scales: one row per ``bn`` weight rows)."""
        segments = [(f // unit, s // unit, r // unit) for f, s, r in self.segments]
        full_out = sum(f for f, _, _ in segments)

        def load(tensor: torch.Tensor, shard_id: int | None = None) -> None:
            if shard_id is None:
                if tensor.shape[0] != full_out:
                    raise ValueError(f"checkpoint tensor of {tuple(tensor.shape)} for a layer of {full_out} rows")
                _copy(param, self._shard_rows(tensor, unit), "fused linear")
                return
            full, start, rows = segments[shard_id]
            if tensor.shape[0] != full:
                raise ValueError(f"shard {shard_id}: checkpoint {tuple(tensor.shape)} vs {full} rows")
            off = sum(r for _, _, r in segments[:shard_id])
            _copy(param.narrow(0, off, rows), tensor[start: start + rows], f"shard {shard_id}")

        return load

    def create_fp8_weights(self, block: tuple[int, int] | None, static_input: bool) -> None:
        """Replace ``weight`` by an FP8 parameter and add its scales (module docstring).

        Raises:
            ValueError: with ``block``, a shard's rows are not a multiple of ``bn``.
        """
        self.weight = _fp8_param(self.weight.shape, FP8_DTYPE)
        set_weight_attrs(self.weight, (self.full_out, self.in_features), self._shard_rows, self._loader(self.weight))
        self.weight_block = tuple(block) if block else None
        if block:
            bn, bk = block
            if any(x % bn for seg in self.segments for x in seg):
                raise ValueError(f"block-wise FP8 ({bn}x{bk}) needs every shard of this layer to span whole blocks of "
                                 f"{bn} rows; shards (rows, first, kept) = {self.segments}")
            self.weight_scale = _fp8_param((self.out_features // bn, -(-self.in_features // bk)), torch.float32)
            set_weight_attrs(self.weight_scale, (self.full_out // bn, -(-self.in_features // bk)),
                             lambda full: self._shard_rows(full, bn), self._loader(self.weight_scale, bn))
        else:
            self.weight_scale = _fp8_param((self.out_features,), torch.float32)
            base = self._loader(self.weight_scale)

            def load_scale(tensor: torch.Tensor, shard_id: int | None = None) -> None:
                rows = self.full_out if shard_id is None else self.segments[shard_id][0]
                base(_scale_vector(tensor, rows), shard_id)

            set_weight_attrs(self.weight_scale, (self.full_out,), self._shard_rows, load_scale)
        if static_input:
            self.input_scale = _fp8_param((len(self.segments),), torch.float32)

            def load_input_scale(tensor: torch.Tensor, shard_id: int | None = None) -> None:
                with torch.no_grad():
                    self.input_scale[slice(None) if shard_id is None else shard_id] = tensor.float().reshape(())

            set_weight_attrs(self.input_scale, (len(self.segments),), lambda full: full, load_input_scale)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ColumnParallelLinear(ColumnShardedLinear):
    """``out_features`` split evenly over the TP ranks.

    Raises:
        ValueError: ``out_features`` is not a multiple of the TP size.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_size: int | None = None,
                 tp_rank: int | None = None) -> None:
        tp, r = _tp(tp_size, tp_rank)
        if out_features % tp:
            raise ValueError(f"out_features ({out_features}) must be a multiple of the TP size ({tp})")
        n = out_features // tp
        super().__init__(in_features, [(out_features, r * n, n)], bias)


class MergedColumnParallelLinear(ColumnShardedLinear):
    """Several outputs (e.g. SwiGLU gate and up) fused; each split evenly over TP ranks."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False, tp_size: int | None = None,
                 tp_rank: int | None = None) -> None:
        tp, r = _tp(tp_size, tp_rank)
        for s in output_sizes:
            if s % tp:
                raise ValueError(f"output size {s} must be a multiple of the TP size ({tp})")
        super().__init__(in_features, [(s, r * (s // tp), s // tp) for s in output_sizes], bias)


def kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first, count) of the KV heads a TP rank holds: ``num_kv_heads / tp`` heads each, or
    one replicated head when there are fewer KV heads than ranks (GQA, as vLLM).

    Raises:
        ValueError: neither divides the other.
    """
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) must be a multiple of the TP size ({tp_size})")
        n = num_kv_heads // tp_size
        return tp_rank * n, n
    if tp_size % num_kv_heads:
        raise ValueError(f"TP size ({tp_size}) must be a multiple of num_key_value_heads ({num_kv_heads})")
    return tp_rank // (tp_size // num_kv_heads), 1


class QKVParallelLinear(ColumnShardedLinear):
    """Fused q/k/v projection with whole heads per TP rank (shards 0 = q, 1 = k, 2 = v).

    Attributes ``num_heads`` / ``num_kv_heads``: this rank's head counts.

    Raises:
        ValueError: the head counts do not split over the TP size.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp_size: int | None = None, tp_rank: int | None = None) -> None:
        tp, r = _tp(tp_size, tp_rank)
        if num_heads % tp:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of the TP size ({tp})")
        self.num_heads = num_heads // tp
        kv_first, self.num_kv_heads = kv_head_range(num_kv_heads, tp, r)
        q = (num_heads * head_dim, r * self.num_heads * head_dim, self.num_heads * head_dim)
        kv = (num_kv_heads * head_dim, kv_first * head_dim, self.num_kv_heads * head_dim)
        super().__init__(hidden_size, [q, kv, kv], bias)


class RowParallelLinear(_FP8Forward, nn.Module):
    """``in_features`` split over the TP ranks; the partial products are all-reduced over
    the TP group (unless ``reduce_results=False``: the caller reduces), then the bias
    (replicated) is added once.

    Raises:
        ValueError: ``in_features`` is not a multiple of the TP size.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True,
                 tp_size: int | None = None, tp_rank: int | None = None) -> None:
        super().__init__()
        tp, r = _tp(tp_size, tp_rank)
        if in_features % tp:
            raise ValueError(f"in_features ({in_features}) must be a multiple of the TP size ({tp})")
        self.tp_size, self.tp_rank = tp, r
        self.in_features, self.out_features = in_features // tp, out_features
        self.full_in = in_features
        self.reduce_results = reduce_results
        # Whether the module that owns this layer hands its output to an RMSNorm unchanged
        # (the norm kernels take an UnscaledProduct); set when the model is built.
        self.output_feeds_norm = False
        # Largest row count whose product is returned unscaled (0: never): defer_output_scales.
        self.deferred_scales_max_rows = 0
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features))
        set_weight_attrs(self.weight, (out_features, in_features), self._shard_cols, self._load_weight)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            set_weight_attrs(self.bias, (out_features,), lambda full: full, self._load_bias)
        else:
            self.register_parameter("bias", None)

    def _shard_cols(self, full: torch.Tensor) -> torch.Tensor:
        n = self.in_features
        return full[:, self.tp_rank * n: (self.tp_rank + 1) * n]

    def _load_weight(self, tensor: torch.Tensor, shard_id: int | None = None) -> None:
        if tensor.dim() != 2 or tensor.shape[1] != self.full_in:
            raise ValueError(f"checkpoint tensor of {tuple(tensor.shape)} for a row-parallel layer of "
                             f"{self.full_in} input features")
        _copy(self.weight, self._shard_cols(tensor), "row-parallel weight")

    def _load_bias(self, tensor: torch.Tensor, shard_id: int | None = None) -> None:
        _copy(self.bias, tensor, "row-parallel bias")

    def create_fp8_weights(self, block: tuple[int, int] | None, static_input: bool) -> None:
        """Replace ``weight`` by an FP8 parameter and add its scales (module docstring).

        Raises:
            ValueError: with ``block`` and TP > 1, this rank's columns are not a multiple of ``bk``.
        """
        self.weight = _fp8_param(self.weight.shape, FP8_DTYPE)
        set_weight_attrs(self.weight, (self.out_features, self.full_in), self._shard_cols, self._load_weight)
        self.weight_block = tuple(block) if block else None
        if block:
            bn, bk = block
            if self.tp_size > 1 and self.in_features % bk:
                raise ValueError(f"block-wise FP8 ({bn}x{bk}) needs each TP rank's {self.in_features} input "
                                 f"columns to be a multiple of {bk}")
            local_cols = -(-self.in_features // bk)
            self.weight_scale = _fp8_param((-(-self.out_features // bn), local_cols), torch.float32)

            def load_block_scale(tensor: torch.Tensor, shard_id: int | None = None) -> None:
                _copy(self.weight_scale, tensor[:, self.tp_rank * local_cols: (self.tp_rank + 1) * local_cols],
                      "row-parallel block scale")

            set_weight_attrs(self.weight_scale, (self.weight_scale.shape[0], -(-self.full_in // bk)),
                             lambda full: full[:, self.tp_rank * local_cols: (self.tp_rank + 1) * local_cols],
                             load_block_scale)
        else:
            self.weight_scale = _fp8_param((self.out_features,), torch.float32)
            set_weight_attrs(self.weight_scale, (self.out_features,), lambda full: full,
                             lambda t, shard_id=None: _copy(self.weight_scale, _scale_vector(t, self.out_features),
                                                            "row-parallel weight scale"))
        if static_input:
            self.input_scale = _fp8_param((1,), torch.float32)
            set_weight_attrs(self.input_scale, (1,), lambda full: full,
                             lambda t, shard_id=None: _copy(self.input_scale, t.float().reshape(1), "input scale"))

    @property
    def can_defer_output_scales(self) -> bool:
        """Whether :meth:`defer_output_scales` may be called: the output feeds a norm, one
        TP rank (each rank's partial product has its own per-token scales, which must be
        applied before the all-reduce), no bias, and an FP8 per-channel weight with dynamic
        per-token activation scales."""
        return (self.output_feeds_norm and self.tp_size == 1 and self.bias is None
                and fp8_linear_takes_quantized_input(self.weight, self.weight_block, getattr(self, "input_scale", None)))

    def defer_output_scales(self, max_rows: int) -> None:
        """Return the products of 1 to ``max_rows`` rows of a 2-D input unscaled
        (:class:`UnscaledProduct`, module docstring); 0 turns it off.

        Raises:
            ValueError: ``max_rows > 0`` where :attr:`can_defer_output_scales` does not hold.
        """
        if max_rows and not self.can_defer_output_scales:
            raise ValueError(f"row-parallel layer ({self.full_in} -> {self.out_features}, TP {self.tp_size}, bias "
                             f"{self.bias is not None}, weight {self.weight.dtype}, output to a norm "
                             f"{self.output_feeds_norm}) cannot leave its output scales to the norm")
        self.deferred_scales_max_rows = max_rows

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor | UnscaledProduct:
        """``[..., in] -> [..., out]``; an ``[M, out]`` :class:`UnscaledProduct` for a 2-D
        (or quantized) input of ``1 <= M <= deferred_scales_max_rows`` rows (module docstring)."""
        if self.deferred_scales_max_rows:
            quantized = isinstance(x, QuantizedActivation)
            rows = x.q.shape[0] if quantized else x.shape[0] if x.dim() == 2 else 0
            if 0 < rows <= self.deferred_scales_max_rows:
                return fp8_linear_unscaled(x, self.weight, self.weight_scale, self.fp8_fast_accum)
        y = self._matmul(x, None)
        if self.tp_size > 1 and self.reduce_results:
            y = ps.tp_all_reduce(y)
        if self.bias is None or (self.tp_size > 1 and not self.reduce_results and self.tp_rank != 0):
            return y  # unreduced partial sums: the bias is added by one rank only
        return y + self.bias


__all__ = ["ColumnParallelLinear", "ColumnShardedLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
           "RowParallelLinear", "check_fp8_source", "kv_head_range", "set_weight_attrs"]
