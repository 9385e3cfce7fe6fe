"""Starting, watching and stopping the engine-core processes (vLLM's ``launch_core_engines`` and
``CoreEngineProcManager``): one place for ``tandem serve``, ``--headless``, torchrun and ``LLM``.

* :class:`CoreLaunch`: what one rank process is started with (the one argument of
  :func:`tandem.engine.core_proc.run_engine_core`); each rank's own is the deployment's with
  its ranks replaced (:func:`rank_launches`).
* :class:`CoreProcManager`: the cores one client talks to — their sockets
  (:class:`EngineZmqAddresses`), the client's slot among them, and their processes, in one of
  three kinds:

  - spawned here (:meth:`CoreProcManager.launch` for a front end, :meth:`CoreProcManager.spawn`
    for a ``--headless`` host): this process's children, watched through their sentinels,
    killed and joined when it stops them;
  - another process's (:meth:`CoreProcManager.attach`: an API server of ``--api-server-count N``
    attached to the launcher's cores): watched through a pidfd each, never killed here;
  - none (:meth:`CoreProcManager.external`: torchrun started every rank; the client stops the
    cores through the protocol alone).

Every spawned rank process is daemonic and also exits on its own when the launching process
is gone (:func:`tandem.engine.core_proc.exit_with_parent`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_sentinels

from tandem.config import EngineConfig


@dataclass(frozen=True)
class EngineZmqAddresses:
    """The zmq endpoints between the front ends (clients) and the engine cores (vLLM's name).

    Client ``c`` binds ``inputs[c][e]`` (PUSH; replica ``e``'s driver connects a PULL) and
    ``outputs[c]`` (PULL; every driver connects a PUSH).
    """

    inputs: list[list[str]]
    outputs: list[str]

    @classmethod
    def in_dir(cls, ipc_dir: str, num_clients: int, dp_size: int) -> EngineZmqAddresses:
        """Unix sockets in ``ipc_dir`` (every core on this host)."""
        return cls([[f"ipc://{ipc_dir}/input{c}_{e}" for e in range(dp_size)] for c in range(num_clients)],
                   [f"ipc://{ipc_dir}/output{c}" for c in range(num_clients)])

    @classmethod
    def over_tcp(cls, host: str, num_clients: int, dp_size: int) -> EngineZmqAddresses:
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


@dataclass(frozen=True)
class CoreLaunch:
    """What one rank process is started with (:func:`tandem.engine.core_proc.run_engine_core`).

    ``addresses``: the front ends' sockets (``ipc://`` on one host, ``tcp://`` across hosts).
    ``rank`` / ``world_size``: the rank's place in the deployment; ``master_addr`` /
    ``master_port``: its rendezvous (None for a single rank). ``local_rank``: the rank's index
    on its host (its GPU; None: ``rank``). ``parent_pid``: the launching process, with which
    the rank exits. ``log_level``: the launching process's (:func:`launcher_log_level`),
    unless ``TANDEM_LOGGING_LEVEL`` says otherwise.
    """

    config: EngineConfig
    addresses: EngineZmqAddresses
    parent_pid: int
    rank: int = 0
    world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    local_rank: int | None = None
    log_level: str = "WARNING"


def rank_launches(base: CoreLaunch, ranks: Sequence[int]) -> list[CoreLaunch]:
    """Each rank's launch of this host's ``ranks`` (consecutive global ranks): ``base`` with
    its global rank and its index on this host."""
    return [dataclasses.replace(base, rank=r, local_rank=i) for i, r in enumerate(ranks)]


def exit_reason(exitcode: int | None) -> str:
    """How a process ended, for the line that reports it: ``"exit code 1"``, ``"signal 9
    (SIGKILL: the kernel's out-of-memory killer, or kill -9)"``, or ``"exit code unknown"``
    (another process's child). ``exitcode`` as ``multiprocessing.Process.exitcode`` gives it
    (minus the signal number when a signal ended it)."""
    if exitcode is None:
        return "exit code unknown"
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = "unknown signal"
    why = {signal.SIGKILL: ": the kernel's out-of-memory killer, or kill -9",
           signal.SIGSEGV: ": a crash in native code", signal.SIGABRT: ": aborted in native code"}.get(-exitcode, "")
    return f"signal {-exitcode} ({name}{why})"


def check_tensor_parallel_size(config: EngineConfig) -> None:
    """The model's attention heads split evenly over ``tensor_parallel_size`` ranks, and its
    KV heads too or replicated (as the TP layers take them): checked by the front end before
    any rank starts, on the thread that builds the engine (the CLI's and ``LLM``'s caller,
    ``tandem serve``'s main thread before its loading thread starts: importing transformers
    on two threads at once fails).

    Raises:
        ValueError: naming the sizes that would split the heads.
    """
    tp = config.parallel_config.tensor_parallel_size
    if tp == 1:
        return
    from tandem.model_loader.loader import load_hf_config

    hf = load_hf_config(config.model_config.model)
    heads = getattr(hf, "num_attention_heads", None)
    if not heads:
        return
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads

    def splits(size: int) -> bool:
        return heads % size == 0 and (kv_heads % size == 0 if kv_heads >= size else size % kv_heads == 0)

    if not splits(tp):
        sizes = ", ".join(str(d) for d in range(1, heads + 1) if splits(d))
        raise ValueError(f"tensor_parallel_size ({tp}) must split the model's num_attention_heads ({heads}) and "
                         f"num_key_value_heads ({kv_heads}): one of {sizes}.")


def launcher_log_level() -> str:
    """The root log level of this process, for the rank processes it spawns: their load
    progress and stats lines then reach the log ``tandem serve`` writes (INFO) and stay out
    of an offline run's output (WARNING), as the launcher's own lines do."""
    return logging.getLevelName(logging.getLogger().getEffectiveLevel())


class _ForeignProcess:
    """A rank process launched by another process, watched through a pidfd (Linux >= 5.3):
    the subset of ``multiprocessing.Process`` the manager uses. It is not ours to kill."""

    exitcode = None  # only the launching process can read it

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.sentinel = os.pidfd_open(pid)
        except ProcessLookupError:
            raise ProcessLookupError(f"engine core process {pid} is gone") from None

    def is_alive(self) -> bool:
        return not select.select([self.sentinel], [], [], 0)[0]

    def join(self, timeout: float | None = None) -> None:
        select.select([self.sentinel], [], [], timeout)


# Managers whose spawned processes may still run, for kill_spawned (another thread may be
# spawning meanwhile: guarded by the lock).
_spawned: set[CoreProcManager] = set()
_spawned_lock = threading.Lock()


def kill_spawned() -> bool:
    """Kill every engine-core process this process spawned and has not stopped yet (a
    server stopped while its engine loads on another thread); they are not waited for.
    Returns whether any was alive."""
    with _spawned_lock:
        procs = [p for m in _spawned for p in m.procs]
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    return bool(alive)


class CoreProcManager:
    """The engine cores one client talks to and their processes (see the module docstring).
    Built by :meth:`launch`, :meth:`spawn`, :meth:`attach` or :meth:`external`.

    Attributes:
        addresses: the cores' sockets of every client.
        client_index: this process's client among them.
        owner: whether this process stops the cores (it spawned them, or torchrun did): an
            attached API server leaves them running.
        procs: the rank processes watched (``multiprocessing.Process``-like; none under
            torchrun).
        hosts: the head's handshake with its ``--headless`` hosts
            (:class:`tandem.engine.host_handshake.HeadHandshake`), or None.
    """

    def __init__(self, addresses: EngineZmqAddresses, client_index: int = 0, owner: bool = True) -> None:
        self.addresses = addresses
        self.client_index = client_index
        self.owner = owner
        self.procs: list = []
        self.hosts = None
        self._ipc_dir: str | None = None
        self._store = None  # the rendezvous store, served until every rank has exited

    @classmethod
    def launch(cls, config: EngineConfig, api_server_count: int = 0) -> CoreProcManager:
        """Spawn this host's ranks of ``config`` (``world_size`` processes on one host) with
        sockets for ``api_server_count + 1`` clients; this process's is the last. Several
        hosts: TCP sockets, and the handshake with the ``--headless`` hosts starts
        (:meth:`wait_for_hosts`).

        Raises:
            ValueError: the model path is none the loader reads, or flags that do not fit a
                head (before any rank starts).
            ConnectionError: the handshake port cannot be bound (several hosts).
            RuntimeError: the rendezvous port is taken.
        """
        from tandem.distributed.launch import host_store, resolve_rendezvous
        from tandem.model_loader.model_path import check_model_path

        # A missing model fails here, in one line, not after the ranks start.
        check_model_path(config.model_config.model)
        parallel = config.parallel_config
        num_clients, dp_size = api_server_count + 1, parallel.data_parallel_size
        if parallel.multi_host:
            parallel.check_host_role(headless=False)
            cores = cls(EngineZmqAddresses.over_tcp(parallel.data_parallel_address or "127.0.0.1", num_clients,
                                                    dp_size), api_server_count)
        else:
            ipc_dir = tempfile.mkdtemp(prefix="tandem-ipc-")
            cores = cls(EngineZmqAddresses.in_dir(ipc_dir, num_clients, dp_size), api_server_count)
            cores._ipc_dir = ipc_dir
        try:
            rdv = None
            if parallel.world_size > 1:
                rdv = resolve_rendezvous(parallel.master_addr or (parallel.data_parallel_address
                                                                  if parallel.multi_host else None),
                                         parallel.master_port)
                cores._store = host_store(rdv, parallel.world_size)
            addrs = cores.addresses
            if parallel.multi_host:
                from tandem.engine.host_handshake import HeadHandshake, HostWelcome

                cores.hosts = HeadHandshake(config, HostWelcome(addrs.inputs, addrs.outputs, rdv.master_addr,
                                                                rdv.master_port))
            cores._spawn(CoreLaunch(config, addrs, os.getpid(), world_size=parallel.world_size,
                                    master_addr=rdv and rdv.master_addr, master_port=rdv and rdv.master_port,
                                    log_level=launcher_log_level()), parallel.local_ranks)
        except BaseException:
            cores.close()
            raise
        return cores

    @classmethod
    def spawn(cls, base: CoreLaunch, ranks: Sequence[int]) -> CoreProcManager:
        """Spawn one rank process per rank of ``ranks`` (this host's) from ``base``, for the
        front ends of ``base.addresses`` (a ``--headless`` host: the head's)."""
        cores = cls(base.addresses)
        cores._spawn(base, ranks)
        return cores

    @classmethod
    def attach(cls, client_config: EngineClientConfig) -> CoreProcManager:
        """The cores another process launched, as its API server ``client_config.client_index``.

        Raises:
            ProcessLookupError: a rank process is gone already.
        """
        cores = cls(client_config.addresses, client_config.client_index, owner=False)
        cores.procs = [_ForeignProcess(pid) for pid in client_config.core_pids]
        return cores

    @classmethod
    def external(cls, addresses: EngineZmqAddresses) -> CoreProcManager:
        """Cores whose processes another launcher started (torchrun: every rank is a process
        of its own); this process is their only client and stops them."""
        return cls(addresses)

    def _spawn(self, base: CoreLaunch, ranks: Sequence[int]) -> None:
        from tandem.distributed.launch import spawn_ranks
        from tandem.engine.core_proc import run_engine_core

        launches = dict(zip(ranks, rank_launches(base, ranks)))
        with _spawned_lock:
            _spawned.add(self)
        self.procs = spawn_ranks(run_engine_core, ranks, lambda r: (launches[r],))

    def api_server_configs(self) -> list[EngineClientConfig]:
        """What each API server needs to attach (the clients before this process's)."""
        return [EngineClientConfig(self.addresses, c, self.pids) for c in range(self.client_index)]

    # ------------------------------------------------------------------ watching
    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def sentinels(self) -> list[int]:
        """The processes' sentinels (readable once a process has exited)."""
        return [p.sentinel for p in self.procs]

    def wait_for_hosts(self, check: Callable[[], None]) -> None:
        """Until every ``--headless`` host has joined (nothing on one host); ``check()`` is
        called every second meanwhile.

        Raises:
            HostRefusedError: some ranks had no host in time, or a host was lost.
        """
        if self.hosts is not None:
            self.hosts.wait_for_hosts(check=check)

    @property
    def lost_host(self) -> str | None:
        """Why a ``--headless`` host is gone, or None."""
        return self.hosts.lost if self.hosts is not None else None

    def wait_for_exit(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s (None: for ever) until a process exits or a host is lost;
        the processes that exited are reaped (their exit codes). Returns whether either
        happened."""
        ready = wait_sentinels(self.sentinels + ([self.hosts.lost_r] if self.hosts is not None else []), timeout)
        self._reap(ready)
        return bool(ready)

    def poll_exited(self) -> bool:
        """Whether a process has exited, without blocking (one ``select`` on the sentinels);
        those that did are reaped."""
        ready = select.select(self.sentinels, [], [], 0)[0]
        self._reap(ready)
        return bool(ready)

    def _reap(self, ready: list) -> None:
        # A sentinel is ready a moment before its process can be reaped: wait for the code.
        for p in self.procs:
            if p.sentinel in ready:
                p.join(timeout=5)

    def dead(self, count_clean_exits: bool = True) -> list[int]:
        """Indices of the processes that have exited; with ``count_clean_exits`` False, not
        those that exited with code 0 (a core the front end shut down)."""
        return [i for i, p in enumerate(self.procs)
                if not p.is_alive() and (count_clean_exits or p.exitcode != 0)]

    def any_alive(self) -> bool:
        return any(p.is_alive() for p in self.procs)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s in all for every process to exit."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ stopping
    def kill(self) -> None:
        """Kill the processes spawned here that still run and wait for them (another
        process's are left alone)."""
        if self.owner:
            for p in self.procs:
                if p.is_alive():
                    p.kill()
            for p in self.procs:
                p.join(timeout=5)
        with _spawned_lock:
            _spawned.discard(self)

    def close(self, error: str | None = None) -> None:
        """Kill what still runs (:meth:`kill`), tell the ``--headless`` hosts that the head
        stops (``error``: why, when it failed), remove the sockets' folder."""
        if self.hosts is not None:
            self.hosts.close(error)
        self.kill()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        self._store = None  # every rank is gone: the rendezvous store may close


__all__ = ["CoreLaunch", "CoreProcManager", "EngineClientConfig", "EngineZmqAddresses", "kill_spawned",
           "launcher_log_level", "rank_launches"]
