"""The one client protocol of the engine cores: add, abort, outputs, utility (stats, health),
shutdown — in the front end's process or over zmq to spawned core processes.

As vLLM V1's ``EngineCoreClient``:

* :class:`InprocClient`: the core in this process; ``get_output()`` runs one step
  (offline ``LLM`` default: no serialization at all).
* :class:`SyncMPClient` / :class:`AsyncMPClient`: the cores of ``data_parallel_size *
  tensor_parallel_size`` rank processes, over zmq; one input socket per data-parallel
  replica, one output socket for all. Starting, watching and stopping those processes is
  :class:`tandem.engine.launch.CoreProcManager`'s (spawned here by default, another
  process's, or torchrun's); the client keeps the protocol, the load balancing and the
  failure reporting. A new request goes to the replica with the fewest outstanding sequences
  (then the lowest KV cache usage reported); its ``n`` sequences stay together (shared
  prompt blocks). The async client is for an asyncio front end (the server).

Several API-server processes (``tandem serve --api-server-count N``, vLLM's layout): the
launching process spawns the cores with sockets for ``N + 1`` clients
(``CoreProcManager.launch(config, api_server_count=N)``; it is the last client: it waits for
the cores, watches them and stops them), and each API server attaches an
:class:`AsyncMPClient` to its own sockets (``CoreProcManager.attach`` of an
``EngineClientConfig``). A core sends a request's outputs to the client that sent it,
and its scheduler stats after every step to all of them. An attached client balances on
those stats: a replica's load is its running + waiting sequences at its last report, plus
what this client sent it since (each client sees every replica's load and its own recent
sends; vLLM gets the same from a coordinator process that publishes the cores' queue
lengths, which the per-step reports make unnecessary here).

A rank process that dies is detected (its process sentinel, or the pidfd an attached
client's manager opens on it) and reported as :class:`EngineDeadError` to every caller; the
launching client then kills the others.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import threading
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from tandem import envs
from tandem.config import EngineConfig
from tandem.engine.host_handshake import replica_difference
from tandem.engine.launch import CoreProcManager, exit_reason
from tandem.engine.messages import (CoreMessage, EngineCoreOutputs, EngineCoreReady, EngineCoreRequest,
                                    EngineCoreRequestType, MsgpackDecoder, MsgpackEncoder)

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """An engine core stopped (shut down, crashed, or a failed step); in-flight requests
    are lost."""


class EngineConfigError(EngineDeadError, ValueError):
    """A rank failed to start on bad input (a model path or file, a value the loader
    rejects); the message is the rank's error alone. A ValueError, so that callers report it
    as they report the same error raised in their own process (the ``tandem`` command: one
    line, exit 2)."""


class InprocClient:
    """The engine core in this process (see the module docstring).

    Args:
        config: engine configuration (a single rank), or None with ``core`` given.
        core: an already built ``EngineCore``.
    """

    def __init__(self, config: EngineConfig | None = None, core=None) -> None:
        if core is None:
            from tandem.engine.core import EngineCore

            core = EngineCore(config or EngineConfig())
        self.core = core
        self.ready: EngineCoreReady = core.ready_message()
        self.readies = [self.ready]

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        for r in reqs:
            self.core.add_request(r)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        """One engine step (nothing when the core is idle)."""
        core = self.core
        if not core.has_unfinished_requests():
            return EngineCoreOutputs(core.engine_index)
        return EngineCoreOutputs(core.engine_index, core.step(), core.scheduler_stats())

    def debug_stats(self) -> list[dict]:
        return [self.core.debug_stats()]

    @property
    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.core.shutdown()


class MPClient:
    """Owns the sockets to the engine cores and speaks the protocol (base of the two clients
    below); their processes are :class:`tandem.engine.launch.CoreProcManager`'s.

    Args:
        config: engine configuration.
        cores: the cores to talk to, as this client's slot among them; None: spawn
            ``world_size`` rank processes for this client alone
            (:meth:`CoreProcManager.launch`).
        startup_timeout: seconds for every rank to load the model (default:
            ``TANDEM_STARTUP_TIMEOUT_S``, else 1800).
        wait_ready: wait for the cores' handshakes here; False: the caller calls
            :meth:`wait_ready` (the launcher of API servers starts them meanwhile).

    Raises:
        ValueError: the model path is none the loader reads (before any rank starts); the
            other errors of :meth:`CoreProcManager.launch` too, when ``cores`` is None.
        EngineConfigError: a rank failed to start on bad input (its message).
        EngineDeadError: a rank failed to start otherwise (its traceback is in the message).
    """

    def __init__(self, config: EngineConfig, cores: CoreProcManager | None = None,
                 startup_timeout: float | None = None, asyncio_mode: bool = False, wait_ready: bool = True) -> None:
        self.config = config
        self.dp_size = config.parallel_config.data_parallel_size
        self.lockstep = self.dp_size > 1 and config.parallel_config.enable_expert_parallel
        self.cores = cores if cores is not None else CoreProcManager.launch(config)
        self.client_index = self.cores.client_index
        # Cores shared with other clients: balance on the load they report.
        self.shared = len(self.cores.addresses.outputs) > 1
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(CoreMessage)
        self.dead_error: EngineDeadError | None = None
        self._closed = False
        self._stopping = False
        self.final_stats: dict | None = None
        # Load balancing: live sequences per replica, and the replica of each sequence.
        self.outstanding = [0] * self.dp_size
        self.engine_of: dict[str, int] = {}
        self.kv_usage = [0.0] * self.dp_size
        # Shared cores: each replica's running + waiting sequences at its last report, and
        # the sequences this client sent it since.
        self.reported_load = [0] * self.dp_size
        self.sent_since_report = [0] * self.dp_size
        self._call_ids = itertools.count()
        self.ctx = zmq.Context(io_threads=1)
        self.actx = zmq.asyncio.Context.shadow(self.ctx) if asyncio_mode else None
        self.inputs = []
        self.output = None
        atexit.register(self.shutdown)
        try:
            addresses = self.cores.addresses
            for addr in addresses.inputs[self.client_index]:
                s = self.ctx.socket(zmq.PUSH)
                s.setsockopt(zmq.SNDHWM, 0)  # a busy core never blocks the front end's event loop
                s.bind(addr)
                self.inputs.append(s)
            self.output = (self.actx or self.ctx).socket(zmq.PULL)
            self.output.bind(addresses.outputs[self.client_index])
        except BaseException:
            self._kill()
            raise
        if wait_ready:
            self.wait_ready(startup_timeout)

    def wait_ready(self, startup_timeout: float | None = None) -> None:
        """Wait for every replica's handshake (``readies``, ``ready``), and first for every
        ``--headless`` host of a deployment on several hosts.

        Raises:
            EngineConfigError: a rank failed to start on bad input, or the replicas resolved
                the configuration differently (:func:`replica_difference`: e.g. hosts whose
                ``auto`` dtype differs).
            EngineDeadError: a rank failed to start otherwise, or not within the timeout.
            HostRefusedError: a ``--headless`` host was refused, lost, or missing.
        """
        try:
            self.cores.wait_for_hosts(check=self._check_procs)
            self.readies = self._wait_ready(envs.TANDEM_STARTUP_TIMEOUT_S if startup_timeout is None
                                            else startup_timeout)
            diff = replica_difference(self.readies)
            if diff is not None:
                raise EngineConfigError(f"the data-parallel replicas resolved the engine configuration differently: "
                                        f"{diff}")
        except BaseException:
            self._kill()
            raise
        self.ready = self.readies[0]

    # ------------------------------------------------------------------ startup
    def _recv_sync(self, timeout_s: float) -> CoreMessage | None:
        """One message within ``timeout_s`` (None on timeout); raises when a rank died."""
        sock = self.output if self.actx is None else zmq.Socket.shadow(self.output.underlying)
        if sock.poll(int(timeout_s * 1000)):
            return self.decoder.decode(sock.recv(copy=False))
        self._check_procs()
        return None

    def _wait_ready(self, timeout: float) -> list[EngineCoreReady]:
        readies: dict[int, EngineCoreReady] = {}
        deadline = time.monotonic() + timeout
        while len(readies) < self.dp_size:
            msg = self._recv_sync(1.0)
            if isinstance(msg, EngineCoreReady):
                readies[msg.engine_index] = msg
            elif isinstance(msg, EngineCoreOutputs) and msg.engine_dead:
                if msg.config_error is not None:
                    raise EngineConfigError(msg.config_error)
                raise EngineDeadError(msg.error)
            if time.monotonic() > deadline:
                raise EngineDeadError(f"no answer from the engine cores within {timeout}s")
        return [readies[i] for i in range(self.dp_size)]

    def _check_procs(self) -> None:
        """Fail (:meth:`_fail`) when a ``--headless`` host is lost or a rank process exited
        (once stopping, only one that exited on an error)."""
        if self.cores.lost_host is not None and not self._closed:
            self._fail(self.cores.lost_host)
        dead = self.cores.dead(count_clean_exits=not self._stopping)
        if dead and not self._closed:
            procs = self.cores.procs
            self._fail("engine core process(es) exited: " + ", ".join(
                f"{i} (pid {procs[i].pid}, {exit_reason(procs[i].exitcode)})" for i in dead))

    def _fail(self, message: str) -> None:
        if self.dead_error is None:
            self.dead_error = EngineDeadError(_one_line(message))  # what clients are told
            logger.error("%s", message)
        self._kill()
        raise self.dead_error

    # ------------------------------------------------------------------ requests
    def _send(self, engine: int, kind: EngineCoreRequestType, payload) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        # zmq may still accept a send to a core that exited (its pipe outlives the peer for a
        # while), so look at the processes first.
        if self.cores.poll_exited():
            self._check_procs()
        frames = (kind.value, self.encoder.encode(payload))
        while True:
            try:
                # Never blocking: a PUSH socket whose core is gone would wait forever.
                self.inputs[engine].send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:  # nothing connected, or its queue is full: is the core alive?
                self._check_procs()
                time.sleep(0.001)

    def _load(self, engine: int) -> int:
        """Live sequences of a replica, as this client knows them (see the module docstring)."""
        if self.shared:
            return self.reported_load[engine] + self.sent_since_report[engine]
        return self.outstanding[engine]

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        """Send the sequences of one request to the least loaded replica."""
        e = min(range(self.dp_size), key=lambda i: (self._load(i), self.kv_usage[i], i))
        idle = self.lockstep and not any(self._load(i) for i in range(self.dp_size))
        for r in reqs:
            r.client_index = self.client_index
            self._send(e, EngineCoreRequestType.ADD, r)
            self.engine_of[r.request_id] = e
        self.outstanding[e] += len(reqs)
        self.sent_since_report[e] += len(reqs)
        if idle:  # lockstep replicas step together: wake the idle ones now
            for other in range(self.dp_size):
                if other != e:
                    self._send(other, EngineCoreRequestType.WAKEUP, [])

    def abort_requests(self, request_ids: list[str]) -> None:
        per: dict[int, list[str]] = {}
        for rid in request_ids:
            e = self.engine_of.pop(rid, None)
            if e is not None:
                self.outstanding[e] -= 1
                per.setdefault(e, []).append(rid)
        for e, ids in per.items():
            self._send(e, EngineCoreRequestType.ABORT, ids)

    def _account(self, outs: EngineCoreOutputs) -> None:
        """Bookkeeping of one core message (finished sequences, KV usage, final stats)."""
        for o in outs.outputs:
            if o.finish_reason is not None:
                e = self.engine_of.pop(o.request_id, None)
                if e is not None:
                    self.outstanding[e] -= 1
        st = outs.scheduler_stats
        if st is not None:
            self.kv_usage[outs.engine_index] = st.kv_cache_usage
            self.reported_load[outs.engine_index] = st.num_running + st.num_waiting
            self.sent_since_report[outs.engine_index] = 0
        if outs.utility_output is not None and outs.utility_output.call_id == -1 and outs.engine_index == 0:
            self.final_stats = outs.utility_output.result
        if outs.engine_dead and not self._stopping:
            self._fail(f"engine core {outs.engine_index} failed:\n{outs.error}")

    @property
    def is_alive(self) -> bool:
        """No core died and none was shut down (a dead rank process is noticed here too)."""
        if self.dead_error is None and not self._closed:
            try:
                self._check_procs()
            except EngineDeadError:
                pass
        return self.dead_error is None and not self._closed

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop every core (waits for them, then kills stragglers); removes the sockets.
        An attached client aborts its live sequences instead and leaves the cores running."""
        if self._closed:
            return
        self._stopping = True
        if not self.cores.owner:
            if self.dead_error is None and self.engine_of:
                try:
                    self.abort_requests(list(self.engine_of))
                except (EngineDeadError, zmq.ZMQError) as e:
                    logger.warning("abort at shutdown: %s", e)
            self._kill(linger_ms=1000)
            return
        if self.dead_error is None:
            try:
                for e in range(self.dp_size):
                    try:
                        self.inputs[e].send_multipart((EngineCoreRequestType.SHUTDOWN.value, b""), flags=zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # nothing connected: that core already exited (a lockstep peer stopping)
                deadline = time.monotonic() + timeout
                while self.final_stats is None and time.monotonic() < deadline and self.cores.any_alive():
                    msg = self._recv_sync(0.2)
                    if isinstance(msg, EngineCoreOutputs):
                        self._account(msg)
            except (EngineDeadError, zmq.ZMQError) as e:
                logger.warning("engine core shutdown: %s", e)
        self.cores.join(max(1.0, timeout / 4) if self.dead_error is None else 0.1)
        self._kill()

    def _kill(self, linger_ms: int = 0) -> None:
        if self._closed:
            return
        self._closed = True
        self.cores.close(None if self.dead_error is None else str(self.dead_error).splitlines()[0])
        for s in [*self.inputs, self.output]:
            if s is not None:
                s.close(linger=linger_ms)
        self.ctx.term()
        atexit.unregister(self.shutdown)


def _one_line(message: str) -> str:
    """A failure in one line: its first line and, after a traceback, the exception's line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else message
    return f"{lines[0].rstrip(':')}: {lines[-1]}"


class SyncMPClient(MPClient):
    """Blocking client of spawned cores (offline ``LLM`` with several ranks)."""

    def __init__(self, config: EngineConfig, cores: CoreProcManager | None = None,
                 startup_timeout: float | None = None, wait_ready: bool = True) -> None:
        super().__init__(config, cores, startup_timeout, wait_ready=wait_ready)
        self._backlog: list[EngineCoreOutputs] = []

    def get_output(self) -> EngineCoreOutputs:
        """The next message of any core with outputs (blocks; checks the ranks every second).

        Raises:
            EngineDeadError: a core died or failed.
        """
        if self._backlog:
            return self._backlog.pop(0)
        while True:
            if self.dead_error is not None:
                raise self.dead_error
            msg = self._recv_sync(1.0)
            if isinstance(msg, EngineCoreOutputs):
                self._account(msg)
                return msg

    def poll_outputs(self) -> None:
        """Take in what the cores sent, without blocking (the launching client of API
        servers keeps its socket drained with this).

        Raises:
            EngineDeadError: a core died or failed.
        """
        while (msg := self._recv_sync(0)) is not None:
            if isinstance(msg, EngineCoreOutputs):
                self._account(msg)

    def debug_stats(self) -> list[dict]:
        """Every replica's ``EngineCore.debug_stats()``, by replica."""
        ids = {}
        for e in range(self.dp_size):
            cid = next(self._call_ids)
            ids[cid] = e
            self._send(e, EngineCoreRequestType.UTILITY, (self.client_index, cid, "debug_stats"))
        res: dict[int, dict] = {}
        while len(res) < len(ids):
            msg = self.get_output()
            u = msg.utility_output
            if u is not None and u.call_id in ids:
                res[ids[u.call_id]] = u.result
            else:
                self._backlog.append(msg)
        return [res[e] for e in range(self.dp_size)]


class AsyncMPClient(MPClient):
    """asyncio client of spawned cores (the server). ``start(on_outputs, on_dead)`` runs the
    output loop on the running event loop: ``on_outputs(msg)`` for every core message with
    outputs or stats, ``on_dead(error)`` once when a core dies."""

    def __init__(self, config: EngineConfig, cores: CoreProcManager | None = None,
                 startup_timeout: float | None = None) -> None:
        self._task: asyncio.Task | None = None
        self._dead_reported = False
        self._calls: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        super().__init__(config, cores, startup_timeout, asyncio_mode=True)

    def start(self, on_outputs: Callable[[EngineCoreOutputs], None], on_dead: Callable[[BaseException], None]) -> None:
        """Run the output loop on the running event loop (again, if an earlier loop ended)."""
        loop = asyncio.get_running_loop()
        if self._task is not None and self._loop is loop and not self._task.done():
            return
        first = self._loop is None
        self._loop = loop
        self._on_dead = on_dead
        self._task = loop.create_task(self._output_loop(on_outputs))
        if first:
            threading.Thread(target=self._monitor, name="tandem-core-monitor", daemon=True).start()

    def _monitor(self) -> None:
        """Wait on the rank processes' sentinels (and the loss of a host); report the first
        that exits unasked."""
        self.cores.wait_for_exit()
        if self._stopping:
            return
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._dead_from_monitor)

    def _dead_from_monitor(self) -> None:
        try:
            self._check_procs()
        except EngineDeadError:
            pass  # reported by _fail

    def _fail(self, message: str) -> None:
        """As ``MPClient._fail``; whichever path noticed the death first (the monitor, a
        liveness check, a core's own report), every waiter hears of it."""
        try:
            super()._fail(message)
        except EngineDeadError as e:
            loop = self._loop
            if loop is not None and not loop.is_closed():
                # Deferred: the caller may be in the middle of adding or reading a request.
                loop.call_soon_threadsafe(self._report_dead, e)
            raise

    def _report_dead(self, err: BaseException) -> None:
        if self._dead_reported:
            return
        self._dead_reported = True
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._on_dead(err)

    async def _output_loop(self, on_outputs: Callable[[EngineCoreOutputs], None]) -> None:
        try:
            while True:
                frame = await self.output.recv(copy=False)
                msg = self.decoder.decode(frame)
                if not isinstance(msg, EngineCoreOutputs):
                    continue
                self._account(msg)
                u = msg.utility_output
                if u is not None:
                    fut = self._calls.pop(u.call_id, None)
                    if fut is not None and not fut.done():
                        if u.error is not None:
                            fut.set_exception(RuntimeError(u.error))
                        else:
                            fut.set_result(u.result)
                if msg.outputs or msg.scheduler_stats is not None:
                    on_outputs(msg)
        except EngineDeadError as e:
            self._report_dead(e)
        except asyncio.CancelledError:
            pass
        except zmq.ZMQError as e:
            if not self._closed:
                self._report_dead(EngineDeadError(f"engine core connection failed: {e!r}"))

    async def debug_stats(self) -> list[dict]:
        """Every replica's ``EngineCore.debug_stats()``, by replica (read between two steps)."""
        futs = []
        for e in range(self.dp_size):
            cid = next(self._call_ids)
            fut = asyncio.get_running_loop().create_future()
            self._calls[cid] = fut
            self._send(e, EngineCoreRequestType.UTILITY, (self.client_index, cid, "debug_stats"))
            futs.append(fut)
        return list(await asyncio.gather(*futs))

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True
        if self._task is not None and self._loop is not None and not self._loop.is_closed():
            try:
                if asyncio.get_running_loop() is self._loop:
                    self._task.cancel()
                else:
                    self._loop.call_soon_threadsafe(self._task.cancel)
            except RuntimeError:  # no running loop in this thread
                self._loop.call_soon_threadsafe(self._task.cancel)
        super().shutdown(timeout)


def make_client(config: EngineConfig, asyncio_mode: bool = False):
    """The client for ``config``: spawned cores for the server or several ranks, else the
    core in this process."""
    if asyncio_mode:
        return AsyncMPClient(config)
    if config.parallel_config.world_size > 1:
        return SyncMPClient(config)
    return InprocClient(config)


__all__ = ["AsyncMPClient", "EngineConfigError", "EngineDeadError", "InprocClient", "MPClient", "SyncMPClient",
           "make_client"]
