"""The torchrun launch of a data/tensor-parallel deployment, and its lockstep DP loop.

A rank's core and the TP driver/followers: :mod:`tandem.engine.rank_core`. Tandem's own
launcher spawns one process per rank, each a core process (:mod:`tandem.engine.core_proc`,
driven by :mod:`tandem.engine.core_client`). Under torchrun / env:// (``RANK``,
``WORLD_SIZE`` set) this process *is* a rank:
:func:`make_parallel_engine` gives global rank 0 an :class:`InProcessEngineClient` (the
front end plus the coordinator of a lockstep loop, :class:`DPRankLoop`, whose outputs are
gathered over the gloo DP control group), and every other rank serves until rank 0 shuts
down and then **exits the process**.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from dataclasses import dataclass, field

import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.distributed import parallel_state as ps
from tandem.engine.rank_core import build_rank_core, run_tp_follower
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- DP loop
@dataclass
class _Plan:
    cmds: list[list[tuple]]  # per DP rank: ("add", rid, prompt, params) / ("abort", [rids])
    step: bool
    stop: bool


@dataclass
class IterationResult:
    """Gathered on the coordinator: outputs of every replica and rejected requests."""

    outputs: list[RequestOutput] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)  # (request id, message)


class DPRankLoop:
    """The lockstep engine loop of one replica's driver (see the module docstring).

    ``iteration(msgs)`` is one loop iteration; DP rank 0 passes the front-end's messages
    (``("add", rid, prompt, params)``, ``("abort", [rids])``, ``("stop",)``) and gets an
    :class:`IterationResult`; the other drivers pass nothing and get None.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        info = ps.get_parallel_info()
        self.dp_size, self.dp_rank = info.dp_size, info.dp_rank
        self.group = ps.get_dp_control_group()
        self.src = ps.get_dp_ranks()[0]
        self.outstanding = [0] * self.dp_size  # coordinator: requests live per replica
        self.owner: dict[str, int] = {}
        self.any_unfinished = False
        self.stopped = False
        self.num_steps = 0

    @property
    def is_coordinator(self) -> bool:
        return self.dp_rank == 0

    def _route(self, msgs: list[tuple]) -> _Plan:
        cmds: list[list[tuple]] = [[] for _ in range(self.dp_size)]
        stop, adds = False, False
        for m in msgs:
            if m[0] == "add":
                r = min(range(self.dp_size), key=lambda i: (self.outstanding[i], i))  # least outstanding
                self.outstanding[r] += 1
                self.owner[m[1]] = r
                cmds[r].append(m)
                adds = True
            elif m[0] == "abort":
                per: dict[int, list[str]] = {}
                for rid in m[1]:
                    r = self.owner.pop(rid, None)
                    if r is not None:
                        self.outstanding[r] -= 1
                        per.setdefault(r, []).append(rid)
                for r, rids in per.items():
                    cmds[r].append(("abort", rids))
            elif m[0] == "stop":
                stop = True
            else:
                raise ValueError(f"unknown front-end message {m[0]!r}")
        return _Plan(cmds, step=self.any_unfinished or adds, stop=stop)

    def _apply(self, cmds: list[tuple]) -> list[tuple[str, str]]:
        errors = []
        for c in cmds:
            if c[0] == "add":
                try:
                    self.engine.add_request(c[1], c[2], c[3])
                except ValueError as e:
                    errors.append((c[1], str(e)))
            else:
                self.engine.abort_request(c[1])
        return errors

    def iteration(self, msgs: list[tuple] | None = None) -> IterationResult | None:
        plan = self._route(msgs or []) if self.is_coordinator else None
        if self.group is not None:
            box = [plan]
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            plan = box[0]
        errors = self._apply(plan.cmds[self.dp_rank])
        if plan.stop:
            self.stopped = True
            return IterationResult() if self.is_coordinator else None
        outs: list[RequestOutput] = []
        if plan.step:
            outs = self.engine.step()
            self.num_steps += 1
        mine = (outs, errors, self.engine.has_unfinished_requests())
        if self.group is None:
            gathered = [mine]
        else:
            gathered = [None] * self.dp_size if self.is_coordinator else None
            dist.gather_object(mine, gathered, dst=self.src, group=self.group)
        if not self.is_coordinator:
            return None
        res = IterationResult()
        busy = False
        for o, e, b in gathered:
            res.outputs.extend(o)
            res.errors.extend(e)
            busy |= b
        for out in res.outputs:
            if out.finished and out.request_id in self.owner:
                self.outstanding[self.owner.pop(out.request_id)] -= 1
        for rid, _ in res.errors:
            if rid in self.owner:
                self.outstanding[self.owner.pop(rid)] -= 1
        self.any_unfinished = busy
        return res

    def run_worker(self) -> None:
        """DP ranks > 0: iterate until the coordinator says stop."""
        while not self.stopped:
            self.iteration()


