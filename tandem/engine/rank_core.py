"""A rank of a data/tensor-parallel deployment: joining it and building its engine core, and
the tensor-parallel driver and followers.

Layout (:mod:`tandem.distributed.parallel_state`): ``dp_size`` replicas x ``tp_size`` shards.
In every replica the **driver** (TP rank 0) owns an :class:`EngineCore` (scheduler, KV
cache); before running a step it broadcasts the step's ``SchedulerOutput`` over the TP
group's gloo group (``EngineCore.step_broadcast``), and the other TP ranks (**followers**)
run the same step on their shards (the all-reduces after row-parallel layers pair up).
Sampling runs on every TP rank on identical logits with the same seed; only the driver's
tokens are emitted. Used by both launchers: Tandem's own (:mod:`tandem.engine.core_proc`)
and torchrun's (:mod:`tandem.engine.dp_engine`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.distributed import parallel_state as ps


# ----------------------------------------------------------------------------- TP
def make_tp_broadcaster():
    """The driver's ``EngineCore.step_broadcast``: sends a ``SchedulerOutput`` (or None to
    stop) to the other ranks of its TP group."""
    group, src = ps.get_tp_cpu_group(), ps.get_rank()

    def broadcast(so) -> None:
        dist.broadcast_object_list([so], src=src, group=group)

    return broadcast


def run_tp_follower(core) -> None:
    """A follower's loop: run every ``SchedulerOutput`` the driver broadcasts, until None.

    It keeps the driver's order (``EngineCore.step``): with asynchronous output processing,
    step N+1 is launched before step N's result is waited for, so this GPU, like the
    driver's, has its next step queued while the host receives and prepares the one after;
    waiting first would leave it idle for that host work every step, and the driver's
    all-reduces would wait for it."""
    group, src = ps.get_tp_cpu_group(), ps.get_tp_src_rank()
    prev = None
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=src, group=group)
        so = box[0]
        if so is None:
            break
        handle = core.runner.execute_model(so)
        if prev is not None:
            prev.result()
        if handle is None:  # constrained sequences: the driver sends their bitmask next
            dist.broadcast_object_list(box, src=src, group=group)
            handle = core.runner.sample_tokens(box[0])
        if core.async_output_proc and not so.is_empty:
            prev = handle
        else:
            prev = None
            handle.result()
    if prev is not None:
        prev.result()


# ----------------------------------------------------------------------------- ranks
def build_rank_core(config: EngineConfig, rank: int | None, world_size: int | None, local_rank: int | None,
                    master_addr: str | None, master_port: int | None, store_hosted: bool = False):
    """Join the deployment as a rank and build its :class:`EngineCore`; returns
    ``(core, ParallelInfo)``. ``store_hosted``: the launching process serves the
    rendezvous store (:func:`tandem.distributed.launch.host_store`)."""
    from tandem.engine.core import EngineCore

    device, parallel = config.device_config, config.parallel_config
    if torch.cuda.is_available() and device.device in ("auto", "cuda"):
        lr = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", rank or 0))
        device.device = f"cuda:{lr}"
    elif device.torch_device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel.world_size))
    info = ps.init_distributed(parallel.tensor_parallel_size, parallel.data_parallel_size, parallel.enable_expert_parallel,
                               rank=rank, world_size=world_size, local_rank=local_rank, master_addr=master_addr,
                               master_port=master_port, device=device.torch_device, store_hosted=store_hosted)
    core = EngineCore(config, engine_index=info.dp_rank)
    dist.barrier()  # every rank built its core
    if info.is_driver and info.tp_size > 1:
        core.step_broadcast = make_tp_broadcaster()
    return core, info
