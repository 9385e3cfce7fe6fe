"""An engine core in its own process, talking msgpack over zmq (vLLM V1's ``EngineCoreProc``).

One process per rank of the deployment: the driver (tensor-parallel rank 0) of each
data-parallel replica runs :class:`EngineCoreProc` — it pulls requests and aborts from its
own input socket between two steps and pushes one :class:`EngineCoreOutputs` per step to the
front end's output socket; the other TP ranks (followers) run each step the driver
broadcasts (:func:`tandem.engine.rank_core.run_tp_follower`).

Several front ends (``tandem serve --api-server-count N``, as vLLM's) share the cores: a
driver pulls from every front end's input socket and has one output socket per front end.
A request's outputs (and the answer to a utility call) go to the front end that sent it
(``client_index``); what every front end needs goes to all of them: the startup handshake,
each step's scheduler stats (the load the front ends balance on), a fatal error and the
final stats.

Under expert parallelism the replicas' forwards meet in collectives, so the drivers step in
lockstep: once per loop iteration they all-reduce (MAX, over the gloo DP control group) a
"has work" flag and a "stop" flag, and every driver steps (a replica without requests runs a
dummy batch) while any of them has work. An idle driver waits for input at most
:data:`LOCKSTEP_IDLE_POLL_MS` before the next all-reduce; the front end also wakes every
replica when it hands work to an idle deployment, so the wait is normally shorter.

Every rank process exits when the process that launched it is gone (no orphans, even after
a ``kill -9`` of the server).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import sys
import threading
import time
import traceback

from typing import TYPE_CHECKING

import zmq

from tandem import envs
from tandem.engine.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType, MsgpackDecoder,
                                    MsgpackEncoder, UtilityOutput)

if TYPE_CHECKING:
    from tandem.engine.launch import CoreLaunch

logger = logging.getLogger(__name__)

# Longest wait for input of an idle replica between two lockstep all-reduces.
LOCKSTEP_IDLE_POLL_MS = 100
# Seconds between two checks that the launching process is still alive.
PARENT_POLL_S = 0.5


# glibc's mallopt parameter number of M_ARENA_MAX (malloc.h).
_M_ARENA_MAX = -8
# Seconds a driver stays idle before it gives its free heap back (release_free_heap): long
# enough that a server at a low request rate does not fault the pages back in every request.
IDLE_TRIM_S = 5.0


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, or None on another C library."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # musl
        return None


def limit_malloc_arenas() -> None:
    """Cap this process's glibc malloc arenas (:func:`tandem.envs.core_malloc_arena_max`);
    call it before the process starts threads. Nothing on other C libraries."""
    arenas = envs.core_malloc_arena_max()
    if arenas is not None and _glibc() is not None:
        _glibc().mallopt(_M_ARENA_MAX, arenas)


def release_free_heap() -> None:
    """Give the free pages inside glibc's malloc arenas back to the system (``malloc_trim``).

    The arenas keep what a busy core's steps freed (their largest transients, fragmented
    by longer-lived allocations; benchmarks/RESULTS.md, "engine core memory"); an idle
    core then holds only what it uses."""
    if _glibc() is not None:
        _glibc().malloc_trim(0)


def idle_wait_ms(last_step: float | None) -> int:
    """How long an idle driver waits for input (ms): until its heap is due for
    :func:`release_free_heap` (``last_step``: ``time.monotonic()`` of its last step, None
    once released), then for as long as it takes (-1)."""
    if last_step is None:
        return -1
    return max(0, int((last_step + IDLE_TRIM_S - time.monotonic()) * 1000))


def exit_with_parent(parent_pid: int) -> None:
    """End this process (exit code 1) as soon as ``parent_pid`` is no longer its parent."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(PARENT_POLL_S)

    threading.Thread(target=watch, name="tandem-parent-watch", daemon=True).start()


