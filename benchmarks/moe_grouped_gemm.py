"""Micro-benchmark: MoE expert compute — grouped GEMMs, the fused-MoE Triton kernel, the loop.

Times :func:`tandem.layers.moe.grouped_experts` with ``impl`` = ``grouped_mm``
(``torch._grouped_mm``), ``triton`` (:mod:`tandem.layers.fused_moe_triton`, default tiles),
``padded_bmm`` and ``loop`` (the per-expert reference) on random routing (uniform top-k over
the experts) and prints a table: median ms per call, speed-up of each implementation over
the loop, speed-up of ``triton`` over ``grouped_mm``, achieved GB/s of the expert weights
read (bytes of the experts that got at least one token / time; meaningful in the
memory-bound decode regime, the HBM roofline of an H200 is ~4.8 TB/s) and the max abs
difference to the loop.

``--graph`` times CUDA-graph replays (as the decode step runs them: no launch overhead of
the small alignment ops); the loop is always timed eagerly (it syncs). ``--sweep`` also
times a list of Triton tile configurations per token count and prints the best, to tune
:mod:`tandem.layers.fused_moe_triton`'s defaults and ``moe.TRITON_MAX_PAIRS``.

    python benchmarks/moe_grouped_gemm.py                      # small CPU shape
    python benchmarks/moe_grouped_gemm.py --preset v2-lite     # DeepSeek-V2-Lite MoE shape (CUDA, bf16)
    python benchmarks/moe_grouped_gemm.py --preset v2-lite --graph --sweep
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import torch

from tandem.layers.moe import TRITON_MAX_PAIRS, grouped_experts, grouped_mm_available

PRESETS = {
    # experts, top_k, hidden, moe intermediate, token counts
    "small": (16, 2, 256, 128, [16, 64, 256, 1024]),
    "v2-lite": (64, 6, 2048, 1408, [16, 64, 256, 1024, 4096, 8192]),
    "qwen3-30b-a3b": (128, 8, 2048, 768, [16, 64, 256, 1024, 4096]),
}

# Triton tile configurations tried by --sweep: (block_m, block_n, block_k, group_m, num_warps, num_stages);
# the rows of fused_moe_triton.TILE_CONFIGS are among them.
SWEEP = [
    (16, 128, 128, 8, 4, 3),
    (16, 128, 128, 1, 4, 4),
    (16, 128, 128, 8, 8, 3),
    (16, 64, 128, 8, 4, 4),
    (16, 64, 256, 8, 4, 3),
    (16, 128, 256, 8, 4, 2),
    (16, 256, 64, 8, 4, 4),
    (16, 64, 64, 8, 4, 5),
    (32, 128, 128, 8, 4, 3),
    (32, 64, 128, 8, 4, 4),
    (64, 64, 64, 8, 4, 3),
    (64, 128, 64, 8, 8, 4),
    (64, 128, 128, 8, 8, 3),
    (128, 128, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 3),
]


def _time(fn, iters: int, warmup: int, device: torch.device, graph: bool = False) -> float:
    if graph and device.type == "cuda":
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
    ap.add_argument("--impls", nargs="+", default=None,
                    help="default: grouped_mm triton padded_bmm loop (CUDA), grouped_mm padded_bmm loop (CPU; "
                         "triton there runs in the slow interpreter)")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (CUDA; not the loop)")
    ap.add_argument("--sweep", action="store_true", help="also time the Triton tile configs of SWEEP")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    impls = args.impls or (["grouped_mm", "triton", "padded_bmm", "loop"] if device.type == "cuda"
                           else ["grouped_mm", "padded_bmm", "loop"])
    if device.type == "cpu" and ("triton" in impls or args.sweep):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel is defined
    preset = args.preset or ("v2-lite" if device.type == "cuda" else "small")
    e, k, h, i, tokens = PRESETS[preset]
    e, k, h, i = args.num_experts or e, args.top_k or k, args.hidden or h, args.intermediate or i
    tokens = args.tokens or tokens
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    iters = args.iters or (50 if device.type == "cuda" else 10)
    impls = [m for m in impls if m != "grouped_mm" or grouped_mm_available(device, dtype)]
    graphed = {m: args.graph and device.type == "cuda" and m != "loop" for m in impls}

    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device=device, generator=gen) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=device, generator=gen) * i**-0.5).to(dtype)
    expert_bytes = 3 * h * i * w13.element_size()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"# MoE expert compute: E={e} top_k={k} H={h} I={i} dtype={str(dtype).removeprefix('torch.')} on {name}")
    print(f"# torch {torch.__version__}; median of {iters} calls{' (CUDA-graph replays)' if args.graph else ''}; "
          f"'x' columns: speed-up vs the per-expert loop; triton/grouped_mm: speed-up of triton over grouped_mm; "
          f"GB/s: expert weights read (all {e} experts = {e * expert_bytes / 1e9:.2f} GB) / time; "
          f"auto picks triton up to {TRITON_MAX_PAIRS} pairs on sm90+ (fp16/bf16)")
    both = "triton" in impls and "grouped_mm" in impls
    gbs = [m for m in ("grouped_mm", "triton") if m in impls]
    head = ("| tokens | pairs | " + " | ".join(f"{m} ms" for m in impls) + " | "
            + " | ".join(f"{m} x" for m in impls if m != "loop")
            + (" | triton/grouped_mm" if both else "") + "".join(f" | {m} GB/s" for m in gbs) + " | max abs diff |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    sweep_rows = []
    for n in tokens:
        x = torch.randn(n, h, device=device, generator=gen).to(dtype)
        ids = torch.rand(n, e, device=device, generator=gen).topk(k, dim=-1).indices
        w = torch.rand(n, k, device=device, generator=gen).softmax(-1)
        touched = int(torch.unique(ids).numel())  # experts whose weights are read
        ms, outs = {}, {}
        for m in impls:
            outs[m] = grouped_experts(x, ids, w, w13, w2, impl=m)
            ms[m] = _time(lambda m=m: grouped_experts(x, ids, w, w13, w2, impl=m), iters, 3, device, graphed[m])
        ref = outs.get("loop")
        diff = max(((o.float() - ref.float()).abs().max().item() for o in outs.values()), default=0.0) if ref is not None else float("nan")
        speed = " | ".join(f"{ms['loop'] / ms[m]:.2f}" if "loop" in ms else "-" for m in impls if m != "loop")
        ratio = f" | {ms['grouped_mm'] / ms['triton']:.2f}" if both else ""
        rates = "".join(f" | {touched * expert_bytes / ms[m] / 1e6:.0f}" for m in gbs)
        times = " | ".join(f"{ms[m]:.3f}" for m in impls)
        print(f"| {n} | {n * k} | {times} | {speed}{ratio}{rates} | {diff:.2e} |")
        if args.sweep:
            from tandem.layers.fused_moe_triton import fused_experts_triton

            for bm, bn, bk, gm, nw, ns in SWEEP:
                cfg = dict(block_m=bm, block_n=bn, block_k=bk, group_m=gm, num_warps=nw, num_stages=ns)
                fn = lambda cfg=cfg: fused_experts_triton(x, ids, w, w13, w2, **cfg)  # noqa: E731
                try:
                    t = _time(fn, iters, 3, device, args.graph)
                except Exception as exc:  # e.g. out of shared memory for a large config
                    print(f"#   sweep n={n} {cfg}: failed ({type(exc).__name__})")
                    continue
                sweep_rows.append((n, t, cfg, touched * expert_bytes / t / 1e6))
    if sweep_rows:
        print("\n# Triton tile sweep (best 3 per token count)")
        print("| tokens | ms | GB/s | block_m | block_n | block_k | group_m | num_warps | num_stages |")
        print("|---|---|---|---|---|---|---|---|---|")
        for n, rows in itertools.groupby(sweep_rows, key=lambda r: r[0]):
            for _, t, cfg, rate in sorted(rows, key=lambda r: r[1])[:3]:
                print(f"| {n} | {t:.3f} | {rate:.0f} | " + " | ".join(str(v) for v in cfg.values()) + " |")


if __name__ == "__main__":
    main()
