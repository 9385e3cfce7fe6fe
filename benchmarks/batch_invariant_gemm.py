"""The batch-invariant Triton GEMM against cuBLAS at the Llama-3.1-8B linear shapes, bf16,
on the GPU (issue 51).

For each shape (qkv, o, gate_up, down, lm_head) and each M: the median milliseconds of
``F.linear`` (cuBLAS) and of :func:`tandem.layers.matmul_triton.matmul_batch_invariant`
(what ``--deterministic`` runs on CUDA) over repeated calls timed with CUDA events after
a warm-up, L2 flushed before each call (``triton.testing.do_bench``: the weight comes from
HBM, as in a decode step whose other layers evicted it), and their ratio.

Then the invariance check, per shape and implementation: one fixed row's output computed
alone (M = 1) against the same row placed at a random position among random rows in a
batch of each other M, compared bit for bit; printed as the number of batch sizes whose
row differs, and, for the Triton kernel, the number of kernel variants compiled over all
batch sizes of the shape (at most one: M is not specialised on; zero where an earlier
shape's variant serves, N and K being runtime arguments).

    python benchmarks/batch_invariant_gemm.py [--m 1,16,64,256,1000,2048] [--shapes qkv,o]
        [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import random
from functools import partial

import torch
import torch.nn.functional as F
import triton.testing

from tandem.layers.matmul_triton import matmul_batch_invariant, tile_config
from tandem.triton_utils import record_jit_compiles

# Llama-3.1-8B: (N, K) of each linear layer at TP 1.
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
IMPLS = {"F.linear": F.linear, "triton": matmul_batch_invariant}


def median_ms(fn, warmup_ms: int, rep_ms: int) -> float:
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def rows_differing(fn, weight: torch.Tensor, ms: list[int], seed: int) -> int:
    """How many batch sizes of ``ms`` give a fixed row other bits than computing it alone."""
    g = torch.Generator(device=weight.device).manual_seed(seed)
    rng = random.Random(seed)
    k = weight.shape[1]
    row = torch.randn(1, k, generator=g, device=weight.device, dtype=weight.dtype)
    alone = fn(row, weight)[0]
    differ = 0
    for m in ms:
        pos = rng.randrange(m)
        batch = torch.randn(m, k, generator=g, device=weight.device, dtype=weight.dtype)
        batch[pos] = row[0]
        differ += not torch.equal(fn(batch, weight)[pos], alone)
    return differ


def bench_shape(name: str, ms: list[int], warmup_ms: int, rep_ms: int) -> tuple[list[dict], dict]:
    """One shape's timing rows (printed as they come) and its invariance record."""
    n, k = SHAPES[name]
    cfg = tile_config(n, k, torch.bfloat16)
    cfg_text = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}, {cfg.num_warps}, {cfg.num_stages}"
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    timings = []
    with record_jit_compiles() as compiled:
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = median_ms(partial(F.linear, x, weight), warmup_ms, rep_ms)
            ours = median_ms(partial(matmul_batch_invariant, x, weight), warmup_ms, rep_ms)
            timings.append({"shape": name, "n": n, "k": k, "m": m, "f_linear_ms": ref, "triton_ms": ours,
                            "ratio": ours / ref})
            print(f"| {name} ({n} x {k}) | {cfg_text} | {m} | {ref:.4f} | {ours:.4f} | {ours / ref:.2f} |", flush=True)
        differing = {impl: rows_differing(fn, weight, ms, seed=n + k) for impl, fn in IMPLS.items()}
    # N and K are not constexprs: a shape whose variant an earlier shape compiled adds 0.
    variants = sum(v.startswith("_matmul_kernel") for v in compiled)
    return timings, {"shape": name, "batch_sizes": ms, "differing": differing, "triton_variants_compiled": variants}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,16,64,256,1000,2048", help="comma-separated batch sizes")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {','.join(SHAPES)}")
    ap.add_argument("--warmup-ms", type=int, default=25)
    ap.add_argument("--rep-ms", type=int, default=200)
    ap.add_argument("--json", help="also write the results to this path")
    args = ap.parse_args()
    ms = [int(s) for s in args.m.split(",")]
    device = torch.cuda.get_device_name()
    torch.manual_seed(0)
    timings, invariance = [], []
    print(f"{device}, bf16, median ms (L2 flushed before each call)\n")
    print("| shape (N x K) | tiles (BMxBNxBK, warps, stages) | M | F.linear ms | triton ms | triton / F.linear |")
    print("|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        rows, inv = bench_shape(name, ms, args.warmup_ms, args.rep_ms)
        timings += rows
        invariance.append(inv)
        torch.cuda.empty_cache()
    print(f"\nbatch sizes (of {len(ms)}: {args.m}) where a fixed row's bits differ from computing it alone (M = 1),"
          " and Triton kernel variants compiled for the shape:")
    print("| shape | F.linear | triton | triton variants compiled |")
    print("|---|---|---|---|")
    for r in invariance:
        print(f"| {r['shape']} | {r['differing']['F.linear']} | {r['differing']['triton']} "
              f"| {r['triton_variants_compiled']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "timings": timings, "invariance": invariance}, f, indent=1)


if __name__ == "__main__":
    main()
