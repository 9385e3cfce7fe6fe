"""Data-parallel (DP) and tensor-parallel (TP) engines: the ranks and their front-end.

Layout (:mod:`tandem.distributed.parallel_state`): ``dp_size`` replicas x ``tp_size`` shards.
In every replica the **driver** (TP rank 0) owns a full :class:`LLMEngine` (scheduler, KV
cache, output processing); before running a step it broadcasts the step's
``SchedulerOutput`` over the TP group's gloo group (``LLMEngine.step_broadcast``), and the
other TP ranks (**followers**) run the same step on their shards (the all-reduces after
row-parallel layers pair up). Sampling runs on every TP rank on identical logits with the
same seed (greedy and seeded sampling are identical by construction; unseeded random
sampling relies on the same generator state on every TP rank); only the driver's tokens
are emitted.

The drivers of the DP replicas step in **lockstep**: one loop iteration on every driver is
(over the gloo DP control group, never used by the model runner)

1. DP rank 0 (the **coordinator**) broadcasts the plan: per rank the requests to add (each
   new request goes to the replica with the fewest outstanding requests) and to abort,
   whether to step, whether to stop;
2. every driver applies its part and, if the plan says so, calls ``engine.step()`` — all
   drivers call it the same number of times while any replica has work, so that the model
   runner's per-step plan (``tandem.worker.step_plan``) agreed over the DP group and its dummy batches on idle
   ranks keep the MoE collectives matched (``ModelRunner.dp_group``, set by
   ``LLMEngine`` under expert parallelism);
3. the step's outputs, rejected requests and "still has work" flags are gathered on the
   coordinator, which hands them to the front-end.

Front-ends (:func:`make_parallel_engine`, used by ``LLM`` when ``data_parallel_size *
tensor_parallel_size > 1``; both duck-type the parts of :class:`LLMEngine` that ``LLM``
uses: ``add_request``, ``abort_request``, ``has_unfinished_requests``, ``step``,
``shutdown``, ``tokenizer``):

* :class:`SpawnedEngineClient`: Tandem launches the ranks itself (one machine); the
  front-end talks to the coordinator's process through two multiprocessing queues.
* :class:`InProcessEngineClient`: under torchrun / env:// the process with global rank 0
  hosts the front-end and the coordinator; every other rank serves in
  :func:`make_parallel_engine` and exits the process when rank 0 shuts down.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tandem import envs
from tandem.config import EngineConfig
from tandem.distributed import parallel_state as ps
from tandem.distributed.launch import host_store, resolve_rendezvous, spawn_ranks
from tandem.entrypoints.llm import LLM
from tandem.logging_config import configure_logging
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- TP
def make_tp_broadcaster():
    """The driver's ``LLMEngine.step_broadcast``: sends a ``SchedulerOutput`` (or None to
    stop) to the other ranks of its TP group."""
    group, src = ps.get_tp_cpu_group(), ps.get_rank()

    def broadcast(so) -> None:
        dist.broadcast_object_list([so], src=src, group=group)

    return broadcast


def run_tp_follower(engine) -> None:
    """A follower's loop: run every ``SchedulerOutput`` the driver broadcasts, until None."""
    group, src = ps.get_tp_cpu_group(), ps.get_tp_src_rank()
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=src, group=group)
        so = box[0]
        if so is None:
            return
        engine.runner.execute_model(so).result()


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


# ----------------------------------------------------------------------------- ranks
def _build_rank_engine(config: EngineConfig, rank: int | None, world_size: int | None, local_rank: int | None,
                       master_addr: str | None, master_port: int | None, store_hosted: bool = False):
    from tandem.engine.llm_engine import LLMEngine

    if torch.cuda.is_available() and config.device in ("auto", "cuda"):
        lr = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", rank or 0))
        config.device = f"cuda:{lr}"
    elif config.torch_device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.world_size))
    info = ps.init_distributed(config.tensor_parallel_size, config.data_parallel_size, config.enable_expert_parallel,
                               rank=rank, world_size=world_size, local_rank=local_rank, master_addr=master_addr,
                               master_port=master_port, device=config.torch_device, store_hosted=store_hosted)
    engine = LLMEngine(config)
    dist.barrier()  # every rank built its engine
    return engine, info


