"""A model runner's place in its pipeline (pipeline parallelism, :mod:`tandem.distributed.pipeline`):
what a step takes from the previous stage and gives the next, and how its results reach the
driver.

Every rank of a replica runs every step (the driver broadcasts its ``SchedulerOutput``,
:mod:`tandem.engine.rank_core`). A stage after the first receives the residual stream of the
step's tokens from the one before (``[2, padded tokens, hidden]``: every stage pads a step
alike, from the same plan) and a stage before the last sends its own on; only the last stage
computes logits and samples, and its TP rank 0 sends the step's ``ModelRunnerOutput``
(msgpack) to the driver over the pipeline's gloo group, where the driver's step handle
receives it. The other ranks' handles give an empty output, as a TP follower's result is
never read.

Each stage also times its part of every step: the host time from the step's start to its
send (the last stage: to its report), less the time it waited to receive. The stages' times
travel with the step (float64 over the gloo twin, after the residual stream) and reach the
driver in ``ModelRunnerOutput.stage_busy_s``, one per stage, which the engine core sums for
each stage's idle fraction (``tandem bench throughput``). On the CPU step thread, where a
stage's kernels run synchronously, that is its compute; on a GPU it is the host's time
launching the stage (its kernels run asynchronously).
"""

from __future__ import annotations

import time

import msgspec
import torch
import torch.distributed as dist

from tandem.distributed import parallel_state as ps
from tandem.distributed.pipeline import IntermediateTensors
from tandem.outputs import ModelRunnerOutput


class PipelineStage:
    """This rank's stage of a pipeline of more than one (``pp_size > 1``).

    Args:
        hidden_size: width of the residual stream between stages.
        dtype: its dtype (the model's).
        device: this rank's device (the stage-to-stage tensors live there).
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        info = ps.get_parallel_info()
        self.is_first, self.is_last = info.is_first_stage, info.is_last_stage
        self.is_driver = info.is_driver
        # The one rank whose results the driver takes: TP rank 0 of the last stage.
        self.reports = info.is_last_stage and info.tp_rank == 0
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self._group = ps.get_pp_cpu_group()
        self._ranks = ranks = ps.get_pp_ranks()
        self._driver, self._last = ranks[0], ranks[-1]
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(ModelRunnerOutput)
        self.index = info.pp_rank
        # This step's start, the time it waited to receive, and the earlier stages' busy times.
        self._start = 0.0
        self._waited = 0.0
        self._before: list[float] = []

    def begin_step(self) -> None:
        """A step with tokens starts on this stage (its busy time counts from here)."""
        self._start, self._waited = time.perf_counter(), 0.0

    def _busy(self) -> list[float]:
        return self._before + [time.perf_counter() - self._start - self._waited]

    def receive(self, num_tokens: int) -> IntermediateTensors | None:
        """The previous stage's residual stream for a forward of ``num_tokens`` tokens
        (blocking); None on the first stage."""
        if self.is_first:
            return None
        t0 = time.perf_counter()
        received = IntermediateTensors.recv(num_tokens, self.hidden_size, self.dtype, self.device)
        before = torch.empty(self.index, dtype=torch.float64)
        dist.recv(before, src=self._neighbour(-1), group=self._group)
        self._before = before.tolist()
        self._waited += time.perf_counter() - t0
        return received

    def send(self, out: IntermediateTensors) -> None:
        """Send a step's residual stream to the next stage, then the busy times of this
        stage and those before it (blocking)."""
        busy = torch.tensor(self._busy(), dtype=torch.float64)
        out.send()
        dist.send(busy, dst=self._neighbour(+1), group=self._group)

    def _neighbour(self, step: int) -> int:
        return self._ranks[self.index + step]

    def report(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        """Last stage, TP rank 0: send a step's results, with every stage's busy time, to
        the driver; returns them."""
        out.stage_busy_s = self._busy()
        data = torch.frombuffer(bytearray(self._enc.encode(out)), dtype=torch.uint8)
        dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=self._driver, group=self._group)
        dist.send(data, dst=self._driver, group=self._group)
        return out

    def collect(self) -> ModelRunnerOutput:
        """Driver: the results of the step the last stage reports next (blocking)."""
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=self._last, group=self._group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, src=self._last, group=self._group)
        return self._dec.decode(memoryview(data.numpy()))


__all__ = ["PipelineStage"]
