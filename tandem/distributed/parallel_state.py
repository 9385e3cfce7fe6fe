"""Process groups of one Tandem deployment: data parallel (DP) x pipeline parallel (PP) x
tensor parallel (TP), and expert parallel (EP) within each pipeline stage.

World layout (``world_size = dp_size * pp_size * tp_size``): global rank ``r = (dp_rank *
pp_size + pp_rank) * tp_size + tp_rank``, so the ranks of one TP group are consecutive (one
stage's shards sit on neighbouring GPUs, where NVLink is fastest) and a DP replica's whole
pipeline is one block of ranks. Groups (every rank builds all of them, in the same order, as
``torch.distributed.new_group`` requires; groups of size 1 are not built and their getters
return None):

* **TP group** (``get_tp_group``, device backend: NCCL on CUDA, gloo on the CPU): the
  all-reduces after row-parallel layers. ``get_tp_cpu_group`` (gloo, same ranks) carries
  the driver's per-step ``SchedulerOutput`` broadcast to the other TP ranks.
* **PP group** (``get_pp_group``, device backend): the ranks with this ``tp_rank`` in every
  stage of this rank's pipeline, by stage; the stage-to-stage sends of hidden states
  (:mod:`tandem.distributed.pipeline`). ``get_pp_cpu_group`` (gloo, same ranks) carries the
  last stage's step results back to the driver.
* **Replica group** (``get_replica_cpu_group``, gloo): every rank of this DP replica (its
  stages and their TP ranks; the TP group's gloo group without PP): the driver's per-step
  ``SchedulerOutput`` broadcast and the agreement on the KV cache size (:func:`replica_min`).
* **DP group** (``get_dp_group``, **gloo**): the ranks with this ``(pp_rank, tp_rank)`` in
  every DP replica; the model runner's per-step :func:`~tandem.worker.step_plan.agree_across_dp`
  (CPU tensors, no GPU sync). ``get_dp_control_group`` (gloo, same ranks) is the engine
  loop's own group (request routing, lockstep, output gathering) so that the loop (main
  thread) and the runner (a worker thread on the CPU) never share a group.
* **EP group** (``get_ep_group``, device backend): when expert parallelism is on, every
  rank of this pipeline stage in every DP replica (``ep_size = dp_size * tp_size``,
  ``ep_rank = dp_rank * tp_size + tp_rank``; the whole world without PP), else None.

Rendezvous: ``torchrun`` / env:// (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``LOCAL_RANK`` in the environment) or explicit ``rank``/``world_size``
with ``tcp://master_addr:master_port`` (Tandem's own single-machine launcher,
:mod:`tandem.distributed.launch`). Not distributed (one process, nothing in the
environment): every getter returns None / size 1 / rank 0 and no process group is made.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelInfo:
    """This process's place in the deployment (all sizes >= 1)."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0

    @property
    def is_driver(self) -> bool:
        """TP rank 0 of the first pipeline stage: runs the scheduler of its DP replica."""
        return self.tp_rank == 0 and self.pp_rank == 0

    @property
    def has_followers(self) -> bool:
        """The replica has ranks besides its driver (TP or PP), which run its steps too."""
        return self.tp_size * self.pp_size > 1

    @property
    def is_first_stage(self) -> bool:
        """Holds the embedding (pipeline stage 0)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Holds the final norm and LM head, and samples (the last pipeline stage)."""
        return self.pp_rank == self.pp_size - 1


@dataclass
class _State:
    info: ParallelInfo
    device_backend: str | None = None
    tp_group: dist.ProcessGroup | None = None
    tp_cpu_group: dist.ProcessGroup | None = None
    tp_ranks: tuple[int, ...] = (0,)
    dp_group: dist.ProcessGroup | None = None
    dp_control_group: dist.ProcessGroup | None = None
    dp_ranks: tuple[int, ...] = (0,)
    pp_group: dist.ProcessGroup | None = None
    pp_cpu_group: dist.ProcessGroup | None = None
    pp_ranks: tuple[int, ...] = (0,)
    replica_cpu_group: dist.ProcessGroup | None = None
    replica_ranks: tuple[int, ...] = (0,)
    ep_group: dist.ProcessGroup | None = None
    owns_process_group: bool = False


