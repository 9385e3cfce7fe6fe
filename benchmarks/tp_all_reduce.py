"""Time of one tensor-parallel all-reduce per primitive and message size (issue 21: "the
fastest primitive measured per message size"): the decode-step all-reduce of a row-parallel
layer, ``[tokens, hidden]`` bf16, summed over the TP group.

Primitives (each in a CUDA graph of ``--reps`` back-to-back calls, as decode steps replay
them; the time is the replay's over ``--reps``, CUDA events, median of ``--iters``):

- ``nccl``: ``torch.distributed.all_reduce`` (what ``tandem.distributed.parallel_state.
  tp_all_reduce`` runs today);
- ``symm_one_shot``: ``torch.ops.symm_mem.one_shot_all_reduce`` on a symmetric-memory buffer
  (every rank reads every peer's whole buffer over NVLink: one step, latency-bound sizes);
- ``symm_two_shot``: ``torch.ops.symm_mem.two_shot_all_reduce_`` (reduce-scatter then
  all-gather through the peers' buffers: half the NVLink bytes per rank, two steps);
- ``add_rms_norm``: Tandem's fused residual add + RMSNorm of the same ``[tokens, hidden]``
  (no communication): what fusing the norm into the all-reduce could hide at most.

Every all-reduce is first checked against the exact sum (rank ``r`` contributes ``r + 1``).
A primitive that is not available (no NVLink peer access, an older torch) records its error
and the others still run. Without CUDA: gloo on the CPU, ``nccl`` becomes the gloo
all-reduce, eager, host timers (a smoke run). One process per GPU:

    torchrun --standalone --nproc-per-node 2 benchmarks/tp_all_reduce.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

PRIMITIVES = ("nccl", "symm_one_shot", "symm_two_shot", "add_rms_norm")


def symm_buffer(numel: int, dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup) -> torch.Tensor:
    """A ``numel`` buffer in symmetric memory, rendezvoused over ``group``."""
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op later
        symm_mem.enable_symm_mem_for_group(group.group_name)
    buf = symm_mem.empty(numel, dtype=dtype, device=device)
    symm_mem.rendezvous(buf, group.group_name)
    return buf


def make_op(name: str, x: torch.Tensor, group: dist.ProcessGroup) -> Callable[[], torch.Tensor]:
    """The call to time; it returns the reduced ``[tokens, hidden]`` (for the check)."""
    if name == "nccl":
        return lambda: (dist.all_reduce(x, group=group), x)[1]
    if name == "symm_one_shot":
        return lambda: torch.ops.symm_mem.one_shot_all_reduce(x, "sum", group.group_name)
    if name == "symm_two_shot":
        return lambda: (torch.ops.symm_mem.two_shot_all_reduce_(x, "sum", group.group_name), x)[1]
    if name == "add_rms_norm":
        from tandem.layers.fused_ops import fused_add_rms_norm

        residual, weight = torch.zeros_like(x), torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
        return lambda: fused_add_rms_norm(x, residual, weight, 1e-6)[0]
    raise ValueError(f"unknown primitive {name!r}; available: {', '.join(PRIMITIVES)}")


def check_sum(name: str, op: Callable[[], torch.Tensor], x: torch.Tensor, world: int, rank: int) -> float:
    """Max abs error of one all-reduce of ``rank + 1`` everywhere against the exact sum."""
    x.fill_(rank + 1)
    got = op().float()
    return 0.0 if name == "add_rms_norm" else (got - world * (world + 1) / 2).abs().max().item()


def time_op(op: Callable[[], torch.Tensor], cuda: bool, reps: int, iters: int) -> float:
    """Median microseconds per call."""
    if cuda:
        for _ in range(3):
            op()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                op()
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / reps)
        return statistics.median(times)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(reps):
            op()
        times.append((time.perf_counter() - t0) * 1e6 / reps)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file written by rank 0")
    ap.add_argument("--tokens", default="1,8,32,64,128,256,512,1024", help="rows of the message, comma-separated")
    ap.add_argument("--hidden", type=int, default=4096, help="columns (Llama-3.1-8B: 4096)")
    ap.add_argument("--primitives", default=",".join(PRIMITIVES))
    ap.add_argument("--reps", type=int, default=20, help="calls per CUDA graph replay")
    ap.add_argument("--iters", type=int, default=20, help="replays timed (median)")
    args = ap.parse_args(argv)
    names = args.primitives.split(",")
    if unknown := [n for n in names if n not in PRIMITIVES]:
        ap.error(f"unknown primitive(s) {', '.join(unknown)}; available: {', '.join(PRIMITIVES)}")

    from tandem.distributed import parallel_state as ps

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    world = int(os.environ.get("WORLD_SIZE", 1))
    info = ps.init_distributed(tp_size=world, device=dev)
    group = ps.get_tp_group() or dist.group.WORLD
    dtype = torch.bfloat16 if cuda else torch.float32
    sizes = [int(t) for t in args.tokens.split(",")]
    symm = None
    if cuda and any(n.startswith("symm") for n in names):
        try:
            symm = symm_buffer(max(sizes) * args.hidden, dtype, dev, group)
        except Exception as e:  # noqa: BLE001 - recorded; the NCCL rows still run
            symm = e
    rows = []
    for tokens in sizes:
        row: dict = dict(tokens=tokens, hidden=args.hidden, bytes=tokens * args.hidden * torch.finfo(dtype).bits // 8)
        for name in names:
            try:
                if name.startswith("symm") and not isinstance(symm, torch.Tensor):
                    raise RuntimeError(f"no symmetric memory: {symm!r}" if symm is not None else "needs CUDA")
                x = (symm[:tokens * args.hidden] if name.startswith("symm") else
                     torch.empty(tokens * args.hidden, dtype=dtype, device=dev)).view(tokens, args.hidden)
                op = make_op(name, x, group)
                err = check_sum(name, op, x, world, info.rank)
                x.zero_()  # repeated in-place sums of zeros stay finite
                row[name] = dict(us=round(time_op(op, cuda, args.reps, args.iters), 2), max_abs_err=err)
            except Exception as e:  # noqa: BLE001 - one primitive failing must not lose the rest
                row[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
        gathered: list = [None] * world
        dist.all_gather_object(gathered, row)
        if info.rank == 0:
            ok = {n: [g[n]["us"] for g in gathered] for n in names if all("us" in g[n] for g in gathered)}
            row["fastest_all_reduce"] = min((n for n in ok if n != "add_rms_norm"), key=lambda n: max(ok[n]), default=None)
            row["per_rank_us"] = ok
            rows.append(row)
            print(json.dumps(row), flush=True)
    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(world_size=world, device=str(dev), backend=dist.get_backend(group), dtype=str(dtype), reps=args.reps, rows=rows), f, indent=2)
    ps.destroy_distributed()


if __name__ == "__main__":
    main()
