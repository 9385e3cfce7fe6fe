"""Expert-parallel dispatch/combine over torch.distributed (NCCL on GPUs, gloo on the CPU).

Both backends keep the contract of :mod:`tandem.distributed.all2all` and have static shapes:
every rank pads its ``T`` local tokens of a forward to ``C = max_tokens_per_rank`` of the
current :class:`~tandem.distributed.forward_context.ForwardContext` (the largest token count
of the forward on any rank, agreed by the model runner's per-step DP collective), so every
rank's collectives have the same size whatever its own batch holds, no host sync is needed,
and the exchange can be captured in a CUDA graph (NCCL). ``T = 0`` (an idle rank) is fine.

* :class:`AllGatherReduceScatterAll2All` (``allgather_reducescatter``, the simple one,
  vLLM's "naive"/allgather-reducescatter EP): all-gather the padded hidden states and the
  routing (ids + weights packed into one fp32 tensor) of every rank: ``N = EP * C`` rows,
  the ids mapped to this rank's local experts (``-1`` elsewhere); every rank computes its
  experts' contribution for every gathered token; a reduce-scatter (sum) returns each rank
  the complete sums of its own tokens. gloo has no reduce-scatter in older torch releases:
  there it is an all-reduce of the ``[EP * C, H]`` partial sums and a slice.
* :class:`AllToAllAll2All` (``all_to_all``): fixed-capacity per-destination buffers and
  ``all_to_all_single``. A token is sent once to each rank owning at least one of its
  ``k`` experts (not once per expert), so a destination receives at most ``C`` tokens from a
  source: the capacity is ``C`` rows per (source, destination) pair, which never drops a
  token (the per-(token, expert) bound ``C * k`` would only be needed without this
  de-duplication). Each row carries its ``k`` routing slots with the ids local to the
  destination (``-1`` for experts elsewhere). Rows are compacted to the front of their
  destination's block (a cumsum over the routing mask, no host sync); unused rows have ids
  ``-1`` and contribute nothing. Combine sends the partial sums back through the same
  layout and adds, for each token, the rows of every destination. ``N = EP * C``.

Launch and wait halves: ``*_launch`` starts the collectives with ``async_op=True`` and
returns the work handles; ``*_wait`` calls ``work.wait()`` (on CUDA: the current stream
waits for NCCL's, the host does not block), so dual-batch overlap can run the other
micro-batch between them.

Buffers: the send/receive buffers of one model (every MoE layer: the factory of
:func:`tandem.distributed.all2all_factory.make_all2all_factory` shares one
:class:`EPBufferPool`) are preallocated in **two
slots**, one per micro-batch in flight: ``dispatch_launch`` uses the slot of the running
ubatch's id (``ForwardContext.ubatch_id``, 0 without DBO), and ``combine`` reuses its
dispatch's slot. Buffers grow to
the largest ``C`` seen and are never shrunk; call :meth:`EPBufferPool.reserve` with the
largest token count before capturing CUDA graphs so that addresses stay fixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tandem.distributed.all2all import All2AllBackend, ExpertPlacement
from tandem.distributed.forward_context import get_forward_context

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _ubatch_slot() -> int:
    """The buffer slot of the running ubatch: its id in the forward context."""
    ctx = get_forward_context()
    return 0 if ctx is None else ctx.ubatch_id


def forward_capacity(num_tokens: int) -> int:
    """``max_tokens_per_rank`` of the current forward context (rows every rank pads to).

    Raises:
        RuntimeError: no forward context is set (a multi-rank exchange cannot agree on a
            size without one; the model runner sets it around every forward).
        ValueError: this rank has more tokens than the agreed maximum.
    """
    ctx = get_forward_context()
    if ctx is None:
        raise RuntimeError("expert-parallel all2all (EP > 1) needs a ForwardContext(max_tokens_per_rank=...) around "
                           "the forward (tandem.distributed.forward_context); the model runner sets it")
    if num_tokens > ctx.max_tokens_per_rank:
        raise ValueError(f"{num_tokens} local tokens exceed the forward's max_tokens_per_rank "
                         f"({ctx.max_tokens_per_rank})")
    return ctx.max_tokens_per_rank


class EPBufferPool:
    """Preallocated flat buffers in ``num_slots`` slots, shared by the MoE layers of a model.

    ``get(slot, name, shape, dtype, device)`` returns a view of the first ``prod(shape)``
    elements of the slot's buffer ``name`` (grown when too small; the old storage is kept
    alive so that captured CUDA graphs never point at freed memory).
    """

    def __init__(self, num_slots: int = 2) -> None:
        self.num_slots = num_slots
        self._bufs: list[dict[str, torch.Tensor]] = [{} for _ in range(num_slots)]
        self._retired: list[torch.Tensor] = []
        self.reserved_tokens = 0

    def reserve(self, max_tokens: int) -> None:
        """Allocate buffers made from now on for ``max_tokens`` tokens per rank, so that
        they never grow later (call before the first forward, e.g. before capturing CUDA
        graphs)."""
        self.reserved_tokens = max(self.reserved_tokens, max_tokens)

    def get(self, slot: int, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            alloc_shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """View ``shape`` of the slot's buffer ``name``; a new buffer gets ``alloc_shape``
        elements (>= ``shape``'s)."""
        numel = math.prod(shape)
        buf = self._bufs[slot].get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            if buf is not None:
                self._retired.append(buf)
            buf = torch.empty(max(numel, math.prod(alloc_shape or shape)), dtype=dtype, device=device)
            self._bufs[slot][name] = buf
        return buf[:numel].view(shape)


@dataclass
class _Handle:
    works: list[Any]
    tensors: tuple[torch.Tensor, ...]
    meta: Any = None
    extra: dict = field(default_factory=dict)


def _wait(works: list[Any]) -> None:
    for w in works:
        if w is not None:
            w.wait()


class _DistributedAll2All(All2AllBackend):
    def __init__(self, placement: ExpertPlacement, group: dist.ProcessGroup | None,
                 pool: EPBufferPool | None = None) -> None:
        super().__init__(placement)
        size = dist.get_world_size(group) if group is not None else 1
        if size != placement.ep_size:
            raise ValueError(f"EP group of {size} ranks for a placement of EP size {placement.ep_size}")
        if group is not None and dist.get_rank(group) != placement.ep_rank:
            raise ValueError(f"EP rank {dist.get_rank(group)} in the group != placement rank {placement.ep_rank}")
        self.group = group
        self.pool = pool if pool is not None else EPBufferPool()
        self.is_gloo = group is not None and dist.get_backend(group) == "gloo"

    @property
    def ep_size(self) -> int:
        return self.placement.ep_size

    @staticmethod
    def _pack_routing(buf: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """``buf [R, 2k]`` fp32 <- ids (exact below 2**24) | weights."""
        k = ids.shape[-1]
        buf[:, :k].copy_(ids)
        buf[:, k:].copy_(weights)


class AllGatherReduceScatterAll2All(_DistributedAll2All):
    """All-gather dispatch, reduce-scatter combine (see the module docstring).

    Args:
        placement: this rank's expert placement (``ep_size`` = the group's size).
        group: the EP process group (NCCL or gloo); None only for ``ep_size == 1``.
        pool: shared buffer pool (one per model).
    """

    name = "allgather_reducescatter"

    def dispatch_launch(self, hidden, topk_ids, topk_weights):
        t, h = hidden.shape
        k = topk_ids.shape[-1]
        c = forward_capacity(t)
        ep, dev = self.ep_size, hidden.device
        slot = _ubatch_slot()
        ca = max(c, self.pool.reserved_tokens)  # allocation size
        if c == 0:
            return _Handle([], (hidden.new_empty(0, h), topk_ids.new_empty(0, k), topk_weights.new_empty(0, k)),
                           (t, 0, slot))
        send_h = self.pool.get(slot, "ag_send_h", (c, h), hidden.dtype, dev, (ca, h))
        send_m = self.pool.get(slot, "ag_send_m", (c, 2 * k), torch.float32, dev, (ca, 2 * k))
        send_h[:t].copy_(hidden)
        send_h[t:].zero_()
        self._pack_routing(send_m[:t], topk_ids, topk_weights)
        send_m[t:, :k].fill_(-1.0)
        send_m[t:, k:].zero_()
        recv_h = self.pool.get(slot, "ag_recv_h", (ep * c, h), hidden.dtype, dev, (ep * ca, h))
        recv_m = self.pool.get(slot, "ag_recv_m", (ep * c, 2 * k), torch.float32, dev, (ep * ca, 2 * k))
        works = [_all_gather(recv_h, send_h, group=self.group, async_op=True),
                 _all_gather(recv_m, send_m, group=self.group, async_op=True)]
        return _Handle(works, (recv_h, recv_m), (t, c, slot))

    def dispatch_wait(self, handle):
        _wait(handle.works)
        t, c, _ = handle.meta
        if c == 0:
            return (*handle.tensors, handle.meta)
        recv_h, recv_m = handle.tensors
        k = recv_m.shape[1] // 2
        ids = recv_m[:, :k].long()
        local = self.placement.to_local(ids)
        local = torch.where(ids < 0, torch.full_like(local, -1), local)
        return recv_h, local, recv_m[:, k:], handle.meta

    def combine_launch(self, expert_out, metadata):
        t, c, slot = metadata
        if c == 0:
            return _Handle([], (expert_out[:0],), metadata)
        expert_out = expert_out.contiguous()
        if self.is_gloo:
            # gloo: all-reduce the partial sums of every rank's tokens, keep our block.
            return _Handle([dist.all_reduce(expert_out, group=self.group, async_op=True)], (expert_out,), metadata,
                           {"slice": True})
        out = expert_out.new_empty(c, expert_out.shape[1])
        return _Handle([_reduce_scatter(out, expert_out, group=self.group, async_op=True)], (out,), metadata)

    def combine_wait(self, handle):
        _wait(handle.works)
        t, c, _ = handle.meta
        out = handle.tensors[0]
        if c == 0:
            return out
        if handle.extra.get("slice"):
            r = self.placement.ep_rank
            return out[r * c: r * c + t]
        return out[:t]


class AllToAllAll2All(_DistributedAll2All):
    """Fixed-capacity padded all-to-all (see the module docstring); CUDA-graph capturable
    on NCCL (static shapes, no host sync).

    Args: as :class:`AllGatherReduceScatterAll2All`.
    """

    name = "all_to_all"

    def dispatch_launch(self, hidden, topk_ids, topk_weights):
        t, h = hidden.shape
        k = topk_ids.shape[-1]
        c = forward_capacity(t)
        ep, dev = self.ep_size, hidden.device
        slot = _ubatch_slot()
        ca = max(c, self.pool.reserved_tokens)  # allocation size
        if c == 0:
            return _Handle([], (hidden.new_empty(0, h), topk_ids.new_empty(0, k), topk_weights.new_empty(0, k)),
                           (t, 0, None, slot))
        owner = self.placement.owner(topk_ids)  # [T, k]
        dests = torch.arange(ep, device=dev)
        first = self.placement.first_experts(dests)  # [ep]
        hit = owner[:, None, :] == dests[None, :, None]  # [T, ep, k]
        mask = hit.any(-1)  # [T, ep]: token t goes to rank d
        pos = mask.long().cumsum(0) - 1  # its row in d's block
        garbage = ep * c  # one spare row takes every unused (token, destination) pair
        dest_row = torch.where(mask, dests[None, :] * c + pos, torch.full_like(pos, garbage))  # [T, ep]
        send_h = self.pool.get(slot, "a2a_send_h", (ep * c + 1, h), hidden.dtype, dev, (ep * ca + 1, h))
        send_m = self.pool.get(slot, "a2a_send_m", (ep * c + 1, 2 * k), torch.float32, dev, (ep * ca + 1, 2 * k))
        send_h.zero_()
        send_m[:, :k].fill_(-1.0)
        send_m[:, k:].zero_()
        for d in range(ep):  # ep index_copy's of T rows (no [T, ep, H] temporary)
            send_h.index_copy_(0, dest_row[:, d], hidden)
        local_ids = torch.where(hit, topk_ids[:, None, :] - first[None, :, None], -1)  # [T, ep, k]
        local_w = torch.where(hit, topk_weights[:, None, :].float(), 0.0)
        send_m.index_copy_(0, dest_row.reshape(-1), torch.cat([local_ids.float(), local_w], -1).reshape(t * ep, 2 * k))
        recv_h = self.pool.get(slot, "a2a_recv_h", (ep * c, h), hidden.dtype, dev, (ep * ca, h))
        recv_m = self.pool.get(slot, "a2a_recv_m", (ep * c, 2 * k), torch.float32, dev, (ep * ca, 2 * k))
        works = [dist.all_to_all_single(recv_h, send_h[:garbage], group=self.group, async_op=True),
                 dist.all_to_all_single(recv_m, send_m[:garbage], group=self.group, async_op=True)]
        return _Handle(works, (recv_h, recv_m), (t, c, dest_row, slot))

    def dispatch_wait(self, handle):
        _wait(handle.works)
        t, c, _, _ = handle.meta
        if c == 0:
            return (*handle.tensors, handle.meta)
        recv_h, recv_m = handle.tensors
        k = recv_m.shape[1] // 2
        return recv_h, recv_m[:, :k].long(), recv_m[:, k:], handle.meta

    def combine_launch(self, expert_out, metadata):
        t, c, dest_row, slot = metadata
        if c == 0:
            return _Handle([], (expert_out.new_zeros(t, expert_out.shape[1]),), metadata)
        ep, h = self.ep_size, expert_out.shape[1]
        ca = max(c, self.pool.reserved_tokens)
        back = self.pool.get(slot, "a2a_back", (ep * c + 1, h), expert_out.dtype, expert_out.device, (ep * ca + 1, h))
        back[ep * c].zero_()
        work = dist.all_to_all_single(back[: ep * c], expert_out.contiguous(), group=self.group, async_op=True)
        return _Handle([work], (back,), metadata)

    def combine_wait(self, handle):
        _wait(handle.works)
        t, c, dest_row, _ = handle.meta
        if c == 0:
            return handle.tensors[0]
        return handle.tensors[0][dest_row].sum(dim=1)  # [T, ep, H] -> [T, H]


__all__ = ["AllGatherReduceScatterAll2All", "AllToAllAll2All", "EPBufferPool", "forward_capacity"]
