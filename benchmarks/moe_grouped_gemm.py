"""Micro-benchmark: MoE expert compute as grouped GEMMs vs the per-expert Python loop.

Times :func:`tandem.layers.moe.grouped_experts` with ``impl`` = ``grouped_mm``
(``torch._grouped_mm``), ``padded_bmm`` and ``loop`` (the per-expert reference) on random
routing (uniform top-k over the experts) and prints a table (median ms per call, speed-up of
each implementation over the loop, max abs difference to the loop).

    python benchmarks/moe_grouped_gemm.py                      # small CPU shape
    python benchmarks/moe_grouped_gemm.py --preset v2-lite     # DeepSeek-V2-Lite MoE shape (CUDA, bf16)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.layers.moe import grouped_experts, grouped_mm_available

PRESETS = {
    # experts, top_k, hidden, moe intermediate, token counts
    "small": (16, 2, 256, 128, [16, 64, 256, 1024]),
    "v2-lite": (64, 6, 2048, 1408, [64, 256, 1024, 4096, 8192]),
    "qwen3-30b-a3b": (128, 8, 2048, 768, [64, 256, 1024, 4096]),
}


def _time(fn, iters: int, warmup: int, device: torch.device) -> float:
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument("--num-experts", type=int)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--tokens", type=int, nargs="+")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--impls", nargs="+", default=["grouped_mm", "padded_bmm", "loop"])
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    preset = args.preset or ("v2-lite" if device.type == "cuda" else "small")
    e, k, h, i, tokens = PRESETS[preset]
    e, k, h, i = args.num_experts or e, args.top_k or k, args.hidden or h, args.intermediate or i
    tokens = args.tokens or tokens
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    iters = args.iters or (50 if device.type == "cuda" else 10)
    impls = [m for m in args.impls if m != "grouped_mm" or grouped_mm_available(device, dtype)]

    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device=device, generator=gen) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=device, generator=gen) * i**-0.5).to(dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"# MoE expert compute: E={e} top_k={k} H={h} I={i} dtype={str(dtype).removeprefix('torch.')} on {name}")
    print(f"# torch {torch.__version__}; median of {iters} calls; speed-up vs the per-expert loop")
    head = f"| tokens | " + " | ".join(f"{m} ms" for m in impls) + " | " + " | ".join(
        f"{m} x" for m in impls if m != "loop") + " | max abs diff |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for n in tokens:
        x = torch.randn(n, h, device=device, generator=gen).to(dtype)
        ids = torch.rand(n, e, device=device, generator=gen).topk(k, dim=-1).indices
        w = torch.rand(n, k, device=device, generator=gen).softmax(-1)
        ms, outs = {}, {}
        for m in impls:
            outs[m] = grouped_experts(x, ids, w, w13, w2, impl=m)
            ms[m] = _time(lambda m=m: grouped_experts(x, ids, w, w13, w2, impl=m), iters, 3, device)
        ref = outs.get("loop")
        diff = max(((o.float() - ref.float()).abs().max().item() for o in outs.values()), default=0.0) if ref is not None else float("nan")
        speed = " | ".join(f"{ms['loop'] / ms[m]:.2f}" if "loop" in ms else "-" for m in impls if m != "loop")
        print(f"| {n} | " + " | ".join(f"{ms[m]:.3f}" for m in impls) + f" | {speed} | {diff:.2e} |")


if __name__ == "__main__":
    main()
