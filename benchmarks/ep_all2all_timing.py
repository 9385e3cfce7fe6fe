"""Per-MoE-layer time of the NCCL ``all_to_all`` expert-parallel backend at decode sizes:
dispatch (launch + wait), local expert compute, combine (launch + wait), measured with CUDA
events on each rank, DeepSeek-V2-Lite expert shape (64 experts, top-6, hidden 2048, expert
width 1408) in bf16, experts split over the ranks (issue 8). Run one process per GPU (without
CUDA: fp32 on the CPU over gloo, host timers):

    torchrun --standalone --nproc-per-node 2 benchmarks/ep_all2all_timing.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def mark(cuda: bool):
    """A point in time on the current stream (CUDA event) or, on the CPU, of the host."""
    if not cuda:
        return time.perf_counter()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def elapsed_ms(a, b) -> float:
    return (b - a) * 1e3 if isinstance(a, float) else a.elapsed_time(b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="32,64,128,256", help="tokens per rank")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()

    import torch.distributed as dist

    from tandem.distributed import parallel_state as ps
    from tandem.distributed.all2all_factory import make_all2all_factory
    from tandem.distributed.forward_context import ForwardContext, forward_context
    from tandem.layers.moe import grouped_experts

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    info = ps.init_distributed(dp_size=world, enable_expert_parallel=True, device=dev)
    experts, top_k, hidden, inter = 64, 6, 2048, 1408
    a2a = make_all2all_factory("all_to_all", group=ps.get_ep_group(), ep_size=info.ep_size, ep_rank=info.ep_rank)(experts)
    e_loc = a2a.placement.num_local_experts
    gen = torch.Generator(device=dev).manual_seed(info.rank)
    w13 = torch.randn(e_loc, 2 * inter, hidden, device=dev, dtype=dtype, generator=gen) * 0.02
    w2 = torch.randn(e_loc, hidden, inter, device=dev, dtype=dtype, generator=gen) * 0.02
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        x = torch.randn(t, hidden, device=dev, dtype=dtype, generator=gen)
        ids = torch.rand(t, experts, device=dev, generator=gen).argsort(-1)[:, :top_k]
        w = torch.rand(t, top_k, device=dev, generator=gen)
        times = []
        with forward_context(ForwardContext(max_tokens_per_rank=t)):
            for i in range(args.iters + 5):
                marks = [mark(cuda)]
                rh, rid, rw, meta = a2a.dispatch_wait(a2a.dispatch_launch(x, ids, w))
                marks.append(mark(cuda))
                y = grouped_experts(rh, rid, rw, w13, w2)
                marks.append(mark(cuda))
                a2a.combine_wait(a2a.combine_launch(y, meta))
                marks.append(mark(cuda))
                if cuda:
                    torch.cuda.synchronize()
                if i >= 5:
                    times.append([elapsed_ms(marks[j], marks[j + 1]) for j in range(3)])
        med = [sorted(c)[len(c) // 2] for c in zip(*times)]
        gathered = [None] * world
        dist.all_gather_object(gathered, med)
        row = dict(tokens_per_rank=t, ep_size=info.ep_size, device=str(dev), received_rows=int(rh.shape[0]),
                   dispatch_ms=[g[0] for g in gathered], expert_ms=[g[1] for g in gathered],
                   combine_ms=[g[2] for g in gathered])
        rows.append(row)
        if info.rank == 0:
            print(json.dumps(row), flush=True)
    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(experts=experts, top_k=top_k, hidden=hidden, intermediate=inter, rows=rows), f, indent=2)
    ps.destroy_distributed()


if __name__ == "__main__":
    main()