def _serve_nonzero(engine, info) -> None:
    """Serve as a follower or a DP rank > 0 until the deployment stops."""
    if not info.is_driver:
        run_tp_follower(engine)
        return
    try:
        DPRankLoop(engine).run_worker()
    finally:
        if info.tp_size > 1:
            engine.step_broadcast(None)


def _rank_main(config: EngineConfig, rank: int, world_size: int, master_addr: str, master_port: int,
               inbox, outbox) -> None:
    """Entry of a spawned rank process."""
    # Ctrl-C in a terminal reaches every process of the group: the front-end alone handles
    # it (it stops the ranks); a rank interrupted mid-collective would print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if envs.TANDEM_DUMP_STACKS_AFTER_S is not None:  # debugging a hang: every rank prints its stacks
        import faulthandler

        faulthandler.dump_traceback_later(envs.TANDEM_DUMP_STACKS_AFTER_S, exit=False)
    engine = None
    try:
        configure_logging()
        engine, info = _build_rank_engine(config, rank, world_size, rank, master_addr, master_port, store_hosted=True)
        if info.is_driver and info.tp_size > 1:
            engine.step_broadcast = make_tp_broadcaster()
        if rank != 0:
            _serve_nonzero(engine, info)
            return
        loop = DPRankLoop(engine)
        outbox.put(("ready", {"config": engine.config, "max_model_len": config.max_model_len,
                              "vocab_size": engine.vocab_size, "num_kv_blocks": engine.num_kv_blocks, "parallel": info,
                              "kv_cache_shape_per_block": engine.model.kv_cache_shape_per_block}))
        try:
            while not loop.stopped:
                msgs = [] if loop.any_unfinished else [inbox.get()]  # idle everywhere: wait for work
                while True:
                    try:
                        msgs.append(inbox.get_nowait())
                    except queue.Empty:
                        break
                res = loop.iteration(msgs)
                if res.outputs or res.errors:
                    outbox.put(("outputs", res.outputs, res.errors))
        finally:
            if info.tp_size > 1:
                engine.step_broadcast(None)
        outbox.put(("stopped", {"num_steps": loop.num_steps, "num_dbo_steps": getattr(engine.runner, "num_dbo_steps", 0)}))
    except BaseException:  # noqa: BLE001 - reported to the front-end, then re-raised
        outbox.put(("fatal", rank, traceback.format_exc()))
        raise
    finally:
        if engine is not None:
            engine.shutdown()
        ps.destroy_distributed()