_STATE = _State(ParallelInfo())


def env_rendezvous() -> bool:
    """Whether torchrun-style variables (``RANK`` and ``WORLD_SIZE``) are set."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(tp_size: int = 1, dp_size: int = 1, enable_expert_parallel: bool = False, *,
                     pp_size: int = 1, rank: int | None = None, world_size: int | None = None, local_rank: int | None = None,
                     master_addr: str | None = None, master_port: int | None = None, backend: str = "auto",
                     device: torch.device | str | None = None,
                     timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                     store_hosted: bool = False) -> ParallelInfo:
    """Join (or create) the default process group and build the TP, PP, DP and EP groups.

    Args:
        tp_size / dp_size / pp_size: the parallel sizes; ``tp_size * pp_size * dp_size``
            must equal the world.
        enable_expert_parallel: shard MoE experts over the ranks of each pipeline stage (EP
            group = the world without PP).
        rank / world_size / local_rank: explicit ranks (Tandem's launcher); None: from the
            environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) when set, else one process.
        master_addr / master_port: rendezvous address for explicit ranks (default
            ``MASTER_ADDR``/``MASTER_PORT`` from the environment, else 127.0.0.1:29500).
        backend: "auto" (NCCL when ``device`` is CUDA, else gloo), "nccl" or "gloo".
        device: the rank's device (CUDA: ``cuda:local_rank`` is selected).
        timeout: collective timeout of the default group.
        store_hosted: explicit ranks only: the rendezvous store at ``master_addr:master_port``
            is served by the launching process (:func:`tandem.distributed.launch.host_store`),
            every rank, rank 0 included, connects to it as a client.

    Returns:
        This rank's :class:`ParallelInfo` (also kept for the getters below).

    Raises:
        ValueError: sizes do not multiply to the world size, or bad ranks.
    """
    global _STATE
    if tp_size < 1 or dp_size < 1 or pp_size < 1:
        raise ValueError(f"tensor_parallel_size, pipeline_parallel_size and data_parallel_size must be >= 1, got "
                         f"{tp_size}, {pp_size}, {dp_size}")
    replica = tp_size * pp_size
    if rank is None and env_rendezvous():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
        init_method = "env://"
    else:
        rank = 0 if rank is None else rank
        world_size = replica * dp_size if world_size is None else world_size
        addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = master_port or int(os.environ.get("MASTER_PORT", "29500"))
        init_method = f"tcp://{addr}:{port}"
    local_rank = rank if local_rank is None else local_rank
    if world_size != replica * dp_size:
        raise ValueError(f"world size {world_size} != tensor_parallel_size ({tp_size}) x pipeline_parallel_size "
                         f"({pp_size}) x data_parallel_size ({dp_size})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside the world of {world_size}")
    dp_rank, pp_rank, tp_rank = rank // replica, rank // tp_size % pp_size, rank % tp_size
    ep = enable_expert_parallel
    info = ParallelInfo(world_size, rank, local_rank, dp_size, dp_rank, tp_size, tp_rank,
                        dp_size * tp_size if ep else 1, dp_rank * tp_size + tp_rank if ep else 0, pp_size, pp_rank)
    if world_size == 1:
        _STATE = _State(info)
        return info

    dev = torch.device(device) if device is not None else None
    if backend == "auto":
        backend = "nccl" if dev is not None and dev.type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(dev if dev is not None and dev.index is not None else torch.device("cuda", local_rank))
    owns = False
    if not dist.is_initialized():
        kwargs = dict(backend=backend, timeout=timeout)
        if init_method != "env://":
            kwargs.update(rank=rank, world_size=world_size)
        if store_hosted and init_method != "env://":
            kwargs["store"] = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
        else:
            kwargs["init_method"] = init_method
        dist.init_process_group(**kwargs)
        owns = True
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ValueError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                         f"{dist.get_world_size()}, not {rank} of {world_size}")
    state = _State(info, device_backend=backend, owns_process_group=owns)
    # Every rank creates every group, in this order.
    long = datetime.timedelta(days=7)  # control groups wait out idle periods between requests
    def at(d: int, p: int, t: int) -> int:  # the global rank of (dp, pp, tp)
        return (d * pp_size + p) * tp_size + t

    for d in range(dp_size):
        for p in range(pp_size):
            ranks = [at(d, p, t) for t in range(tp_size)]
            if tp_size > 1:
                g = dist.new_group(ranks, backend=backend, timeout=timeout)
                gc = dist.new_group(ranks, backend="gloo", timeout=long)
                if (d, p) == (dp_rank, pp_rank):
                    state.tp_group, state.tp_cpu_group, state.tp_ranks = g, gc, tuple(ranks)
    for p in range(pp_size):
        for t in range(tp_size):
            ranks = [at(d, p, t) for d in range(dp_size)]
            if dp_size > 1:
                g = dist.new_group(ranks, backend="gloo", timeout=timeout)
                gc = dist.new_group(ranks, backend="gloo", timeout=long)
                if (p, t) == (pp_rank, tp_rank):
                    state.dp_group, state.dp_control_group, state.dp_ranks = g, gc, tuple(ranks)
    for d in range(dp_size):
        for t in range(tp_size):
            ranks = [at(d, p, t) for p in range(pp_size)]
            if pp_size > 1:
                g = dist.new_group(ranks, backend=backend, timeout=timeout)
                gc = dist.new_group(ranks, backend="gloo", timeout=long)
                if (d, t) == (dp_rank, tp_rank):
                    state.pp_group, state.pp_cpu_group, state.pp_ranks = g, gc, tuple(ranks)
    for d in range(dp_size):
        ranks = list(range(d * replica, (d + 1) * replica))
        if pp_size > 1:
            gc = dist.new_group(ranks, backend="gloo", timeout=long)
            if d == dp_rank:
                state.replica_cpu_group = gc
        if d == dp_rank:
            state.replica_ranks = tuple(ranks)
    if info.ep_size > 1:
        for p in range(pp_size):
            g = dist.new_group([at(d, p, t) for d in range(dp_size) for t in range(tp_size)], backend=backend,
                               timeout=timeout)
            if p == pp_rank:
                state.ep_group = g
    if tp_size == 1:
        state.tp_ranks = (rank,)
    if dp_size == 1:
        state.dp_ranks = (rank,)
    if pp_size == 1:
        state.pp_ranks = (rank,)
        state.replica_cpu_group = state.tp_cpu_group
    _STATE = state
    logger.info("rank %d/%d: dp %d/%d, pp %d/%d, tp %d/%d, ep %d/%d (%s)", rank, world_size, info.dp_rank, dp_size,
                info.pp_rank, pp_size, info.tp_rank, tp_size, info.ep_rank, info.ep_size, backend)
    return info


def destroy_distributed() -> None:
    """Forget the groups; destroy the default group if :func:`init_distributed` made it."""
    global _STATE
    owns = _STATE.owns_process_group
    _STATE = _State(ParallelInfo())
    if owns and dist.is_initialized():
        dist.destroy_process_group()


def get_parallel_info() -> ParallelInfo:
    return _STATE.info


def is_distributed() -> bool:
    return _STATE.info.world_size > 1


def get_world_size() -> int:
    return _STATE.info.world_size


def get_rank() -> int:
    return _STATE.info.rank


# ------------------------------------------------------------------------------ TP
def get_tp_group() -> dist.ProcessGroup | None:
    """Device group of this rank's TP group (None when ``tp_size == 1``)."""
    return _STATE.tp_group


