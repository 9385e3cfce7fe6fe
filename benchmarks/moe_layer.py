"""Micro-benchmark: the feed-forward half of a DeepSeek-V2 MoE decoder layer, the path
before the kernel cuts of issue 21 (``unfused``) against the current one (``fused``).

Both variants take the attention output and the residual stream of a decode step and
produce the layer's output (``fused``: as the pair ``hidden + residual``, the add left to
the next layer's fused RMSNorm) with the same weights:

* ``unfused``: residual add, RMSNorm, torch routing with the router weight in the model
  dtype (casts of ``x`` and of the weight to fp32, fp32 GEMM, softmax, top-k, the scaling),
  the fused-MoE kernels with the three-kernel alignment (and its memset) and SiLU-and-mul
  as its own kernel between the GEMMs, the shared experts, their add, the residual add
  (``$TANDEM_MOE_ROUTER=torch``, ``ALIGN_ONE_PROGRAM_MAX_PAIRS = 0``, ``FUSE_SILU_MUL =
  False`` while it runs).
* ``fused``: the residual add inside the RMSNorm kernel, the routing kernel
  (:mod:`tandem.layers.fused_router`, fp32 router weight), the single-program alignment,
  SiLU-and-mul in the first expert GEMM's epilogue, the shared experts' output added in
  the MoE reduction kernel.

Prints per token count the median ms of each variant (CUDA-graph replays on CUDA, as the
decode step runs), the speed-up, the GPU kernels one forward launches (torch.profiler, an
eager call) and the max abs difference of the two outputs. ``--parts`` also times the
pieces alone: the routing (torch vs the kernel), the alignment (three kernels vs one
program, to place ``fused_moe_triton.ALIGN_ONE_PROGRAM_MAX_PAIRS``) and the routed experts
with SiLU-and-mul as its own kernel vs in the GEMM's epilogue (``FUSE_SILU_MUL``).

    python benchmarks/moe_layer.py                          # DeepSeek-V2-Lite shape, 256 and 1024 tokens (CUDA)
    python benchmarks/moe_layer.py --tokens 64 256 1024 4096 --parts --list-kernels
    python benchmarks/moe_layer.py --preset small           # CPU (kernels in the Triton interpreter)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

PRESETS = {
    # experts, top_k, hidden, moe intermediate, shared experts, routed_scaling_factor, token counts
    "v2-lite": (64, 6, 2048, 1408, 2, 1.0, [256, 1024]),
    "small": (8, 2, 64, 32, 1, 1.0, [5, 17]),
}


@contextlib.contextmanager
def _old_path() -> Iterator[None]:
    """The routing and alignment choices before issue 21 while the block runs (the Python
    code only runs at capture: the graph replays what was chosen then)."""
    import tandem.layers.fused_moe_triton as fmt

    prev_env, prev_max, prev_silu = os.environ.get("TANDEM_MOE_ROUTER"), fmt.ALIGN_ONE_PROGRAM_MAX_PAIRS, fmt.FUSE_SILU_MUL
    os.environ["TANDEM_MOE_ROUTER"], fmt.ALIGN_ONE_PROGRAM_MAX_PAIRS, fmt.FUSE_SILU_MUL = "torch", 0, False
    try:
        yield
    finally:
        fmt.ALIGN_ONE_PROGRAM_MAX_PAIRS, fmt.FUSE_SILU_MUL = prev_max, prev_silu
        if prev_env is None:
            os.environ.pop("TANDEM_MOE_ROUTER")
        else:
            os.environ["TANDEM_MOE_ROUTER"] = prev_env


def build(preset: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """The layer's pieces: post-attention RMSNorm, the MoE block (fp32 router weight) and
    the router of the old path (the same weight in ``dtype``), built on the fused ops'
    kernels (in the Triton interpreter on the CPU)."""
    from tandem.layers import fused_ops
    from tandem.layers.moe import FusedMoE, SparseMoeBlock, TopKRouter
    from tandem.layers.norm import RMSNorm
    from tandem.models.llama import MLP

    e, k, h, i, n_shared, scale, _ = PRESETS[preset]
    torch.manual_seed(seed)
    with torch.device(device), fused_ops.building("triton"):
        router = TopKRouter(h, e, k, "deepseek_v2", fp32_logits=True, routed_scaling_factor=scale)
        experts = FusedMoE(e, k, h, i, impl="triton")
        shared = MLP(h, i * n_shared)
        norm = RMSNorm(h)
    block = SparseMoeBlock(router, experts, shared).to(dtype)
    norm.to(dtype)
    with torch.no_grad():
        for name, p in block.named_parameters():
            fan_in = p.shape[-1]
            p.copy_(torch.randn(p.shape, device=device) * fan_in**-0.5)
        # bf16-representable router weights: both variants route alike
        router.weight.data = router.weight.data.float().to(dtype).float()
        norm.weight.copy_(1.0 + 0.1 * torch.randn(h, device=device))
    old_router = TopKRouter(h, e, k, "deepseek_v2", fp32_logits=True, routed_scaling_factor=scale)
    old_router.weight = nn.Parameter(router.weight.detach().to(dtype), requires_grad=False)
    return norm, block, old_router


def variants(norm, block, old_router) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """``name -> fn(attn_out, residual) -> layer output``; the fused one returns the pair's sum
    outside the timed region (see :func:`main`), so it is given here as the pair."""

    def unfused(attn_out: torch.Tensor, residual: torch.Tensor):
        with _old_path():
            x = residual + attn_out
            h = norm(x)
            ids, w = old_router(h)
            out = block.experts(h, ids, w) + block.shared_experts(h)
            return x + out

    def fused(attn_out: torch.Tensor, residual: torch.Tensor):
        h, res = norm(attn_out, residual)
        return block(h), res

    return {"unfused": unfused, "fused": fused}


def _time(fn: Callable[[], object], iters: int, device: torch.device, graph: bool) -> float:
    warmup = 3
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gpu_kernels(fn: Callable[[], object]) -> collections.Counter:
    """GPU kernels (and memsets/copies) of one eager call, by name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def time_parts(block, old_router, x: torch.Tensor, iters: int, device: torch.device, graph: bool) -> str:
    """One table row (ms): routing torch / kernel, alignment three kernels / one program,
    routed experts with SiLU-and-mul apart / in the GEMM."""
    import tandem.layers.fused_moe_triton as fmt

    def routing(router, impl):
        def run():
            os.environ["TANDEM_MOE_ROUTER"] = impl
            try:
                return router(x)
            finally:
                os.environ.pop("TANDEM_MOE_ROUTER")
        return run

    ids, _ = block.gate(x)
    block_m = fmt.default_config(ids.numel(), block.experts.w13.shape[0])["block_m"]

    def align(one_program):
        def run():
            prev, fmt.ALIGN_ONE_PROGRAM_MAX_PAIRS = fmt.ALIGN_ONE_PROGRAM_MAX_PAIRS, 10**12 if one_program else 0
            try:
                return fmt.moe_align_block_size(ids, block.experts.w13.shape[0], block_m)
            finally:
                fmt.ALIGN_ONE_PROGRAM_MAX_PAIRS = prev
        return run

    ids, w = block.gate(x)

    def experts(fuse_silu):
        def run():
            prev, fmt.FUSE_SILU_MUL = fmt.FUSE_SILU_MUL, fuse_silu
            try:
                return block.experts(x, ids, w)
            finally:
                fmt.FUSE_SILU_MUL = prev
        return run

    ms = [_time(fn, iters, device, graph) for fn in (routing(old_router, "torch"), routing(block.gate, "triton"),
                                                      align(False), align(True), experts(False), experts(True))]
    return " | ".join(f"{m:.4f}" for m in ms)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="default: v2-lite on CUDA, small on the CPU")
    ap.add_argument("--tokens", type=int, nargs="+")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--no-graph", action="store_true", help="time eager calls on CUDA")
    ap.add_argument("--list-kernels", action="store_true", help="print each variant's GPU kernels (CUDA)")
    ap.add_argument("--parts", action="store_true", help="also time the routing and the alignment alone")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel is defined
        from tests.triton_interpreter import patch_interpreter_for_numpy_2_4

        patch_interpreter_for_numpy_2_4()
    run(args, device)