# ----------------------------------------------------------------------------- front-ends
class _ClientBase:
    """Request bookkeeping and validation shared by the front-ends."""

    def __init__(self, config: EngineConfig) -> None:
        from tandem.model_loader.generation_config import load_generation_defaults
        from tandem.model_loader.loader import load_tokenizer

        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.generation_defaults = load_generation_defaults(config.model, config.generation_config)
        self._live: set[str] = set()
        self.max_model_len = 0
        self.vocab_size = 0

    def _validate(self, request_id: str, prompt: str | list[int], params: SamplingParams | None) -> None:
        """The checks of ``LLMEngine.add_request`` that can fail, run before the request
        leaves the front-end (so ``LLM.generate`` can reject a batch cleanly).

        Raises:
            ValueError: as ``LLMEngine.add_request``.
        """
        params = params or SamplingParams()
        params.verify_vocab(self.vocab_size)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids outside the vocabulary [0, {self.vocab_size}): {bad[:8]}")
        if not ids:
            raise ValueError("prompt must contain at least one token.")
        n = self.max_model_len
        if len(ids) >= n:
            raise ValueError(f"This model's maximum context length is {n} tokens. However, your prompt has "
                             f"{len(ids)} tokens, which leaves no room for completion tokens.")
        if params.max_tokens is not None and len(ids) + params.max_tokens > n:
            raise ValueError(f"This model's maximum context length is {n} tokens. However, you requested "
                             f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the messages, "
                             f"{params.max_tokens} in the completion). Please reduce the length of the messages or completion.")
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use by a running request.")

    def get_default_sampling_params(self) -> SamplingParams:
        """As ``LLMEngine.get_default_sampling_params``."""
        return SamplingParams().with_defaults(self.generation_defaults.sampling)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request on the least loaded replica.

        Raises:
            ValueError: as ``LLMEngine.add_request``.
        """
        self._validate(request_id, prompt, params)
        self._send(("add", request_id, prompt, params))
        self._live.add(request_id)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._live.difference_update(ids)
        self._send(("abort", ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def _finish(self, outputs: list[RequestOutput], errors: list[tuple[str, str]]) -> list[RequestOutput]:
        for o in outputs:
            if o.finished:
                self._live.discard(o.request_id)
        if errors:
            # A replica rejected a request the front-end let through: fail the batch.
            for rid, _ in errors:
                self._live.discard(rid)
            live = sorted(self._live)
            if live:
                self.abort_request(live)
            raise ValueError(errors[0][1])
        return outputs

    def stats(self) -> dict[str, float]:
        return {}


class SpawnedEngineClient(_ClientBase):
    """Front-end of ranks launched by Tandem on this machine (see the module docstring).

    Args:
        config: the engine configuration (``world_size`` ranks are spawned).
        startup_timeout: seconds to wait for every rank to load the model (default:
            ``TANDEM_STARTUP_TIMEOUT_S`` from the environment, else 1800).

    Raises:
        RuntimeError: a rank failed to start (its traceback is in the message).
    """

    def __init__(self, config: EngineConfig, startup_timeout: float | None = None) -> None:
        super().__init__(config)
        import torch.multiprocessing as mp

        if startup_timeout is None:
            startup_timeout = envs.TANDEM_STARTUP_TIMEOUT_S
        rdv = resolve_rendezvous(config.master_addr, config.master_port)
        self._store = host_store(rdv, config.world_size)  # kept until every rank has exited
        ctx = mp.get_context("spawn")
        self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
        self._procs = spawn_ranks(
            _rank_main, config.world_size,
            lambda r: (config, r, config.world_size, rdv.master_addr, rdv.master_port,
                       self._inbox if r == 0 else None, self._outbox))
        self._closed = self._stopping = False
        atexit.register(self.shutdown)
        try:
            kind, info = self._get(timeout=startup_timeout)[:2]
        except BaseException:
            self._kill()
            raise
        if kind != "ready":
            self._kill()
            raise RuntimeError(f"unexpected message from rank 0 at startup: {kind!r}")
        # Rank 0's resolved configuration (max_model_len, max_num_batched_tokens filled from
        # the model), as LLMEngine.config: callers read the limits there.
        self.config = info["config"]
        self.max_model_len, self.vocab_size = info["max_model_len"], info["vocab_size"]
        self.num_kv_blocks = info["num_kv_blocks"]
        self.rank0_info = info  # rank 0's ParallelInfo ("parallel") and cache shape, for tests and logs
        self.final_stats: dict | None = None  # rank 0's step counts, after shutdown

    def _send(self, msg: tuple) -> None:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        self._inbox.put(msg)

    def _get(self, timeout: float | None = None) -> tuple:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                msg = self._outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(self._procs)
                        if not p.is_alive() and (p.exitcode != 0 or not self._stopping)]
                if dead:
                    self._kill()
                    raise RuntimeError(f"rank(s) {dead} exited (codes {[self._procs[i].exitcode for i in dead]})")
                if deadline is not None and time.monotonic() > deadline:
                    self._kill()
                    raise RuntimeError(f"no answer from the ranks within {timeout}s")
                continue
            if msg[0] == "fatal":
                self._kill()
                raise RuntimeError(f"rank {msg[1]} failed:\n{msg[2]}")
            return msg

    def step(self) -> list[RequestOutput]:
        """Wait for the next outputs of the replicas (returns [] when nothing is live)."""
        if not self._live:
            return []
        kind, outputs, errors = self._get()
        if kind != "outputs":
            raise RuntimeError(f"unexpected message {kind!r}")
        return self._finish(outputs, errors)

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop every rank (waits for them, then kills stragglers)."""
        if self._closed:
            return
        self._stopping = True
        try:
            self._inbox.put(("stop",))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                msg = self._get(timeout=max(0.1, deadline - time.monotonic()))
                if msg[0] == "stopped":
                    self.final_stats = msg[1]
                    break
        except RuntimeError as e:
            logger.warning("parallel engine shutdown: %s", e)
        finally:
            self._closed = True
            for p in self._procs:
                p.join(timeout=max(1.0, timeout / 4))
            self._kill()
            atexit.unregister(self.shutdown)

    def _kill(self) -> None:
        self._closed = True
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._store = None  # every rank is gone: the rendezvous store may close