class InProcessEngineClient:
    """Front end in the process of global rank 0 under torchrun / env:// (see the module
    docstring); ``step()`` runs one lockstep iteration of the coordinator. Duck-types the
    parts of :class:`LLMEngine` that ``LLM`` uses."""

    def __init__(self, engine, info) -> None:
        self.engine, self.info = engine, info
        self.config, self.tokenizer = engine.config, engine.tokenizer
        self.loop = DPRankLoop(engine)
        self._pending: list[tuple] = []
        self._live: set[str] = set()
        self._closed = False
        atexit.register(self.shutdown)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request on the least loaded replica.

        Raises:
            ValueError: as ``LLMEngine.add_request`` (checked here before it leaves).
        """
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use by a running request.")
        self.engine.processor.process_inputs(request_id, prompt, params, 0.0)
        self._send(("add", request_id, prompt, params))
        self._live.add(request_id)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._live.difference_update(ids)
        self._send(("abort", ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def _send(self, msg: tuple) -> None:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        self._pending.append(msg)

    def step(self) -> list[RequestOutput]:
        msgs, self._pending = self._pending, []
        res = self.loop.iteration(msgs)
        for o in res.outputs:
            if o.finished:
                self._live.discard(o.request_id)
        if res.errors:
            # A replica rejected a request the front end let through: fail the batch.
            for rid, _ in res.errors:
                self._live.discard(rid)
            live = sorted(self._live)
            if live:
                self.abort_request(live)
            raise ValueError(res.errors[0][1])
        return res.outputs

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.loop.iteration([("stop",)])
        _stop_followers(self.engine.core, self.info)
        self.engine.shutdown()
        ps.destroy_distributed()
        atexit.unregister(self.shutdown)


def _stop_followers(core, info) -> None:
    if info.tp_size > 1:
        core.step_broadcast(None)


def make_parallel_engine(config: EngineConfig):
    """The engine front end of a ``tensor_parallel_size * data_parallel_size > 1``
    deployment: under torchrun / env:// this process is a rank — global rank 0 gets an
    :class:`InProcessEngineClient`, every other rank serves until rank 0 shuts down and then
    **exits the process**; otherwise Tandem spawns the ranks as core processes
    (:class:`LLMEngine` over a :class:`SyncMPClient`).

    Raises:
        ValueError: the environment's world size differs from the configuration's.
        EngineDeadError: a rank failed to start.
    """
    from tandem.engine.core_client import InprocClient
    from tandem.engine.llm_engine import LLMEngine

    if not ps.env_rendezvous():
        return LLMEngine(config)
    parallel = config.parallel_config
    if int(os.environ["WORLD_SIZE"]) != parallel.world_size:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but tensor_parallel_size x data_parallel_size = "
                         f"{parallel.world_size}")
    core, info = build_rank_core(config, None, None, None, parallel.master_addr, parallel.master_port)
    if info.rank == 0:
        return InProcessEngineClient(LLMEngine(config, InprocClient(core=core)), info)
    try:
        if not info.is_driver:
            run_tp_follower(core)
        else:
            try:
                DPRankLoop(LLMEngine(config, InprocClient(core=core))).run_worker()
            finally:
                _stop_followers(core, info)
    finally:
        core.shutdown()
        ps.destroy_distributed()
    sys.exit(0)


__all__ = ["DPRankLoop", "InProcessEngineClient", "IterationResult", "make_parallel_engine"]