def run(args: argparse.Namespace, device: torch.device) -> None:
    """The tables of :func:`main` on ``device``."""
    preset = args.preset or ("v2-lite" if device.type == "cuda" else "small")
    e, k, h, i, n_shared, _, tokens = PRESETS[preset]
    tokens = args.tokens or tokens
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    iters = args.iters or (200 if device.type == "cuda" else 3)
    graph = device.type == "cuda" and not args.no_graph
    norm, block, old_router = build(preset, device, dtype)
    fns = variants(norm, block, old_router)
    if device.type == "cpu":  # the fused variant's routing kernel in the interpreter
        fused = fns["fused"]

        def fused_cpu(a, r):
            os.environ["TANDEM_MOE_ROUTER"] = "triton"
            try:
                return fused(a, r)
            finally:
                os.environ.pop("TANDEM_MOE_ROUTER")

        fns["fused"] = fused_cpu
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"# MoE layer, feed-forward half ({preset}: E={e} top_k={k} H={h} I={i} shared={n_shared}x{i}, "
          f"{str(dtype).removeprefix('torch.')}) on {name}; torch {torch.__version__}")
    print(f"# median of {iters} {'CUDA-graph replays' if graph else 'eager calls'}; kernels: GPU kernels of one "
          f"eager forward; diff: max abs difference of the outputs")
    print("| tokens | unfused ms | fused ms | speed-up | unfused kernels | fused kernels | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    listing = {}
    with torch.no_grad():
        for t in tokens:
            gen = torch.Generator(device=device).manual_seed(t)
            attn_out = torch.randn(t, h, device=device, generator=gen).to(dtype)
            residual = torch.randn(t, h, device=device, generator=gen).to(dtype)
            old = fns["unfused"](attn_out, residual)
            hid, res = fns["fused"](attn_out, residual)
            diff = (old.float() - (hid + res).float()).abs().max().item() if t else 0.0
            ms = {n: _time(lambda f=f: f(attn_out, residual), iters, device, graph) for n, f in fns.items()}
            counts = {n: "-" for n in fns}
            if device.type == "cuda":
                for n, f in fns.items():
                    listing[(t, n)] = gpu_kernels(lambda f=f: f(attn_out, residual))
                    counts[n] = str(sum(listing[(t, n)].values()))
            print(f"| {t} | {ms['unfused']:.4f} | {ms['fused']:.4f} | {ms['unfused'] / ms['fused']:.2f}x | "
                  f"{counts['unfused']} | {counts['fused']} | {diff:.3g} |")
    if args.parts:
        print("\n| tokens | routing torch ms | routing kernel ms | align 3 kernels ms | align 1 program ms | "
              "experts, silu apart ms | experts, silu in GEMM ms |")
        print("|---|---|---|---|---|---|---|")
        with torch.no_grad():
            for t in tokens:
                x = torch.randn(t, h, device=device).to(dtype)
                print(f"| {t} | {time_parts(block, old_router, x, iters, device, graph)} |")
    if args.list_kernels:
        for (t, n), c in listing.items():
            print(f"\n## {n}, {t} tokens: {sum(c.values())} kernels")
            for kname, cnt in c.most_common():
                print(f"{cnt:3d}  {kname[:110]}")


if __name__ == "__main__":
    main()
