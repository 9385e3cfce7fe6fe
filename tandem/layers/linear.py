"""Tensor-parallel linear layers (Megatron-LM, Shoeybi et al. 2019, section 3).

A column-parallel layer splits the output features over the TP ranks (each rank computes
its slice, no communication); a row-parallel layer splits the input features, each rank
computes a partial product and an all-reduce over the TP group sums them. An attention
block is column-parallel q/k/v (whole heads per rank) followed by a row-parallel output
projection; a SwiGLU MLP is a column-parallel gate/up and a row-parallel down projection:
one all-reduce per block.

With ``tp_size == 1`` every layer is an ``nn.Linear`` (same parameter names ``weight`` /
``bias``, same math). The TP size and rank default to :mod:`tandem.distributed.parallel_state`.

Every sharded parameter carries
* ``weight_loader(tensor, shard_id=None)``: copies a *full* checkpoint tensor (or one
  logical shard of a fused parameter: q/k/v, gate/up) into this rank's slice;
* ``full_shape`` and ``shard(full) -> local``: the unsharded shape and the slicing, so
  that dummy weights are drawn at the full shape and sliced, identical on every TP size
  (:func:`tandem.model_loader.loader.init_dummy_weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed import parallel_state as ps


def set_weight_attrs(param: nn.Parameter, full_shape: Sequence[int], shard: Callable[[torch.Tensor], torch.Tensor],
                     weight_loader: Callable[..., None]) -> None:
    param.full_shape = tuple(full_shape)
    param.shard = shard
    param.weight_loader = weight_loader


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape of {what}: checkpoint slice {tuple(src.shape)} vs model {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def _tp(tp_size: int | None, tp_rank: int | None) -> tuple[int, int]:
    size = ps.get_tp_size() if tp_size is None else tp_size
    rank = ps.get_tp_rank() if tp_rank is None else tp_rank
    return size, rank


class ColumnShardedLinear(nn.Module):
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

    def _shard_rows(self, full: torch.Tensor) -> torch.Tensor:
        parts, off = [], 0
        for f, start, rows in self.segments:
            parts.append(full[off + start: off + start + rows])
            off += f
        return torch.cat(parts)

    def _loader(self, param: nn.Parameter) -> Callable[..., None]:
        def load(tensor: torch.Tensor, shard_id: int | None = None) -> None:
            if shard_id is None:
                if tensor.shape[0] != self.full_out:
                    raise ValueError(f"checkpoint tensor of {tuple(tensor.shape)} for a layer of {self.full_out} rows")
                _copy(param, self._shard_rows(tensor), "fused linear")
                return
            full, start, rows = self.segments[shard_id]
            if tensor.shape[0] != full:
                raise ValueError(f"shard {shard_id}: checkpoint {tuple(tensor.shape)} vs {full} rows")
            off = sum(r for _, _, r in self.segments[:shard_id])
            _copy(param.narrow(0, off, rows), tensor[start: start + rows], f"shard {shard_id}")

        return load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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


class RowParallelLinear(nn.Module):
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.tp_size > 1 and self.reduce_results:
            y = ps.tp_all_reduce(y)
        if self.bias is None or (self.tp_size > 1 and not self.reduce_results and self.tp_rank != 0):
            return y  # unreduced partial sums: the bias is added by one rank only
        return y + self.bias


__all__ = ["ColumnParallelLinear", "ColumnShardedLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
           "RowParallelLinear", "kv_head_range", "set_weight_attrs"]