def get_tp_cpu_group() -> dist.ProcessGroup | None:
    """gloo group over the same ranks as :func:`get_tp_group` (object broadcasts)."""
    return _STATE.tp_cpu_group


def get_tp_size() -> int:
    return _STATE.info.tp_size


def get_tp_rank() -> int:
    return _STATE.info.tp_rank


def get_tp_src_rank() -> int:
    """Global rank of this TP group's driver (TP rank 0)."""
    return _STATE.tp_ranks[0]


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group in place (identity when ``tp_size == 1``); returns it."""
    g = _STATE.tp_group
    if g is not None:
        dist.all_reduce(x, group=g)
    return x


def _group_min(value: int, group: dist.ProcessGroup | None) -> int:
    """Smallest ``value`` over ``group`` (``value`` itself without one)."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def tp_min(value: int) -> int:
    """Smallest ``value`` over the TP group (gloo; ``value`` itself when ``tp_size == 1``)."""
    return _group_min(value, _STATE.tp_cpu_group)


def forward_min(value: int) -> int:
    """Smallest ``value`` over every rank whose forwards exchange data with this one's: the
    TP group, and with expert parallelism all DP replicas too (gloo; ``value`` itself on
    one rank). For choices that change a forward's collectives (e.g. split or plain CUDA
    graph of a size), which must then be the same everywhere."""
    return _group_min(tp_min(value), _STATE.dp_group if _STATE.info.ep_size > 1 else None)