class EngineCoreProc:
    """The busy loop of one replica's driver.

    Args:
        core: the replica's :class:`tandem.engine.core.EngineCore`.
        input_addrs / output_addrs: zmq addresses bound by the front ends, one of each per
            front end, by client index (their PUSH -> our PULL, our PUSH -> their PULL).
        lockstep_group: the gloo DP control group when replicas must step together
            (expert parallelism), else None.
    """

    def __init__(self, core, input_addrs: list[str], output_addrs: list[str], lockstep_group=None) -> None:
        self.core = core
        self.ctx = zmq.Context(io_threads=1)
        self.input = self.ctx.socket(zmq.PULL)
        for addr in input_addrs:
            self.input.connect(addr)
        self.outputs = []
        for addr in output_addrs:
            s = self.ctx.socket(zmq.PUSH)
            # No high-water mark (as vLLM's sockets): a front end that is slow or gone (an
            # API server that stopped first) queues, it never blocks the core's loop.
            s.setsockopt(zmq.SNDHWM, 0)
            s.connect(addr)
            self.outputs.append(s)
        # The front end of each live request, when there are several.
        self.client_of: dict[str, int] = {}
        self.encoder = MsgpackEncoder()
        self.add_decoder = MsgpackDecoder(EngineCoreRequest)
        self.ids_decoder = MsgpackDecoder(list[str])
        self.utility_decoder = MsgpackDecoder(tuple[int, int, str])
        self.lockstep_group = lockstep_group
        self.stop_requested = False

    @classmethod
    def for_rank(cls, core, info, input_addrs: list[list[str]], output_addrs: list[str]) -> "EngineCoreProc":
        """The loop of the driver ``info`` (a ``ParallelInfo``): its replica's input socket
        of every front end; lockstep with the other replicas under expert parallelism."""
        from tandem.distributed import parallel_state as ps

        lockstep = ps.get_dp_control_group() if info.dp_size > 1 and info.ep_size > 1 else None
        return cls(core, [a[info.dp_rank] for a in input_addrs], output_addrs, lockstep)

    def send(self, msg, client: int | None = None) -> None:
        """Send ``msg`` to front end ``client``, or to every front end (None)."""
        data = self.encoder.encode(msg)
        for s in self.outputs if client is None else (self.outputs[client],):
            s.send(data, copy=False)

    def send_step(self, outs: list[EngineCoreOutput], stats) -> None:
        """One step's outputs, each to its request's front end; the stats to every one."""
        idx = self.core.engine_index
        if len(self.outputs) == 1:
            self.send(EngineCoreOutputs(idx, outs, stats))
            return
        per: list[list[EngineCoreOutput]] = [[] for _ in self.outputs]
        for o in outs:
            c = self.client_of.pop(o.request_id, None) if o.finish_reason is not None else \
                self.client_of.get(o.request_id)
            if c is not None:  # None: aborted by its front end meanwhile, which wants nothing more
                per[c].append(o)
        for c, client_outs in enumerate(per):
            self.send(EngineCoreOutputs(idx, client_outs, stats), c)

    def _handle(self, frames: list) -> bool:
        """Apply one message; returns True when it asked for work (or a wake-up)."""
        kind = EngineCoreRequestType(bytes(frames[0]))
        core = self.core
        if kind == EngineCoreRequestType.ADD:
            req = self.add_decoder.decode(frames[1])
            try:
                core.add_request(req)
            except Exception as e:  # noqa: BLE001 - reported to the request's client, the core goes on
                self.send(EngineCoreOutputs(core.engine_index, [EngineCoreOutput(
                    req.request_id, [], finish_reason="abort", error=f"{type(e).__name__}: {e}")]),
                    req.client_index)
                return True
            if len(self.outputs) > 1:
                self.client_of[req.request_id] = req.client_index
        elif kind == EngineCoreRequestType.ABORT:
            ids = self.ids_decoder.decode(frames[1])
            core.abort_requests(ids)
            for rid in ids:
                self.client_of.pop(rid, None)
        elif kind == EngineCoreRequestType.UTILITY:
            client, call_id, name = self.utility_decoder.decode(frames[1])
            self.send(EngineCoreOutputs(core.engine_index, utility_output=self._utility(call_id, name)), client)
        elif kind == EngineCoreRequestType.SHUTDOWN:
            self.stop_requested = True
        return True

    def _utility(self, call_id: int, name: str) -> UtilityOutput:
        if name == "debug_stats":
            return UtilityOutput(call_id, self.core.debug_stats())
        if name == "ping":
            return UtilityOutput(call_id, True)
        return UtilityOutput(call_id, error=f"unknown utility call {name!r}")

    def _drain(self, timeout_ms: int) -> bool:
        """Apply the waiting messages, waiting up to ``timeout_ms`` for the first one
        (-1: forever). Returns True when any arrived."""
        got = False
        if timeout_ms != 0 and not self.input.poll(None if timeout_ms < 0 else timeout_ms):
            return False
        while True:
            try:
                frames = self.input.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return got
            got = self._handle(frames) or got

    def _agree(self, busy: bool) -> tuple[bool, bool]:
        """Lockstep: (any replica busy, any replica stopping)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(busy), int(self.stop_requested)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.lockstep_group)
        return bool(t[0]), bool(t[1])

    def run(self) -> None:
        """Serve until SHUTDOWN; a failed step is reported (``engine_dead``) and re-raised."""
        core = self.core
        self.send(core.ready_message())
        was_busy = False
        last_step = None  # time of the last step, until the heap is released after it
        try:
            while True:
                busy = core.has_unfinished_requests()
                if self.lockstep_group is None:
                    got = self._drain(0 if busy else idle_wait_ms(last_step))
                    if self.stop_requested:
                        break
                    step = core.has_unfinished_requests()
                else:
                    got = self._drain(0 if (busy or was_busy) else LOCKSTEP_IDLE_POLL_MS)
                    step, stop = self._agree(core.has_unfinished_requests() or got)
                    if stop:
                        break
                outs = core.step() if step else []
                if outs or (got and not step) or (was_busy and not core.has_unfinished_requests()):
                    # Every step with news, and the state after the last one (the gauges).
                    self.send_step(outs, core.scheduler_stats())
                was_busy = step
                if step:
                    last_step = time.monotonic()
                elif last_step is not None and time.monotonic() - last_step >= IDLE_TRIM_S:
                    release_free_heap()
                    last_step = None
            core.drain_in_flight()
        except Exception as e:
            from tandem.distributed.peer_loss import lost_peer_reason

            # The front end shows the last line: a lost peer rank says so instead of the transport's text.
            reason = lost_peer_reason(e)
            error = traceback.format_exc() + (f"\n{reason}" if reason else "")
            self.send(EngineCoreOutputs(core.engine_index, engine_dead=True, error=error))
            raise
        self.send(EngineCoreOutputs(core.engine_index, utility_output=UtilityOutput(
            -1, {"num_steps": core.num_steps, "num_dbo_steps": getattr(core.runner, "num_dbo_steps", 0)})))

    def close(self) -> None:
        self.input.close(linger=0)
        for s in self.outputs:
            s.close(linger=1000)
        self.ctx.term()


def serve(proc: EngineCoreProc, info) -> None:
    """A driver's loop until SHUTDOWN; then its followers (TP ranks, later pipeline stages) are told to stop."""
    try:
        proc.run()
    finally:
        if info.has_followers:
            proc.core.step_broadcast(None)


