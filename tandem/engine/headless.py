"""``tandem serve --headless``: a host that runs engine cores for a head on another host
(vLLM's headless mode) and no API server.

It joins the head (:class:`tandem.engine.host_handshake.HeadLink`), spawns its ranks
(``data_parallel_size_local`` replicas from ``data_parallel_start_rank``, times the TP size)
as core processes connected to the head's API servers over TCP
(:meth:`tandem.engine.launch.CoreProcManager.spawn`), and watches both sides:

* the head stops normally (it sent SHUTDOWN to every core, then :class:`HostStop`): the
  cores exit on their own; exit 0;
* the head is gone (no heartbeat, or it stopped on an error): the cores are killed; exit 1;
* a core exits unasked: the head is told (it fails its requests and stops), the other
  cores are killed; exit 1;
* SIGTERM / SIGINT: the head is told, the cores are killed; exit 0.

The cores also exit on their own when this process is gone (``exit_with_parent``).
"""

from __future__ import annotations

import logging
import os
import signal

from tandem.config import EngineConfig

logger = logging.getLogger("tandem.serve")

# Seconds the cores get to exit after the head's normal stop before they are killed.
CORE_STOP_TIMEOUT_S = 10.0


def run_headless(config: EngineConfig) -> None:
    """Serve this host's share of the deployment until the head stops (see the module docstring).

    Raises:
        ValueError: flags that do not fit a headless host, a model path none the loader reads;
            ``HostRefusedError``: the head refused this host or did not answer (one line naming why).
        SystemExit: 1 when the head or a core was lost.
    """
    from tandem.engine.host_handshake import HeadLink
    from tandem.engine.launch import CoreLaunch, CoreProcManager, EngineZmqAddresses, launcher_log_level
    from tandem.model_loader.model_path import check_model_path

    parallel = config.parallel_config
    parallel.check_host_role(headless=True)
    check_model_path(config.model_config.model)
    link = HeadLink(config)
    w = link.welcome
    dp_ranks = range(parallel.data_parallel_start_rank, parallel.data_parallel_start_rank + parallel.data_parallel_local_size)
    logger.info("joined the head at %s: DP ranks %s (global ranks %s)", link.addr, list(dp_ranks),
                list(parallel.local_ranks))
    cores = CoreProcManager.spawn(CoreLaunch(config, EngineZmqAddresses(w.inputs, w.outputs), os.getpid(),
                                             world_size=parallel.world_size, master_addr=w.master_addr,
                                             master_port=w.master_port, log_level=launcher_log_level()),
                                  parallel.local_ranks)
    try:
        code = _supervise(link, cores)
    finally:
        cores.kill()
        link.close()
    if code:
        raise SystemExit(code)


def _supervise(link, cores) -> int:
    from tandem.engine.launch import exit_reason

    stop: list[int] = []
    old = {sig: signal.signal(sig, lambda signum, _f: stop.append(signum)) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop:
            gone = link.poll(0.5)
            if gone == "":
                logger.info("the head stopped: waiting for the engine cores")
                cores.join(CORE_STOP_TIMEOUT_S)
                return 0
            if gone is not None:
                logger.error("%s: stopping this host's engine cores", gone)
                return 1
            failed = [cores.procs[i] for i in cores.dead(count_clean_exits=False)]
            if failed:
                why = ", ".join(f"{p.name} (pid {p.pid}) exited: {exit_reason(p.exitcode)}" for p in failed)
                logger.error("engine core %s: stopping this host", why)
                link.stop(f"engine core {why}")
                return 1
            if not cores.any_alive():
                logger.info("the engine cores stopped (the head shut them down)")
                return 0  # the head's SHUTDOWN reached the cores before its HostStop
        logger.info("signal %d: stopping this host", stop[0])
        link.stop(f"host stopped by signal {stop[0]}")
        return 0
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


__all__ = ["run_headless"]