# ------------------------------------------------------------------------------ PP
def get_pp_group() -> dist.ProcessGroup | None:
    """Device group of this rank's pipeline (the ranks with its ``tp_rank`` in every stage,
    by stage; None when ``pp_size == 1``)."""
    return _STATE.pp_group


def get_pp_cpu_group() -> dist.ProcessGroup | None:
    """gloo group over the same ranks as :func:`get_pp_group` (step results to the driver)."""
    return _STATE.pp_cpu_group


def get_pp_size() -> int:
    return _STATE.info.pp_size


def get_pp_rank() -> int:
    return _STATE.info.pp_rank


def get_pp_ranks() -> tuple[int, ...]:
    """Global ranks of this rank's PP group, by stage."""
    return _STATE.pp_ranks


# ------------------------------------------------------------------------- replica
def get_replica_cpu_group() -> dist.ProcessGroup | None:
    """gloo group of every rank of this DP replica (None on a replica of one rank)."""
    return _STATE.replica_cpu_group


def get_driver_rank() -> int:
    """Global rank of this replica's driver (TP rank 0 of pipeline stage 0)."""
    return _STATE.replica_ranks[0]


def replica_min(value: int) -> int:
    """Smallest ``value`` over the ranks of this DP replica (gloo; ``value`` itself on a
    replica of one rank): what every stage and shard of it can hold."""
    return _group_min(value, _STATE.replica_cpu_group)


# ------------------------------------------------------------------------------ DP
def get_dp_group() -> dist.ProcessGroup | None:
    """gloo group of the ranks with this ``tp_rank`` in every DP replica (None when
    ``dp_size == 1``): the model runner's per-step ``agree_across_dp``."""
    return _STATE.dp_group


def get_dp_control_group() -> dist.ProcessGroup | None:
    """gloo group, same ranks as :func:`get_dp_group`, for the engine loop only."""
    return _STATE.dp_control_group


def get_dp_size() -> int:
    return _STATE.info.dp_size


def get_dp_rank() -> int:
    return _STATE.info.dp_rank


def get_dp_ranks() -> tuple[int, ...]:
    """Global ranks of this rank's DP group, by DP rank."""
    return _STATE.dp_ranks


# ------------------------------------------------------------------------------ EP
def get_ep_group() -> dist.ProcessGroup | None:
    """Device group of every rank of this pipeline stage when expert parallelism is on
    (None otherwise)."""
    return _STATE.ep_group


def get_ep_size() -> int:
    return _STATE.info.ep_size


def get_ep_rank() -> int:
    return _STATE.info.ep_rank


__all__ = ["ParallelInfo", "destroy_distributed", "env_rendezvous", "get_dp_control_group", "get_dp_group",
           "get_dp_rank", "get_dp_ranks", "get_dp_size", "get_ep_group", "get_ep_rank", "get_ep_size",
           "forward_min", "get_driver_rank", "get_parallel_info", "get_pp_cpu_group", "get_pp_group", "get_pp_rank",
           "get_pp_ranks", "get_pp_size", "get_rank", "get_replica_cpu_group", "replica_min", "get_tp_cpu_group", "get_tp_group", "get_tp_rank", "get_tp_size",
           "get_tp_src_rank", "get_world_size", "init_distributed", "is_distributed", "tp_all_reduce", "tp_min"]
