"""FP8 GEMM variants against bf16 at the Llama-3.1-8B linear shapes, on the GPU (issue 17).

Each row is one ``[M, K] @ [K, N]`` product timed as the decode steps run it: replayed
from a CUDA graph, cycling over enough weight copies that no copy stays in the 50 MB L2
between its calls. Variants:

* ``bf16``: ``F.linear`` (cuBLAS), the unquantized baseline;
* ``rowwise``: ``torch._scaled_mm`` with per-token activation and per-channel weight
  scales (what ``--quantization fp8`` runs), exact fp32 accumulation;
* ``rowwise-fast``: the same with ``use_fast_accum=True`` (Hopper's FP8 MMA accumulates
  without the periodic promotion to fp32 that the exact mode adds);
* ``tensor`` / ``tensor-fast``: one scale per tensor for each operand;
* ``deferred-fast``: per-token / per-channel operands through the unit-scale kernel into
  fp32 sums, what o_proj / down_proj run at decode sizes
  (``tandem.layers.quantization.fp8.fp8_linear_unscaled``; the scales are applied by the
  following norm kernel, not timed here).

Printed per shape and M: microseconds per GEMM, TFLOP/s, the floor (weights read once at
the HBM peak, or the math at the dense peak of the operand type, whichever is longer) and
the time over that floor; then, for each variant, the largest error of its output against
the fp32 product of the dequantized operands, relative to that product's largest value.

    python benchmarks/fp8_gemm.py [--m 256,1024,16384]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from mla_decode import graph_time_us

from tandem.layers.quantization.fp8 import quantize_per_token

HBM_BYTES_PER_S = 4.8e12  # H200 peak HBM3e bandwidth
PEAK_FLOPS = {"bf16": 989e12, "fp8": 1979e12}  # H200 SXM dense tensor-core peaks (datasheet)
L2_BYTES = 50 << 20
# Llama-3.1-8B: qkv_proj, o_proj, gate_up_proj, down_proj as (N, K).
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
VARIANTS = ("bf16", "rowwise", "rowwise-fast", "tensor", "tensor-fast", "deferred-fast")


def quantize(t: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 ``t`` and its fp32 scales: ``[rows, 1]`` per row, or one 0-d scale."""
    if per_row:
        return quantize_per_token(t)
    scale = (t.abs().max().float() / 448.0).clamp(min=1e-12)
    return (t.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def make_gemm(variant: str, x: torch.Tensor, weights: list[torch.Tensor]):
    """``fn(i)`` computing ``x @ weights[i % len].T`` in ``variant``, and (output, fp32
    reference) of copy 0 (``None`` for bf16)."""
    if variant == "bf16":
        return (lambda i: F.linear(x, weights[i % len(weights)])), None
    per_row = variant.startswith(("rowwise", "deferred"))
    xq, sa = quantize(x, per_row)
    quant = [quantize(w, per_row) for w in weights]
    fast = variant.endswith("-fast")
    if variant == "deferred-fast":
        one = torch.ones((), device=x.device)

        def fn(i: int) -> torch.Tensor:
            return torch._scaled_mm(xq, quant[i % len(quant)][0].t(), scale_a=one, scale_b=one,
                                    out_dtype=torch.float32, use_fast_accum=True)
    else:
        def fn(i: int) -> torch.Tensor:
            wq, ws = quant[i % len(quant)]
            sb = ws.view(1, -1) if per_row else ws
            return torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)

    wq, ws = quant[0]
    ref = (xq.float() * sa) @ (wq.float() * ws).t()
    out = fn(0) * sa * ws.view(1, -1) if variant == "deferred-fast" else fn(0)
    return fn, (out, ref)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="256,1024,16384")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print("| shape (N x K) | M | " + " | ".join(f"{v} us (TFLOP/s, x floor)" for v in args.variants) + " |")
    print("|---|---|" + "---|" * len(args.variants))
    errors: dict[str, float] = {}
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-2 * L2_BYTES // (n * k)))  # fp8 copies alone exceed L2 twice over
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in (int(s) for s in args.m.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cells = []
            for variant in args.variants:
                fn, out = make_gemm(variant, x, weights)
                us = graph_time_us(fn, calls=copies * 2)
                kind = "bf16" if variant == "bf16" else "fp8"
                elem = 2 if kind == "bf16" else 1
                floor_us = max(n * k * elem / HBM_BYTES_PER_S, 2 * m * n * k / PEAK_FLOPS[kind]) * 1e6
                cells.append(f"{us:.1f} ({2 * m * n * k / us / 1e6:.0f}, {us / floor_us:.2f}x)")
                if variant != "bf16" and m == 256:
                    y, ref = out
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    errors[variant] = max(errors.get(variant, 0.0), err)
            print(f"| {name} ({n} x {k}) | {m} | " + " | ".join(cells) + " |", flush=True)
        del weights
        torch.cuda.empty_cache()
    print("\nlargest error vs the fp32 product of the dequantized operands (M = 256), relative to its max:")
    for variant, err in errors.items():
        print(f"  {variant}: {err:.2e}")


if __name__ == "__main__":
    main()