class InProcessEngineClient(_ClientBase):
    """Front-end in the process of global rank 0 under torchrun / env:// (see the module
    docstring); ``step()`` runs one lockstep iteration of the coordinator."""

    def __init__(self, config: EngineConfig, engine, info) -> None:
        super().__init__(config)
        self.engine, self.info = engine, info
        self.loop = DPRankLoop(engine)
        self._pending: list[tuple] = []
        self.max_model_len, self.vocab_size = config.max_model_len, engine.vocab_size
        self._closed = False
        atexit.register(self.shutdown)

    def _send(self, msg: tuple) -> None:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        self._pending.append(msg)

    def step(self) -> list[RequestOutput]:
        msgs, self._pending = self._pending, []
        res = self.loop.iteration(msgs)
        return self._finish(res.outputs, res.errors)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.loop.iteration([("stop",)])
        if self.info.tp_size > 1:
            self.engine.step_broadcast(None)
        self.engine.shutdown()
        ps.destroy_distributed()
        atexit.unregister(self.shutdown)


def make_parallel_engine(config: EngineConfig):
    """The engine front-end of a ``tensor_parallel_size * data_parallel_size > 1``
    deployment: under torchrun / env:// (``RANK``, ``WORLD_SIZE`` set) this process is a
    rank — global rank 0 gets an :class:`InProcessEngineClient`, every other rank serves
    until rank 0 shuts down and then **exits the process**; otherwise Tandem spawns the
    ranks (:class:`SpawnedEngineClient`).

    Raises:
        ValueError: the environment's world size differs from the configuration's.
        RuntimeError: a rank failed to start.
    """
    if not ps.env_rendezvous():
        return SpawnedEngineClient(config)
    if int(os.environ["WORLD_SIZE"]) != config.world_size:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but tensor_parallel_size x data_parallel_size = "
                         f"{config.world_size}")
    engine, info = _build_rank_engine(config, None, None, None, config.master_addr, config.master_port)
    if info.is_driver and info.tp_size > 1:
        engine.step_broadcast = make_tp_broadcaster()
    if info.rank == 0:
        return InProcessEngineClient(config, engine, info)
    try:
        _serve_nonzero(engine, info)
    finally:
        engine.shutdown()
        ps.destroy_distributed()
    sys.exit(0)


class DPLLM(LLM):
    """Offline data-parallel inference: ``LLM`` with ``data_parallel_size`` replicas (2 by
    default) launched on this machine (or joined under torchrun). ``LLM`` itself does the
    same whenever ``data_parallel_size * tensor_parallel_size > 1``; this class only names
    it and is a context manager that shuts the ranks down.

    Example: ``with DPLLM(model, data_parallel_size=2, enable_expert_parallel=True) as llm:
    llm.generate(prompts, params)``.
    """

    def __init__(self, model: str | None = None, *, data_parallel_size: int = 2, **kwargs) -> None:
        super().__init__(model, data_parallel_size=data_parallel_size, **kwargs)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "DPLLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


__all__ = ["DPLLM", "DPRankLoop", "InProcessEngineClient", "IterationResult", "SpawnedEngineClient",
           "make_parallel_engine", "make_tp_broadcaster", "run_tp_follower"]
