"""Launching the ranks of a deployment.

Two ways, both ending in :func:`tandem.distributed.parallel_state.init_distributed`:

* **Tandem's own launcher** (one machine): ``--data-parallel-size N
  --tensor-parallel-size M`` spawns ``N * M`` processes with ``torch.multiprocessing``
  (spawn start method: CUDA-safe); rank ``r`` uses ``cuda:r`` on GPUs. They meet at
  ``tcp://master_addr:master_port`` (``--master-addr`` / ``--master-port``; defaults:
  ``MASTER_ADDR``/``MASTER_PORT`` from the environment, else 127.0.0.1 and a free port),
  whose store the launching process serves (:func:`host_store`). The ranks run only
  Tandem's code: the caller's script is not re-run in them (:func:`spawn_ranks`).
* **Standard rendezvous** (``torchrun``, SLURM wrappers, any env:// launcher, one or many
  machines): when ``RANK`` and ``WORLD_SIZE`` are in the environment, the process *is* a
  rank; ``MASTER_ADDR``/``MASTER_PORT``/``LOCAL_RANK`` come from the environment too. E.g.
  ``torchrun --nproc-per-node 2 -m tandem.entrypoints.cli generate "Hi" --data-parallel-size 2``
  (global rank 0 runs the front-end; the other ranks serve it and exit with it).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import datetime

import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.distributed.parallel_state import env_rendezvous


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet (``tcp://addr:port``)."""

    master_addr: str
    master_port: int


def resolve_rendezvous(master_addr: str | None = None, master_port: int | None = None) -> Rendezvous:
    """Flags first, then ``MASTER_ADDR``/``MASTER_PORT``, then 127.0.0.1 and a free port."""
    addr = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = master_port or (int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else None)
    if port is None:
        port = free_port(addr if addr in ("127.0.0.1", "localhost") else "")
    return Rendezvous(addr, port)


def host_store(rdv: Rendezvous, world_size: int,
               timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> dist.TCPStore:
    """Serve the ranks' rendezvous store from the launching process (the ranks join with
    ``init_distributed(..., store_hosted=True)``).

    The store then outlives every rank: rank 0 may exit first without cutting the others'
    connection to it (NCCL's watchdog threads poll the store until their group is
    destroyed, and print TCPStore errors when its server went away). Keep the returned
    object until every rank has exited.

    Raises:
        RuntimeError: the port is taken.
    """
    return dist.TCPStore(rdv.master_addr, rdv.master_port, world_size, is_master=True, timeout=timeout,
                         wait_for_workers=False)


def spawn_ranks(target: Callable[..., None], ranks: int | Sequence[int], args_of_rank: Callable[[int], Sequence],
                daemon: bool = True, name: str = "tandem-rank") -> list[mp.Process]:
    """Start one process ``target(*args_of_rank(rank))`` per rank of ``ranks`` (an int
    ``n``: ranks ``0..n-1``; several hosts: this host's ranks), spawn start method.

    ``target`` and its arguments must come from importable modules, never from the
    caller's ``__main__``: the ranks do not re-run the caller's script (see
    :func:`_without_main_module`), so ``LLM(data_parallel_size=2)`` works from ``python -``,
    a notebook or a script without an ``if __name__ == "__main__"`` guard.

    Returns the started processes, named ``f"{name}{rank}"`` (the caller joins them, or kills
    them by their handles).
    """
    ctx = mp.get_context("spawn")
    procs = []
    with _without_main_module():
        for rank in range(ranks) if isinstance(ranks, int) else ranks:
            p = ctx.Process(target=target, args=tuple(args_of_rank(rank)), daemon=daemon, name=f"{name}{rank}")
            p.start()
            procs.append(p)
    return procs


@contextlib.contextmanager
def _without_main_module() -> Iterator[None]:
    """Hide the caller's ``__main__`` while processes are spawned.

    The spawn start method re-runs the parent's main script in every child before the
    target runs (``multiprocessing.spawn.get_preparation_data``). From ``python -`` that
    script is ``<stdin>`` and cannot be re-run; from a script without a ``__main__`` guard
    it would start the deployment again in every rank, and multiprocessing aborts it. The
    ranks need none of the caller's code, so they are spawned as if ``__main__`` were empty.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


__all__ = ["Rendezvous", "env_rendezvous", "free_port", "host_store", "resolve_rendezvous", "spawn_ranks"]
