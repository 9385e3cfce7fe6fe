"""The one client protocol of the engine cores: add, abort, outputs, utility (stats, health),
shutdown — in the front end's process or over zmq to spawned core processes.

As vLLM V1's ``EngineCoreClient``:

* :class:`InprocClient`: the core in this process; ``get_output()`` runs one step
  (offline ``LLM`` default: no serialization at all).
* :class:`SyncMPClient` / :class:`AsyncMPClient`: ``data_parallel_size *
  tensor_parallel_size`` rank processes spawned on this machine
  (:func:`tandem.engine.core_proc.run_engine_core`); one input socket per data-parallel
  replica, one output socket for all. A new request goes to the replica with the fewest
  outstanding sequences (then the lowest KV cache usage reported); its ``n`` sequences stay
  together (shared prompt blocks). The async client is for an asyncio front end (the server).

Several API-server processes (``tandem serve --api-server-count N``, vLLM's layout): the
launching process spawns the cores with sockets for ``N + 1`` clients
(``api_server_count=N``; it is the last client: it waits for the cores, watches them and
stops them), and each API server attaches an :class:`AsyncMPClient` to its own sockets
(:class:`EngineClientConfig`). A core sends a request's outputs to the client that sent it,
and its scheduler stats after every step to all of them. An attached client balances on
those stats: a replica's load is its running + waiting sequences at its last report, plus
what this client sent it since (each client sees every replica's load and its own recent
sends; vLLM gets the same from a coordinator process that publishes the cores' queue
lengths, which the per-step reports make unnecessary here).

A rank process that dies is detected (its process sentinel; an attached client opens a
pidfd on it) and reported as :class:`EngineDeadError` to every caller; the launching client
then kills the others. Rank processes are daemonic and also exit on their own when the
launching process is gone.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import os
import select
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_sentinels

import zmq
import zmq.asyncio

from tandem import envs
from tandem.config import EngineConfig
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


@dataclass(frozen=True)
class EngineZmqAddresses:
    """The zmq endpoints between the front ends (clients) and the engine cores (vLLM's name).

    Client ``c`` binds ``inputs[c][e]`` (PUSH; replica ``e``'s driver connects a PULL) and
    ``outputs[c]`` (PULL; every driver connects a PUSH).
    """

    inputs: list[list[str]]
    outputs: list[str]

    @classmethod
    def in_dir(cls, ipc_dir: str, num_clients: int, dp_size: int) -> "EngineZmqAddresses":
        """Unix sockets in ``ipc_dir`` (every core on this host)."""
        return cls([[f"ipc://{ipc_dir}/input{c}_{e}" for e in range(dp_size)] for c in range(num_clients)],
                   [f"ipc://{ipc_dir}/output{c}" for c in range(num_clients)])

    @classmethod
    def over_tcp(cls, host: str, num_clients: int, dp_size: int) -> "EngineZmqAddresses":
        """TCP ports of ``host`` free now (cores on several hosts)."""
        from tandem.distributed.launch import free_port

        def addr() -> str:
            return f"tcp://{host}:{free_port(host)}"

        return cls([[addr() for _ in range(dp_size)] for _ in range(num_clients)], [addr() for _ in range(num_clients)])


@dataclass(frozen=True)
class EngineClientConfig:
    """What an API-server process needs to attach to cores launched by another process
    (vLLM's ``client_config``): the endpoints, its client index, the rank processes' pids."""

    addresses: EngineZmqAddresses
    client_index: int
    core_pids: list[int]


class _ForeignProcess:
    """A rank process launched by another process, watched through a pidfd (Linux >= 5.3):
    the subset of ``multiprocessing.Process`` the clients use. It is not ours to kill."""

    exitcode = None  # only the launching process can read it

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.sentinel = os.pidfd_open(pid)
        except ProcessLookupError:
            raise EngineDeadError(f"engine core process {pid} is gone") from None

    def is_alive(self) -> bool:
        return not select.select([self.sentinel], [], [], 0)[0]

    def join(self, timeout: float | None = None) -> None:
        select.select([self.sentinel], [], [], timeout)

    def kill(self) -> None:
        pass


class MPClient:
    """Spawns the rank processes and owns the sockets (base of the two clients below).

    Args:
        config: engine configuration (``world_size`` processes are spawned).
        startup_timeout: seconds for every rank to load the model (default:
            ``TANDEM_STARTUP_TIMEOUT_S``, else 1800).
        api_server_count: API-server processes that will attach to the cores
            (:meth:`api_server_configs`); this client is then the last of
            ``api_server_count + 1`` and only launches, watches and stops the cores.
        attach: attach to cores launched by another process instead of spawning them.
        wait_ready: wait for the cores' handshakes here; False: the caller calls
            :meth:`wait_ready` (the launcher of API servers starts them meanwhile).
        external: the sockets of cores that another launcher started (torchrun: every rank
            is a process of its own); this client binds them, and stops the cores at shutdown.

    Raises:
        ValueError: the model path is none the loader reads (before any rank starts).
        EngineConfigError: a rank failed to start on bad input (its message).
        EngineDeadError: a rank failed to start otherwise (its traceback is in the message).
    """

    def __init__(self, config: EngineConfig, startup_timeout: float | None = None, asyncio_mode: bool = False,
                 api_server_count: int = 0, attach: EngineClientConfig | None = None, wait_ready: bool = True,
                 external: EngineZmqAddresses | None = None) -> None:
        self.config = config
        self.dp_size = config.parallel_config.data_parallel_size
        self.lockstep = self.dp_size > 1 and config.parallel_config.enable_expert_parallel
        self.owns_cores = attach is None
        parallel = config.parallel_config
        self.multi_host = parallel.multi_host
        self._dir = None
        if attach is not None or external is not None:
            self.addresses = attach.addresses if attach is not None else external
        elif self.multi_host:
            self.addresses = EngineZmqAddresses.over_tcp(parallel.data_parallel_address or "127.0.0.1",
                                                         api_server_count + 1, self.dp_size)
        else:
            self._dir = tempfile.mkdtemp(prefix="tandem-ipc-")
            self.addresses = EngineZmqAddresses.in_dir(self._dir, api_server_count + 1, self.dp_size)
        # Several hosts: the handshake with the headless hosts and their heartbeats (launcher only).
        self.hosts = None
        self.client_index = attach.client_index if attach is not None else api_server_count
        # Cores shared with other clients: balance on the load they report.
        self.shared = len(self.addresses.outputs) > 1
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(CoreMessage)
        self.ctx = zmq.Context(io_threads=1)
        self.inputs = []
        for addr in self.addresses.inputs[self.client_index]:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 0)  # a busy core never blocks the front end's event loop
            s.bind(addr)
            self.inputs.append(s)
        self.actx = zmq.asyncio.Context.shadow(self.ctx) if asyncio_mode else None
        self.output = (self.actx or self.ctx).socket(zmq.PULL)
        self.output.bind(self.addresses.outputs[self.client_index])
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
        self._store = None
        self.procs: list = []
        atexit.register(self.shutdown)
        try:
            if attach is not None:
                self.procs = [_ForeignProcess(pid) for pid in attach.core_pids]
            elif external is None:
                self.procs = self._spawn(config)
        except BaseException:
            self._kill()
            raise
        if wait_ready:
            self.wait_ready(startup_timeout)

    def wait_ready(self, startup_timeout: float | None = None) -> None:
        """Wait for every replica's handshake (``readies``, ``ready``).

        Raises:
            EngineConfigError: a rank failed to start on bad input.
            EngineDeadError: a rank failed to start otherwise, or not within the timeout.
        """
        try:
            if self.hosts is not None:
                self.hosts.wait_for_hosts(check=self._check_procs)
            self.readies = self._wait_ready(envs.TANDEM_STARTUP_TIMEOUT_S if startup_timeout is None
                                            else startup_timeout)
        except BaseException:
            self._kill()
            raise
        self.ready = self.readies[0]

    def _spawn(self, config: EngineConfig) -> list:
        from tandem.model_loader.loader import check_model_path
        from tandem.distributed.launch import host_store, resolve_rendezvous, spawn_ranks
        from tandem.engine.core_proc import launcher_log_level, run_engine_core

        # A missing model fails here, in one line, not after the ranks start.
        check_model_path(config.model_config.model)
        parallel = config.parallel_config
        rdv = None
        if parallel.world_size > 1:
            rdv = resolve_rendezvous(parallel.master_addr or (parallel.data_parallel_address if self.multi_host else None),
                                     parallel.master_port)
        # Served from here until every rank has exited (see host_store).
        self._store = host_store(rdv, parallel.world_size) if rdv is not None else None
        addrs = self.addresses
        if self.multi_host:
            from tandem.engine.host_handshake import HeadHandshake, HostWelcome

            parallel.check_host_role(headless=False)
            self.hosts = HeadHandshake(config, HostWelcome(addrs.inputs, addrs.outputs, rdv.master_addr,
                                                           rdv.master_port))
        first = parallel.local_ranks.start
        return spawn_ranks(run_engine_core, parallel.local_ranks, lambda r: (
            config, r, parallel.world_size, rdv and rdv.master_addr, rdv and rdv.master_port, addrs.inputs,
            addrs.outputs, os.getpid(), r - first, launcher_log_level()))

    def api_server_configs(self) -> list[EngineClientConfig]:
        """What each API server needs to attach (``api_server_count`` of them)."""
        pids = [p.pid for p in self.procs]
        return [EngineClientConfig(self.addresses, c, pids) for c in range(self.client_index)]

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
        if self.hosts is not None and self.hosts.lost is not None and not self._closed:
            self._fail(self.hosts.lost)
        dead = [i for i, p in enumerate(self.procs) if not p.is_alive() and (p.exitcode != 0 or not self._stopping)]
        if dead and not self._closed:
            self._fail(f"engine core process(es) {dead} exited (pids {[self.procs[i].pid for i in dead]}, "
                       f"codes {[self.procs[i].exitcode for i in dead]})")

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
        # while), so look at the processes first: one non-blocking select on every sentinel.
        # A sentinel is ready a moment before its process can be reaped: wait for the code.
        ready = select.select([p.sentinel for p in self.procs], [], [], 0)[0]
        if ready:
            for p in self.procs:
                if p.sentinel in ready:
                    p.join(timeout=5)
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
        if not self.owns_cores:
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
                while self.final_stats is None and time.monotonic() < deadline and \
                        any(p.is_alive() for p in self.procs):
                    msg = self._recv_sync(0.2)
                    if isinstance(msg, EngineCoreOutputs):
                        self._account(msg)
            except (EngineDeadError, zmq.ZMQError) as e:
                logger.warning("engine core shutdown: %s", e)
        for p in self.procs:
            p.join(timeout=max(1.0, timeout / 4) if self.dead_error is None else 0.1)
        self._kill()

    def _kill(self, linger_ms: int = 0) -> None:
        if self._closed:
            return
        self._closed = True
        if self.hosts is not None:
            self.hosts.close(None if self.dead_error is None else str(self.dead_error).splitlines()[0])
        if self.owns_cores:
            for p in self.procs:
                if p.is_alive():
                    p.kill()
            for p in self.procs:
                p.join(timeout=5)
        for s in [*self.inputs, self.output]:
            s.close(linger=linger_ms)
        self.ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._store = None  # every rank is gone: the rendezvous store may close
        atexit.unregister(self.shutdown)


def _one_line(message: str) -> str:
    """A failure in one line: its first line and, after a traceback, the exception's line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else message
    return f"{lines[0].rstrip(':')}: {lines[-1]}"


class SyncMPClient(MPClient):
    """Blocking client of spawned cores (offline ``LLM`` with several ranks)."""

    def __init__(self, config: EngineConfig, startup_timeout: float | None = None, api_server_count: int = 0,
                 wait_ready: bool = True, external: EngineZmqAddresses | None = None) -> None:
        super().__init__(config, startup_timeout, api_server_count=api_server_count, wait_ready=wait_ready,
                         external=external)
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

    def __init__(self, config: EngineConfig, startup_timeout: float | None = None,
                 attach: EngineClientConfig | None = None) -> None:
        self._task: asyncio.Task | None = None
        self._dead_reported = False
        self._calls: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        super().__init__(config, startup_timeout, asyncio_mode=True, attach=attach)

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
        ready = wait_sentinels([p.sentinel for p in self.procs] + ([self.hosts.lost_r] if self.hosts else []))
        if self._stopping:
            return
        # A sentinel is closed before its process can be reaped: wait for the exit code.
        for p in self.procs:
            if p.sentinel in ready:
                p.join(timeout=5)
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


__all__ = ["AsyncMPClient", "EngineClientConfig", "EngineConfigError", "EngineDeadError", "EngineZmqAddresses",
           "InprocClient", "MPClient", "SyncMPClient", "make_client"]