def commit_kv_cache(core) -> None:
    """A rank process serves until stopped: its CPU KV cache becomes resident now, not over
    its first minutes of load (:func:`tandem.worker.kv_cache.commit_kv_caches`)."""
    from tandem.worker.kv_cache import commit_kv_caches

    caches = core.runner.kv_caches
    if all(c.device.type != "cpu" for c in caches):
        return
    t0 = time.perf_counter()
    commit_kv_caches(caches)
    logger.info("Committing the CPU KV cache (%.2f GiB) took %.2f s", sum(c.nbytes for c in caches) / 2**30,
                time.perf_counter() - t0)


def run_engine_core(launch: CoreLaunch) -> None:
    """Entry of a spawned rank process (:mod:`tandem.engine.launch`): build the core, then
    serve (driver) or follow (TP).

    ``launch.addresses.inputs[c][dp_rank]`` is front end ``c``'s input socket of each
    replica's driver; ``launch.addresses.outputs[c]`` its output socket.
    """
    limit_malloc_arenas()
    exit_with_parent(launch.parent_pid)
    # Ctrl-C in a terminal (and SIGTERM from `timeout`, `kill -- -PGID`, systemd's default
    # KillMode) reaches every process of the group: the front end alone handles it (it
    # stops the cores); a rank interrupted mid-collective would print a traceback, and one
    # killed would read as a crash.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if envs.TANDEM_DUMP_STACKS_AFTER_S is not None:  # debugging a hang: every rank prints its stacks
        import faulthandler

        faulthandler.dump_traceback_later(envs.TANDEM_DUMP_STACKS_AFTER_S, exit=False)
    from tandem.distributed import parallel_state as ps
    from tandem.engine.rank_core import build_rank_core, run_tp_follower
    from tandem.logging_config import configure_logging

    configure_logging(default_level=launch.log_level)
    config, rank, output_addrs = launch.config, launch.rank, launch.addresses.outputs
    proc = core = None
    try:
        if launch.world_size > 1:
            core, info = build_rank_core(config, rank, launch.world_size,
                                         rank if launch.local_rank is None else launch.local_rank,
                                         launch.master_addr, launch.master_port, store_hosted=True)
        else:
            from tandem.engine.core import EngineCore

            core, info = EngineCore(config), ps.get_parallel_info()
        commit_kv_cache(core)
        if not info.is_driver:
            run_tp_follower(core)
            return
        proc = EngineCoreProc.for_rank(core, info, launch.addresses.inputs, output_addrs)
        try:
            serve(proc, info)
        except Exception:  # noqa: BLE001 - its traceback went to the front ends (engine_dead), which log it
            failed = True
        else:
            failed = False
    except BaseException as e:
        if proc is None:  # failed while loading: tell the front end which rank and why
            ctx = zmq.Context()
            # Bad input, as the tandem command classes it (tandem.entrypoints.cli.main): the
            # front end reports the message alone; anything else, the traceback.
            config_error = str(e) if isinstance(e, (ValueError, FileNotFoundError)) else None
            data = MsgpackEncoder().encode(EngineCoreOutputs(
                rank, engine_dead=True, error=f"rank {rank} failed to start:\n{traceback.format_exc()}",
                config_error=config_error))
            for addr in output_addrs:
                sock = ctx.socket(zmq.PUSH)
                sock.connect(addr)
                sock.send(data)
                sock.close(linger=2000)
            ctx.term()
            if config_error is not None:
                # Bad input is one line, which the front end prints; a traceback on this
                # process's stderr (multiprocessing prints one for an uncaught exception)
                # would follow it whenever the front end had not stopped this rank first.
                sys.exit(1)
        raise
    finally:
        if proc is not None:
            proc.close()
        if core is not None:
            core.shutdown()
        ps.destroy_distributed()
    if failed:
        sys.exit(1)  # a failed step: not a second copy of its traceback on stderr


__all__ = ["EngineCoreProc", "IDLE_TRIM_S", "LOCKSTEP_IDLE_POLL_MS", "commit_kv_cache", "exit_with_parent",
           "idle_wait_ms", "limit_malloc_arenas", "release_free_heap", "run_engine_core", "serve"]
