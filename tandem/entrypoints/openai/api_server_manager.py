"""``tandem serve --api-server-count N``: N API-server processes on one port in front of the
shared engine cores (vLLM's ``run_multi_api_server`` / ``APIServerProcessManager``).

One front-end process (HTTP, validation, tokenization, detokenization of every stream, SSE)
falls behind the engine cores at high concurrency; N of them share that work. The launching
process:

1. binds N listening sockets to the one port with ``SO_REUSEPORT`` (before the model loads,
   so a busy port is reported at once). The kernel spreads new connections evenly over
   them by address hash. vLLM instead shares one listening socket; under a burst of
   connections the API server that wakes first accepts all queued ones (asyncio accepts up
   to its backlog per wake-up), so one process would take most of a benchmark's
   connections. All N sockets listen from the start, so none misses the first connections;
2. spawns the engine cores with a client slot per API server plus its own
   (:meth:`tandem.engine.launch.CoreProcManager.launch` with ``api_server_count``, under a
   :class:`tandem.engine.core_client.SyncMPClient`);
3. spawns the API servers (:func:`run_api_server_worker`) while the cores load, each with
   its socket and an ``AsyncLLM`` attached to the cores (its own processor, detokenizer and
   output processor; it waits for the cores' handshakes itself); Prometheus metrics go to a
   shared multiprocess folder, so ``/metrics`` of any of them reports the sum over all;
4. watches every process. SIGTERM / SIGINT: the API servers stop (each as a single server
   does, by ``--shutdown-timeout``: it drains or ends its live requests, and exits 0), then
   the cores; exit 0. A second SIGTERM / SIGINT ends the API servers' drains at once
   (:data:`~tandem.entrypoints.openai.api_server.ABORT_SIGNAL`). An engine core dies: every API server fails its
   live requests (it watches the cores itself) and exits 1; so does this process, within
   :data:`DEAD_ENGINE_EXIT_DELAY_S` + a few seconds. An API server dies: the whole server
   stops (as vLLM's does) and exits 1. Every child also exits on its own when this
   process is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.connection import wait as wait_sentinels

from tandem.config import EngineConfig
from tandem.engine.core_client import EngineDeadError, SyncMPClient
from tandem.engine.launch import CoreProcManager, EngineClientConfig, exit_reason
from tandem.entrypoints.openai.api_server import (ABORT_SIGNAL, DEAD_ENGINE_EXIT_DELAY_S, ENGINE_STOP_TIMEOUT_S,
                                                   bind_socket)

logger = logging.getLogger("tandem.serve")

# Seconds the API servers get to stop after SIGTERM, beyond their --shutdown-timeout (their
# drain ends within it), before they are killed.
API_SERVER_STOP_TIMEOUT_S = 30.0
# Seconds between two checks of the processes (and drains of the cores' messages).
SUPERVISE_POLL_S = 0.5


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` sockets listening on one address with ``SO_REUSEPORT`` (port 0: a free
    port).

    Raises:
        ConnectionError: the address cannot be bound, or is in use, also by another server's
            ``SO_REUSEPORT`` sockets, which a socket with that option would silently join.
    """
    with bind_socket(host, port) as probe:
        port = probe.getsockname()[1]
    socks = [bind_socket(host, port, reuse_port=True) for _ in range(count)]
    for s in socks:
        s.listen(2048)  # uvicorn's default backlog
    return socks


def run_api_server_worker(args: argparse.Namespace, sock: socket.socket, client_config: EngineClientConfig,
                          metrics_dir: str, parent_pid: int) -> None:
    """Entry of one API-server process: attach to the cores and serve on ``sock``."""
    from tandem.engine.async_llm import AsyncLLM
    from tandem.engine.core_proc import exit_with_parent
    from tandem.entrypoints.openai.api_server import exit_now, serve_http
    from tandem.entrypoints.openai.cli_args import serve_engine_config
    from tandem.logging_config import configure_logging

    exit_with_parent(parent_pid)
    configure_logging(default_level="INFO")
    cfg = serve_engine_config(args)
    try:
        # Answers 503 while it waits for the cores' handshakes.
        serve_http(lambda: AsyncLLM(cfg, client_config), sock, args, api_server_index=client_config.client_index,
                   metrics_dir=metrics_dir)
    except SystemExit as e:
        exit_now(e.code if isinstance(e.code, int) else 1)
    exit_now(0)


