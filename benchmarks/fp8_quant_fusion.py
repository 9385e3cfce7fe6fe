"""The FP8 activation quantization fused into the norm and SiLU-and-mul kernels against the
separate kernels it replaces (issue 17), per call on the GPU, at the Llama-3.1-8B sizes
(hidden 4096, intermediate 14336, bf16):

* norm: ``fused_add_rms_norm`` then the per-token quantization kernel, against
  ``rms_norm_dynamic_per_token_quant`` (the inputs of qkv_proj and gate_up_proj);
* SiLU-and-mul: ``silu_and_mul`` then the quantization kernel, against
  ``silu_and_mul_dynamic_per_token_quant`` (the input of down_proj).

Each is timed replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``), as the
decode steps run. The last column is what a decode step of the 32-layer model saves at
that batch (two norms and one SiLU-and-mul per layer), and the fused kernels' bandwidth
(bytes read and written once) against the H200's 4.8 TB/s: the replays leave small
batches' inputs in the 50 MB L2 (as a producing GEMM may), so those can exceed it.

    python benchmarks/fp8_quant_fusion.py [--batches 1,16,64,256,1024,4096]
"""

from __future__ import annotations

import argparse

import torch

HBM_BYTES_PER_S = 4.8e12
HIDDEN, INTER, LAYERS = 4096, 14336, 32


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64,256,1024,4096")
    args = ap.parse_args()
    import triton.testing

    from tandem.layers import fused_ops
    from tandem.layers.quantization.fp8_triton import quantize_per_token_triton

    def bench(fn) -> float:
        fn()  # compile outside the graph
        return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3  # us

    dev, dt = torch.device("cuda"), torch.bfloat16
    w = torch.randn(HIDDEN, device=dev, dtype=dt)
    print("| batch | norm: separate / fused (us) | SiLU-and-mul: separate / fused (us) | fused norm, SiLU GB/s "
          "| saved per decode step (32 layers) |")
    print("|---|---|---|---|---|")
    for m in (int(b) for b in args.batches.split(",")):
        x = torch.randn(m, HIDDEN, device=dev, dtype=dt)
        res = torch.randn(m, HIDDEN, device=dev, dtype=dt)
        gate_up = torch.randn(m, 2 * INTER, device=dev, dtype=dt)
        norm_sep = bench(lambda: quantize_per_token_triton(fused_ops.fused_add_rms_norm(x, res, w, 1e-5)[0]))
        norm_fused = bench(lambda: fused_ops.rms_norm_dynamic_per_token_quant(x, w, 1e-5, res))
        silu_sep = bench(lambda: quantize_per_token_triton(fused_ops.silu_and_mul(gate_up)))
        silu_fused = bench(lambda: fused_ops.silu_and_mul_dynamic_per_token_quant(gate_up))
        # Fused traffic: x and res read, the new residual (bf16) and q (1 byte) written; gate_up read, q written.
        norm_gbs = m * HIDDEN * (2 + 2 + 2 + 1) / (norm_fused * 1e-6) / 1e9
        silu_gbs = m * INTER * (4 + 1) / (silu_fused * 1e-6) / 1e9
        saved_ms = LAYERS * (2 * (norm_sep - norm_fused) + silu_sep - silu_fused) / 1e3
        print(f"| {m} | {norm_sep:.1f} / {norm_fused:.1f} | {silu_sep:.1f} / {silu_fused:.1f} | "
              f"{norm_gbs:.0f}, {silu_gbs:.0f} (peak {HBM_BYTES_PER_S / 1e9:.0f}) | {saved_ms:.3f} ms |")


if __name__ == "__main__":
    main()
