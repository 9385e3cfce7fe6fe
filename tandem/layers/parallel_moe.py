"""Routed experts under tensor and expert parallelism.

:class:`ParallelFusedMoE` is :class:`~tandem.layers.moe.FusedMoE` with the sharding of
the deployment (:mod:`tandem.distributed.parallel_state`):

* **EP** (the all2all backend's placement has ``ep_size > 1``): this rank holds whole
  experts ``first_local_expert .. + num_local_experts`` (``ExpertPlacement``); dispatch and
  combine move the tokens. Experts are not TP-sharded then: with TP > 1 every TP rank
  dispatches its (identical) copy of the tokens and receives complete sums for it.
* **TP without EP**: every rank holds every expert with the intermediate dim sharded
  (``moe_intermediate_size / tp`` rows of gate and of up, the matching columns of down),
  computes partial sums and all-reduces them over the TP group after the combine.

Checkpoint tensors are given whole (``load_fused`` / ``load_expert`` slice this rank's
part); dummy weights are drawn at the full ``[E, 2I, H]`` / ``[E, H, I]`` shape and sliced
(``full_shape`` / ``shard`` attributes), so every parallel layout sees the same model.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from tandem.distributed import parallel_state as ps
from tandem.distributed.all2all import All2AllBackend
from tandem.layers.moe import FusedMoE


class ParallelFusedMoE(FusedMoE):
    """Arguments as :class:`FusedMoE`, with ``intermediate_size`` the *full* size.

    Raises:
        ValueError: ``intermediate_size`` is not a multiple of the TP size (TP without EP).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 all2all: All2AllBackend | None = None, impl: str = "auto", tp_size: int | None = None,
                 tp_rank: int | None = None) -> None:
        tp = ps.get_tp_size() if tp_size is None else tp_size
        rank = ps.get_tp_rank() if tp_rank is None else tp_rank
        ep = all2all.placement.ep_size if all2all is not None else 1
        self_tp = tp if ep == 1 else 1
        if intermediate_size % self_tp:
            raise ValueError(f"moe intermediate size ({intermediate_size}) must be a multiple of the TP size ({tp})")
        super().__init__(num_experts, top_k, hidden_size, intermediate_size // self_tp, all2all, impl)
        self.tp_size, self.tp_rank = self_tp, rank if self_tp > 1 else 0
        self.full_intermediate_size = intermediate_size
        e, h, i = num_experts, hidden_size, intermediate_size
        self.w13.full_shape, self.w13.shard = (e, 2 * i, h), self._shard_w13
        self.w2.full_shape, self.w2.shard = (e, h, i), self._shard_w2

    # ------------------------------------------------------------------ slicing
    def _tp_rows(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        n = self.intermediate_size
        return t.narrow(dim, self.tp_rank * n, n) if self.tp_size > 1 else t

    def _tp_slice(self, t: torch.Tensor, dim: int, unit: int = 1) -> torch.Tensor:
        n = self.intermediate_size // unit
        return t.narrow(dim, self.tp_rank * n, n) if self.tp_size > 1 else t

    def _slice_w13_tp(self, full: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return full
        gate, up = full.chunk(2, dim=-2)
        return torch.cat([self._tp_rows(gate, -2), self._tp_rows(up, -2)], dim=-2)

    def _experts(self, full: torch.Tensor) -> torch.Tensor:
        pl = self.all2all.placement
        return full[pl.first_local_expert: pl.first_local_expert + pl.num_local_experts]

    def _shard_w13(self, full: torch.Tensor) -> torch.Tensor:
        return self._slice_w13_tp(self._experts(full))

    def _shard_w2(self, full: torch.Tensor) -> torch.Tensor:
        return self._tp_rows(self._experts(full), -1)

    # ------------------------------------------------------------------ loading
    def load_fused(self, which: str, tensor: torch.Tensor) -> None:
        """Whole stacked checkpoint tensor (``[E, 2I, H]`` / ``[E, H, I]``); keeps this
        rank's experts and intermediate slice.

        Raises:
            ValueError: shape mismatch.
        """
        full_i = self.full_intermediate_size
        if which == "w13" and tensor.shape[-2] == 2 * full_i:
            tensor = self._slice_w13_tp(tensor)
        elif which == "w2" and tensor.shape[-1] == full_i:
            tensor = self._tp_rows(tensor, -1)
        super().load_fused(which, tensor)

    def load_expert(self, which: str, expert: int, tensor: torch.Tensor, shard: int | None = None) -> bool:
        """One expert's whole matrix (gate/up ``[I, H]``, down ``[H, I]``); see FusedMoE."""
        full_i = self.full_intermediate_size
        if which == "w13" and tensor.shape[0] == full_i:
            tensor = self._tp_rows(tensor, 0)
        elif which == "w2" and tensor.shape[-1] == full_i:
            tensor = self._tp_rows(tensor, -1)
        return super().load_expert(which, expert, tensor, shard)

    # ------------------------------------------------------------------ forward
    @property
    def fuses_addend(self) -> bool:
        """No addend under TP: the experts' partial sums are all-reduced afterwards."""
        return super().fuses_addend and self.tp_size == 1

    def forward_steps(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      addend: torch.Tensor | None = None) -> Generator[str, None, torch.Tensor]:
        out = yield from super().forward_steps(hidden, topk_ids, topk_weights, addend)
        if self.tp_size > 1:
            out = ps.tp_all_reduce(out)
        return out


__all__ = ["ParallelFusedMoE"]
