"""The seam between an MoE layer and expert parallelism (EP): dispatch and combine.

An MoE layer calls, for every forward::

    h = all2all.dispatch_launch(hidden, topk_ids, topk_weights)   # tokens -> expert owners
    recv_hidden, recv_ids, recv_weights, meta = all2all.dispatch_wait(h)
    expert_out = local_experts(recv_hidden, recv_ids, recv_weights)
    h = all2all.combine_launch(expert_out, meta)                   # weighted results back
    out = all2all.combine_wait(h)

Each exchange is split into a *launch* and a *wait* half so that dual-batch overlap (see
docs/architecture.md) can run the other micro-batch's compute between them. The contract every
backend keeps:

* ``dispatch_launch(hidden [T, H], topk_ids [T, k] int64 global expert ids, topk_weights
  [T, k] fp32) -> handle``: starts sending each token to the ranks owning its experts.
* ``dispatch_wait(handle) -> (recv_hidden [N, H], recv_ids [N, k] int64, recv_weights
  [N, k] fp32, meta)``: the tokens this rank must process. ``recv_ids`` hold *local*
  expert ids (``0 .. num_local_experts-1``) and ``-1`` in slots whose expert lives on
  another rank; ``N`` is backend-defined (``T`` for ``local``, ``EP * T`` for an
  all-gather, a padded capacity for a fixed-size all-to-all).
* The layer computes ``expert_out [N, H]``: for every received row the sum over its valid
  slots of ``weight * expert(row)`` (rows without a valid slot give zeros).
* ``combine_launch(expert_out, meta) -> handle`` / ``combine_wait(handle) -> [T, H]``: sends
  the partial sums back and adds up, for each original token, the contributions of all
  ranks. ``meta`` is the opaque object ``dispatch_wait`` returned.

Handles are per call, so two micro-batches may have exchanges in flight at once; a backend
with preallocated buffers must keep one set per micro-batch.

Backends: ``local`` (EP=1, no communication) and ``simulated`` (EP=1 data plus a modeled
link delay, for studying overlap on one device; optionally with one EP rank's share of the
expert compute). ``allgather_reducescatter`` and
``all_to_all`` (torch.distributed, :mod:`tandem.distributed.ep_all2all`) implement the same
interface for EP>1; they pad every rank's tokens to the forward context's
``max_tokens_per_rank`` and keep their buffers in two slots (one per micro-batch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """Which rank owns which expert: contiguous blocks, as even as possible.

    Every rank holds ``num_experts // ep_size`` experts and the first ``num_experts %
    ep_size`` ranks one more (vLLM's linear expert map, ``determine_expert_map``): 10
    experts over 4 ranks are ``[0, 3) [3, 6) [6, 8) [8, 10)``.

    Raises:
        ValueError: a bad rank or size, or fewer experts than ranks (a rank without experts).
    """

    num_experts: int
    ep_size: int = 1
    ep_rank: int = 0

    def __post_init__(self) -> None:
        if self.ep_size < 1 or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"bad expert-parallel rank {self.ep_rank} of size {self.ep_size}")
        if self.num_experts < self.ep_size:
            raise ValueError(f"num_experts ({self.num_experts}) must be at least the EP size ({self.ep_size}): "
                             "every rank holds at least one expert")

    def rank_num_experts(self, rank: int) -> int:
        """Experts held by EP rank ``rank``."""
        base, extra = divmod(self.num_experts, self.ep_size)
        return base + (rank < extra)

    def rank_first_expert(self, rank: int) -> int:
        """Global id of the first expert of EP rank ``rank`` (:meth:`first_experts` on ints)."""
        base, extra = divmod(self.num_experts, self.ep_size)
        return rank * base + min(rank, extra)

    def first_experts(self, ranks: torch.Tensor) -> torch.Tensor:
        """Global id of the first expert of each EP rank in ``ranks`` (int64, same shape and
        device; no host sync, so it can run inside a CUDA graph capture)."""
        base, extra = divmod(self.num_experts, self.ep_size)
        return ranks * base + ranks.clamp(max=extra)

    @property
    def num_local_experts(self) -> int:
        return self.rank_num_experts(self.ep_rank)

    @property
    def first_local_expert(self) -> int:
        return self.rank_first_expert(self.ep_rank)

    def is_local(self, expert: int) -> bool:
        return self.first_local_expert <= expert < self.first_local_expert + self.num_local_experts

    def owner(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """EP rank owning each global expert id (same shape)."""
        base, extra = divmod(self.num_experts, self.ep_size)
        if extra == 0:
            return torch.div(topk_ids, base, rounding_mode="floor")
        big = extra * (base + 1)  # the first `extra` ranks hold base + 1 experts each
        return torch.where(topk_ids < big, torch.div(topk_ids, base + 1, rounding_mode="floor"),
                           extra + torch.div(topk_ids - big, base, rounding_mode="floor"))

    def to_local(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> local ids, ``-1`` where another rank owns the expert."""
        if self.ep_size == 1:
            return topk_ids
        local = topk_ids - self.first_local_expert
        return torch.where((local >= 0) & (local < self.num_local_experts), local, torch.full_like(local, -1))


class All2AllBackend(ABC):
    """Dispatch/combine of one EP group; see the module docstring for the contract."""

    name: str = "abstract"

    def __init__(self, placement: ExpertPlacement) -> None:
        self.placement = placement

    @abstractmethod
    def dispatch_launch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Any: ...

    @abstractmethod
    def dispatch_wait(self, handle: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]: ...

    @abstractmethod
    def combine_launch(self, expert_out: torch.Tensor, metadata: Any) -> Any: ...

    @abstractmethod
    def combine_wait(self, handle: Any) -> torch.Tensor: ...


class LocalAll2All(All2AllBackend):
    """EP=1: every expert is local; dispatch and combine pass tensors through."""

    name = "local"

    def __init__(self, placement: ExpertPlacement | int) -> None:
        if isinstance(placement, int):
            placement = ExpertPlacement(placement)
        if placement.ep_size != 1:
            raise ValueError("the local all2all backend needs ep_size == 1")
        super().__init__(placement)

    def dispatch_launch(self, hidden, topk_ids, topk_weights):
        return hidden, topk_ids, topk_weights

    def dispatch_wait(self, handle):
        hidden, topk_ids, topk_weights = handle
        return hidden, topk_ids, topk_weights, None

    def combine_launch(self, expert_out, metadata):
        return expert_out

    def combine_wait(self, handle):
        return handle


@dataclass
class LinkModel:
    """Time of one exchange: ``latency_s + bytes / bandwidth_bytes_per_s``.

    Bytes of a dispatch (and of a combine): every (token, expert) pair whose expert sits on
    another rank crosses the link once with ``hidden_size`` elements of the activation
    dtype (no de-duplication of a token sent twice to one rank, as in a plain all-to-all).
    With experts spread evenly over ``ep_size`` ranks the expected remote share is
    ``(ep_size - 1) / ep_size``; the modeled size depends only on shapes (no host sync).

    Defaults model one inter-node RDMA NIC per GPU (400 Gb/s ConnectX-7 class, ~40 GB/s
    achieved) with ~20 µs per exchange.
    """

    bandwidth_gbps: float = 40.0  # GB/s (1e9 bytes per second)
    latency_us: float = 20.0
    ep_size: int = 8

    def bytes(self, num_tokens: int, top_k: int, hidden_size: int, elem_bytes: int) -> float:
        remote = (self.ep_size - 1) / self.ep_size if self.ep_size > 1 else 1.0
        return num_tokens * top_k * hidden_size * elem_bytes * remote

    def seconds(self, num_tokens: int, top_k: int, hidden_size: int, elem_bytes: int) -> float:
        return self.latency_us * 1e-6 + self.bytes(num_tokens, top_k, hidden_size, elem_bytes) / (self.bandwidth_gbps * 1e9)


@dataclass
class _SimHandle:
    tensors: tuple[torch.Tensor, ...]
    event: Any = None  # torch.cuda.Event the consumer waits on (CUDA only)
    timing: tuple[Any, Any] | None = None


@dataclass
class SimRecord:
    """One simulated exchange: kind ("dispatch"/"combine"), tokens, modeled seconds."""

    kind: str
    num_tokens: int
    modeled_s: float
    timing: tuple[Any, Any] | None = field(default=None, repr=False)


class SimulatedAll2All(All2AllBackend):
    """EP=1 data movement (a real copy of the exchanged tensors) plus a modeled link delay.

    On CUDA the copies run on a communication stream behind ``torch.cuda._sleep`` for the
    modeled time (calibrated to the GPU clock once); the wait half makes the current stream
    wait on an event, so compute on the current stream overlaps the "transfer" exactly as
    it would a real all-to-all. On the CPU there is no sleep: the modeled time is only
    recorded (``records``), so tests stay fast and exact.

    With ``rank_experts`` the compute side is that of one rank of the simulated EP group
    instead of a GPU holding every expert: :attr:`placement` becomes rank 0 of
    ``link.ep_size`` (the layer holds ``E / ep_size`` experts) and ``dispatch_wait`` maps
    every global expert id ``e`` to local expert ``e % (E / ep_size)``. That is the load a
    rank receives when all ``ep_size`` ranks route like this one: ``T * k`` (token, expert)
    pairs over its ``E / ep_size`` experts, so each expert's GEMM gets ``ep_size`` times the
    rows for the same weight read. The results are not the model's (timing studies only).

    Args:
        placement: expert placement (``ep_size`` must be 1: the data stays local).
        link: the bandwidth + latency model; ``link.ep_size`` is the *simulated* EP size.
        record: keep a :class:`SimRecord` per exchange (``records``); with CUDA timing
            events outside graph capture, :meth:`measured` returns the measured times.
        rank_experts: compute one EP rank's share of the experts (see above).

    Raises:
        ValueError: ``placement.ep_size != 1``; with ``rank_experts``, ``num_experts`` not
            a multiple of ``link.ep_size``.
    """

    name = "simulated"

    def __init__(self, placement: ExpertPlacement | int, link: LinkModel | None = None, record: bool = True,
                 rank_experts: bool = False) -> None:
        if isinstance(placement, int):
            placement = ExpertPlacement(placement)
        if placement.ep_size != 1:
            raise ValueError("the simulated all2all backend keeps data local: ep_size must be 1")
        link = link or LinkModel()
        if rank_experts:
            if placement.num_experts % link.ep_size:
                # `id % (E / ep_size)` models a rank of an even split only.
                raise ValueError(f"rank_experts: num_experts ({placement.num_experts}) must be a multiple of the "
                                 f"simulated EP size ({link.ep_size})")
            placement = ExpertPlacement(placement.num_experts, link.ep_size, 0)
        super().__init__(placement)
        self.link = link
        self.rank_experts = rank_experts
        self.record = record
        self.records: list[SimRecord] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    # ------------------------------------------------------------ CUDA helpers
    _cycles_per_s: dict[int, float] = {}

    @classmethod
    def _calibrate(cls, device: torch.device) -> float:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in cls._cycles_per_s:
            with torch.cuda.device(idx):
                cycles = 10_000_000
                torch.cuda._sleep(cycles // 10)  # warm-up
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
                end.synchronize()
                cls._cycles_per_s[idx] = cycles / (start.elapsed_time(end) * 1e-3)
        return cls._cycles_per_s[idx]

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _exchange(self, kind: str, srcs: tuple[torch.Tensor, ...], num_tokens: int, hidden: torch.Tensor, top_k: int) -> _SimHandle:
        t = self.link.seconds(num_tokens, top_k, hidden.shape[-1], hidden.element_size())
        outs = tuple(torch.empty_like(s) for s in srcs)  # allocated on the consumer's stream
        if hidden.device.type != "cuda":
            for o, s in zip(outs, srcs):
                o.copy_(s)
            if self.record:
                self.records.append(SimRecord(kind, num_tokens, t))
            return _SimHandle(outs)
        compute = torch.cuda.current_stream(hidden.device)
        comm = self._stream(hidden.device)
        capturing = torch.cuda.is_current_stream_capturing()
        timing = None
        comm.wait_stream(compute)
        with torch.cuda.stream(comm):
            if self.record and not capturing:
                timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                timing[0].record()
            cycles = int(t * self._calibrate(hidden.device))
            if cycles > 0:
                torch.cuda._sleep(cycles)
            for o, s in zip(outs, srcs):
                o.copy_(s, non_blocking=True)
            if timing is not None:
                timing[1].record()
            done = torch.cuda.Event()
            done.record()
        for s in srcs:
            s.record_stream(comm)
        if self.record:
            self.records.append(SimRecord(kind, num_tokens, t, timing))
        return _SimHandle(outs, done, timing)

    @staticmethod
    def _wait(handle: _SimHandle) -> None:
        if handle.event is not None:
            torch.cuda.current_stream().wait_event(handle.event)

    def measured(self) -> list[tuple[str, int, float, float | None]]:
        """(kind, tokens, modeled s, measured s or None) per recorded exchange (syncs)."""
        out = []
        for r in self.records:
            m = None
            if r.timing is not None:
                r.timing[1].synchronize()
                m = r.timing[0].elapsed_time(r.timing[1]) * 1e-3
            out.append((r.kind, r.num_tokens, r.modeled_s, m))
        return out

    # -------------------------------------------------------------- interface
    def dispatch_launch(self, hidden, topk_ids, topk_weights):
        return self._exchange("dispatch", (hidden, topk_ids, topk_weights), hidden.shape[0], hidden, topk_ids.shape[-1])

    def dispatch_wait(self, handle):
        self._wait(handle)
        hidden, topk_ids, topk_weights = handle.tensors
        if self.rank_experts:
            topk_ids = topk_ids % self.placement.num_local_experts
        return hidden, topk_ids, topk_weights, topk_ids.shape[-1]

    def combine_launch(self, expert_out, metadata):
        return self._exchange("combine", (expert_out,), expert_out.shape[0], expert_out, metadata)

    def combine_wait(self, handle):
        self._wait(handle)
        return handle.tensors[0]


__all__ = ["All2AllBackend", "ExpertPlacement", "LinkModel", "LocalAll2All", "SimRecord", "SimulatedAll2All"]
