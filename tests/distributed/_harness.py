"""Run a function on N CPU processes over gloo with a watchdog (a hang fails the test).

``run_ranks(fn, world_size, *args, timeout=...)`` spawns ``world_size`` processes (torch
multiprocessing, spawn), each calls ``fn(rank, world_size, port, *args)`` and sends its return
value back; the processes are killed (by their own handles) when the timeout passes.
"""

from __future__ import annotations

import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, args, q):
    import torch

    torch.set_num_threads(1)
    try:
        q.put((rank, "ok", fn(rank, world_size, port, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """Returns the per-rank results (by rank). Raises AssertionError on a rank's exception,
    a crash, or a timeout."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, q), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    import queue as _queue
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timeout after {timeout}s: ranks {sorted(set(range(world_size)) - set(results))} "
                                     f"did not finish (hang?)")
            try:
                rank, status, value = q.get(timeout=min(left, 1.0))
            except _queue.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in results and p.exitcode != 0]
                if dead:
                    raise AssertionError(f"ranks {dead} died (exit codes {[procs[i].exitcode for i in dead]})")
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(world_size)]


