"""A rank of a data/pipeline/tensor-parallel deployment: joining it and building its engine
core, and the driver and followers of a replica.

Layout (:mod:`tandem.distributed.parallel_state`): ``dp_size`` replicas x ``pp_size`` stages
x ``tp_size`` shards. In every replica the **driver** (TP rank 0 of stage 0) owns an
:class:`EngineCore` (scheduler, KV cache); before running a step it broadcasts the step's
``SchedulerOutput`` over the replica's gloo group (``EngineCore.step_broadcast``,
:class:`TPStepChannel`), and the other ranks (**followers**) run the same step on their
stage and shard (the all-reduces after row-parallel layers pair up, and each stage passes its
hidden states on to the next). Sampling runs on every TP rank of the last stage on identical
logits with the same seed; the driver emits the tokens of that stage's TP rank 0 (its own
without PP; sent back to it with PP: :class:`tandem.worker.pipeline_stage.PipelineStage`). Used by both launchers: Tandem's own (:mod:`tandem.engine.core_proc`)
and the external launchers' (torchrun: :mod:`tandem.engine.external_launcher`).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.core.sched_output import SchedulerOutput
from tandem.distributed import parallel_state as ps
from tandem.structured_output.bitmask import GrammarBitmask
from tandem.structured_output.params import validated_elsewhere


# ----------------------------------------------------------------------------- TP
def _encode_tensor(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor) and obj.dtype == torch.int32:  # a GrammarBitmask's
        return [list(obj.shape), obj.contiguous().numpy().tobytes()]
    raise TypeError(f"a TP step message cannot carry {type(obj).__name__} "
                    f"{getattr(obj, 'dtype', '')}: only int32 tensors")


def _decode_tensor(type_: type, obj: Any) -> Any:
    if type_ is torch.Tensor:
        shape, data = obj
        if not data:  # frombuffer refuses an empty buffer
            return torch.empty(shape, dtype=torch.int32)
        return torch.frombuffer(bytearray(data), dtype=torch.int32).view(shape)
    raise TypeError(f"a TP step message cannot carry {type_}")


class TPStepChannel:
    """The driver's step messages to the other ranks of its replica (its TP group without
    PP), over the replica's gloo group: a ``SchedulerOutput`` per step (None to stop) and, for a step with constrained
    sequences, its ``GrammarBitmask``. Typed msgpack (msgspec) of array-like structs, not
    pickle: a decode step of 1024 sequences encodes ~12x faster than pickling the same
    structs and ~8x faster in all (encode + decode) than the pickled dataclasses before; a
    prefill step of new requests costs about what pickle did (their ``SamplingParams`` are
    checked again when decoded, their constraints not parsed again). Figures:
    benchmarks/RESULTS.md, "Session 14".
    Each message is two broadcasts: its length (int64), then its bytes (uint8).
    """

    def __init__(self) -> None:
        self.group, self.src = ps.get_replica_cpu_group(), ps.get_driver_rank()
        self._enc = msgspec.msgpack.Encoder(enc_hook=_encode_tensor)
        self._steps = msgspec.msgpack.Decoder(SchedulerOutput | None, dec_hook=_decode_tensor)
        self._bitmasks = msgspec.msgpack.Decoder(GrammarBitmask | None, dec_hook=_decode_tensor)

    def send(self, msg: SchedulerOutput | GrammarBitmask | None) -> None:
        """Driver: broadcast ``msg`` (the ``EngineCore.step_broadcast`` hook)."""
        data = torch.frombuffer(bytearray(self._enc.encode(msg)), dtype=torch.uint8)
        dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64), src=self.src, group=self.group)
        dist.broadcast(data, src=self.src, group=self.group)

    def _recv(self) -> memoryview:
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, src=self.src, group=self.group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=self.src, group=self.group)
        return memoryview(data.numpy())

    def recv_step(self) -> SchedulerOutput | None:
        """Follower: the next step's ``SchedulerOutput`` (None: stop); its constraints are
        not parsed again (the driver's front end did)."""
        data = self._recv()
        with validated_elsewhere():
            return self._steps.decode(data)

    def recv_bitmask(self) -> GrammarBitmask | None:
        """Follower: the current step's ``GrammarBitmask``; None: the driver's step failed
        before it could sample (the step is abandoned, as on the driver)."""
        return self._bitmasks.decode(self._recv())


def make_tp_broadcaster() -> Callable[[SchedulerOutput | GrammarBitmask | None], None]:
    """The driver's ``EngineCore.step_broadcast``: sends a ``SchedulerOutput`` (or None to
    stop), or a step's ``GrammarBitmask``, to the other ranks of its replica."""
    return TPStepChannel().send


def run_tp_follower(core, channel: TPStepChannel | None = None) -> None:
    """A follower's loop: run every ``SchedulerOutput`` the driver broadcasts, until None.

    It keeps the driver's order (``EngineCore.step``): with asynchronous output processing,
    step N+1 is launched before step N's result is waited for, so this GPU, like the
    driver's, has its next step queued while the host receives and prepares the one after;
    waiting first would leave it idle for that host work every step, and the driver's
    all-reduces would wait for it. With several batches in flight (pipeline parallelism) it
    waits for a step only once the driver has sent every batch it launches before taking
    that step in: the driver's broadcast of a later batch must not wait for a stage that
    waits for the driver."""
    channel = channel or TPStepChannel()
    in_flight = max(core.max_concurrent_batches, 2 if core.async_output_proc else 1)
    pending: deque = deque()
    while (so := channel.recv_step()) is not None:
        handle = core.runner.execute_model(so)
        if handle is None:  # constrained sequences: the driver sends their bitmask next
            if (bitmask := channel.recv_bitmask()) is None:
                continue  # the driver's step failed before sampling: abandoned here too
            handle = core.runner.sample_tokens(bitmask)
        pending.append(handle)
        # The driver waits for an empty step at once (an idle DP rank's dummy batch).
        keep = 1 if so.is_empty and core.max_concurrent_batches == 1 else in_flight
        while len(pending) >= keep:
            pending.popleft().result()
    while pending:
        pending.popleft().result()


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
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(parallel.local_ranks)))
    info = ps.init_distributed(parallel.tensor_parallel_size, parallel.data_parallel_size, parallel.enable_expert_parallel,
                               pp_size=parallel.pipeline_parallel_size, rank=rank, world_size=world_size, local_rank=local_rank, master_addr=master_addr,
                               master_port=master_port, device=device.torch_device, store_hosted=store_hosted)
    core = EngineCore(config, engine_index=info.dp_rank)
    dist.barrier()  # every rank built its core
    if info.is_driver and info.has_followers:
        core.step_broadcast = make_tp_broadcaster()
    return core, info
