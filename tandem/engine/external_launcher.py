"""A deployment whose ranks another launcher started: ``torchrun``, ``srun`` or any env://
launcher (``RANK`` and ``WORLD_SIZE`` set; vLLM's ``external_launcher``).

Every process is one rank and builds its own engine core. The drivers (TP rank 0 of each
replica) serve their cores with the loop of a spawned core process
(:class:`tandem.engine.core_proc.EngineCoreProc`) and the TP followers follow them, as under
Tandem's own launcher. Global rank 0 also runs the front end: an :class:`LLMEngine` over a
:class:`tandem.engine.core_client.SyncMPClient` bound to TCP sockets on ``MASTER_ADDR``, the
one client protocol the server and ``LLM(data_parallel_size=...)`` use; its own core's loop
runs on a thread of its process. The drivers learn the sockets' addresses from rank 0 over the
DP control group (msgpack bytes). Every rank but 0 exits the process when rank 0 shuts the
deployment down.
"""

from __future__ import annotations

import os
import sys
import threading

import msgspec
import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.distributed import parallel_state as ps
from tandem.engine.core_client import SyncMPClient
from tandem.engine.core_proc import EngineCoreProc, serve
from tandem.engine.launch import CoreProcManager, EngineZmqAddresses


def _share_addresses(addresses, info):
    """Rank 0's ``EngineZmqAddresses``, on every driver (one broadcast over the DP control
    group: its length, then its msgpack bytes)."""
    if info.dp_size == 1:
        return addresses
    group, src = ps.get_dp_control_group(), ps.get_dp_ranks()[0]
    data = msgspec.msgpack.encode(addresses) if addresses is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return msgspec.msgpack.decode(buf.numpy().tobytes(), type=EngineZmqAddresses)


def make_external_launcher_engine(config: EngineConfig):
    """Join the deployment as this process's rank. Global rank 0: returns its
    :class:`LLMEngine` (front end); every other rank serves until rank 0 shuts down, then
    **exits the process**.

    Raises:
        ValueError: the environment's world size differs from the configuration's.
        EngineDeadError: a core failed to start.
    """
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.rank_core import build_rank_core, run_tp_follower

    parallel = config.parallel_config
    if int(os.environ["WORLD_SIZE"]) != parallel.world_size:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but tensor_parallel_size x data_parallel_size = "
                         f"{parallel.world_size}")
    core, info = build_rank_core(config, None, None, None, parallel.master_addr, parallel.master_port)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    addresses = EngineZmqAddresses.over_tcp(host, 1, info.dp_size) if info.rank == 0 else None
    if info.is_driver:
        addresses = _share_addresses(addresses, info)
    if info.rank == 0:
        return LLMEngine(config, RankZeroClient(config, core, info, addresses))
    try:
        if info.is_driver:
            proc = EngineCoreProc.for_rank(core, info, addresses.inputs, addresses.outputs)
            try:
                serve(proc, info)
            finally:
                proc.close()
        else:
            run_tp_follower(core)
    finally:
        core.shutdown()
        ps.destroy_distributed()
    sys.exit(0)


class RankZeroClient(SyncMPClient):
    """Rank 0's client: a :class:`SyncMPClient` of the drivers' sockets (it binds them before
    the cores connect) that also runs this rank's own core loop on a thread; its shutdown
    stops every core, then leaves the deployment."""

    def __init__(self, config: EngineConfig, core, info, addresses: EngineZmqAddresses) -> None:
        super().__init__(config, CoreProcManager.external(addresses), wait_ready=False)
        self._core, self._left = core, False
        self._proc = EngineCoreProc.for_rank(core, info, addresses.inputs, addresses.outputs)
        self._thread = threading.Thread(target=serve, args=(self._proc, info), name="tandem-engine-core", daemon=True)
        self._thread.start()
        self.wait_ready()

    def shutdown(self, timeout: float = 30.0) -> None:
        super().shutdown(timeout)
        if self._left:
            return
        self._left = True
        self._thread.join(timeout)
        self._proc.close()
        self._core.shutdown()
        ps.destroy_distributed()


__all__ = ["RankZeroClient", "make_external_launcher_engine"]