class APIServerProcessManager:
    """Spawns the API-server processes and stops them (vLLM's name).

    Args:
        args: the ``tandem serve`` flags.
        sockets: one listening socket per API server.
        client_configs: how each attaches to the cores.
        metrics_dir: the shared ``PROMETHEUS_MULTIPROC_DIR``.
    """

    def __init__(self, args: argparse.Namespace, sockets: list[socket.socket],
                 client_configs: list[EngineClientConfig], metrics_dir: str) -> None:
        from tandem.distributed.launch import spawn_ranks

        # The flags without the command's handler (a function of the CLI's __main__).
        args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
        # prometheus_client picks its multiprocess value files at import, from the
        # environment: set for the spawned servers only.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        try:
            self.procs = spawn_ranks(run_api_server_worker, len(sockets), lambda i: (
                args, sockets[i], client_configs[i], metrics_dir, os.getpid()), name="tandem-api-server")
        finally:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]

    @property
    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.procs]

    def exited(self) -> list[int]:
        """Indices of the servers that have exited."""
        return [i for i, p in enumerate(self.procs) if not p.is_alive()]

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for every server to exit."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))

    def abort(self) -> None:
        """End every live server's drain at once (safe from a signal handler)."""
        for p in self.procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, ABORT_SIGNAL)

    def close(self, timeout: float = API_SERVER_STOP_TIMEOUT_S, drain: bool = False) -> list[int]:
        """Stop every live server: ``drain``, by SIGTERM (it drains by its
        ``--shutdown-timeout``), else at once (:meth:`abort`); wait up to ``timeout`` s, kill
        the rest; returns their exit codes."""
        if drain:
            for p in self.procs:
                if p.is_alive():
                    p.terminate()
        else:
            self.abort()
        self.wait(timeout)
        for p in self.procs:
            if p.is_alive():
                logger.warning("API server %s did not stop in %.0f s: killed", p.name, timeout)
                p.kill()
                p.join(5)
        return [p.exitcode for p in self.procs]


class _StopSignals:
    """SIGTERM / SIGINT while the API servers serve and stop: the first is recorded in
    ``received`` (:func:`_supervise` then stops them, draining), each later one ends their
    drains at once. Installed by :meth:`install`, until :meth:`restore`."""

    def __init__(self, servers: APIServerProcessManager) -> None:
        self.servers = servers
        self.received: list[int] = []
        self._old: dict[int, object] = {}

    def install(self) -> None:
        self._old = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}

    def _on_signal(self, signum: int, _frame) -> None:
        self.received.append(signum)
        if len(self.received) > 1:
            self.servers.abort()


def _supervise(client: SyncMPClient, servers: APIServerProcessManager, stop: list[int], drain_s: int) -> int:
    """Watch the cores and the API servers until a signal lands in ``stop`` (0) or a death (1)."""
    sentinels = servers.sentinels + client.cores.sentinels
    while not stop:
        wait_sentinels(sentinels, SUPERVISE_POLL_S)
        try:
            client.poll_outputs()
        except EngineDeadError as e:
            logger.error("engine core died (%s): the API servers fail their requests and exit", e)
            servers.wait(DEAD_ENGINE_EXIT_DELAY_S + 5.0)
            return 1
        dead = servers.exited()
        if dead and not stop:
            logger.error("API server(s) exited: %s: the server stops", ", ".join(
                f"{i} ({exit_reason(servers.procs[i].exitcode)})" for i in dead))
            return 1
    if drain_s:
        logger.info("signal %d: the API servers drain their requests for up to %d s (a second SIGTERM/SIGINT aborts "
                    "them at once), then the engine cores stop", stop[0], drain_s)
    else:
        logger.info("signal %d: stopping the API servers, then the engine cores", stop[0])
    return 0


def run_multi_api_server(args: argparse.Namespace, cfg: EngineConfig) -> None:
    """Serve with ``args.api_server_count`` API-server processes (see the module docstring).

    Raises:
        ConnectionError: the address cannot be bound (before anything loads).
        ValueError: a model path none the loader reads (before the cores start), a core
            failed to start on bad input (``EngineConfigError``).
        EngineDeadError: an engine core failed to start otherwise.
        SystemExit: 1 when an engine core or an API server died.
    """
    n = args.api_server_count
    socks = bind_sockets(args.host, args.port, n)
    host, port = socks[0].getsockname()[:2]
    metrics_dir = tempfile.mkdtemp(prefix="tandem-metrics-")
    servers = signals = None
    code = 1
    try:
        logger.info("loading %s", cfg.model_config.model)
        client = SyncMPClient(cfg, CoreProcManager.launch(cfg, api_server_count=n), wait_ready=False)
        try:
            servers = APIServerProcessManager(args, socks, client.cores.api_server_configs(), metrics_dir)
            for s in socks:
                s.close()  # the API servers hold them now
            client.wait_ready()
            logger.info("engine cores ready (pids %s); %d API servers on http://%s:%d (pids %s)",
                        client.cores.pids, n, host, port, [p.pid for p in servers.procs])
            signals = _StopSignals(servers)
            signals.install()
            code = _supervise(client, servers, signals.received, args.shutdown_timeout)
        finally:
            # The servers first: cores that stopped under them would read as dead. A stop
            # asked for drains them; after a death they stop at once.
            codes = servers.close(args.shutdown_timeout + API_SERVER_STOP_TIMEOUT_S,
                                  drain=code == 0) if servers is not None else []
            if signals is not None:
                signals.restore()
            client.shutdown(ENGINE_STOP_TIMEOUT_S)
        if code == 0 and any(codes):
            logger.error("API server exit codes %s after the stop", codes)
            code = 1
    finally:
        for s in socks:
            s.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if code:
        raise SystemExit(code)
