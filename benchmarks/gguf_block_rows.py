"""The CPU's GGUF block kernel by row count, on a model's linear shapes (issue 47).

A GGUF block layer (:class:`tandem.layers.quantization.gguf_blocks.GGUFBlockLinear`) runs every
row through one kernel over its repacked tiles (``torch.ops.tandem_cpu.gguf_repacked_linear``:
16 weight rows laid out for VNNI's dot product at the file's bits): a decode step's one row, a
verification's few and a prompt's many alike. This times it at each row count beside
``F.linear`` on the dequantized bf16 weight the layer does not keep, and, for the types
PyTorch's int4 kernel runs as one plane (Q4_0, Q4_1: the embedded model's layers, which stay
int4), beside that kernel. Weights are random blocks of the model's shapes in each type (the
time does not depend on the values; fp16 scales are set finite).

For each (shape, type), each row count: the median of ``--iters`` calls after a warm-up, the
paths alternated call by call, ms. Printed as a markdown table.

    python benchmarks/gguf_block_rows.py [--model qwen1.5b|qwen0.5b|smollm2]
        [--types Q4_K Q6_K Q5_0 Q8_0] [--rows 1 2 4 8 16 64 256] [--iters 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# (hidden, intermediate, q heads x head dim, kv heads x head dim) of the models Tandem runs here.
MODELS = {
    "smollm2": (576, 1536, 576, 192),
    "qwen0.5b": (896, 4864, 896, 128),
    "qwen1.5b": (1536, 8960, 1536, 256),
}
# Byte offsets of each type's fp16 scales in a block.
_SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208,)}


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """``name -> (out, in)`` of a decoder layer's fused linears."""
    h, inter, q, kv = MODELS[model]
    return {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q), "gate_up_proj": (2 * inter, h), "down_proj": (h, inter)}


def random_blocks(qtype: str, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block layer's ``(blocks, segments)`` of random bits with scales of ~0.01."""
    t = GGMLQuantizationType[qtype]
    block, size = GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (out_features, in_features // block, size), dtype=np.uint8)
    for at in _SCALES[qtype]:
        d = rng.uniform(0.002, 0.02, raw.shape[:2]).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return torch.from_numpy(raw.reshape(-1)), torch.tensor([[t.value, out_features, 0]])


def time_rows(repacked: torch.Tensor, segments: torch.Tensor, dense: torch.Tensor, int4: tuple | None,
              rows: int, iters: int) -> dict[str, float]:
    """Median ms of each path at ``rows`` rows, alternated call by call."""
    x = torch.randn(rows, dense.shape[1]).to(torch.bfloat16)
    paths = {"repacked": lambda: torch.ops.tandem_cpu.gguf_repacked_linear(x, repacked, segments, None),
             "bf16": lambda: F.linear(x, dense)}
    if int4 is not None:
        paths["int4"] = lambda: torch._weight_int4pack_mm_for_cpu(x, int4[0], 32, int4[1])
    times: dict[str, list[float]] = {k: [] for k in paths}
    for i in range(iters + 3):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            fn()
            if i >= 3:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def int4_weight(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's int4 CPU layout of a random weight, with bf16 scales and zeros per 32."""
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32)
    return (torch._convert_weight_to_int4pack_for_cpu(q, 1),
            torch.randn(in_features // 32, out_features, 2).to(torch.bfloat16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen1.5b", choices=sorted(MODELS))
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q5_0", "Q8_0"], choices=sorted(_SCALES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from tandem.layers import cpu_ops

    if not cpu_ops.available():
        raise SystemExit("the C++ CPU kernels could not be built")
    torch.set_num_threads(args.threads)
    print(f"{args.model}, {args.threads} threads, VNNI {bool(torch.ops.tandem_cpu.gguf_vnni())}; ms, "
          f"median of {args.iters}")
    print("| layer | type | rows | repacked | bf16 F.linear | int4 (one plane) | repacked / bf16 |")
    print("|---|---|---|---|---|---|---|")
    for name, (out_f, in_f) in layer_shapes(args.model).items():
        dense = torch.randn(out_f, in_f).to(torch.bfloat16)
        for qtype in args.types:
            if in_f % GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0]:
                continue
            blocks, segments = random_blocks(qtype, out_f, in_f)
            repacked, table = torch.ops.tandem_cpu.gguf_repack(blocks, segments, in_f)
            int4 = int4_weight(out_f, in_f) if qtype in ("Q4_0", "Q4_1") else None
            for rows in args.rows:
                t = time_rows(repacked, table, dense, int4, rows, args.iters)
                i4 = f"{t['int4']:.3f}" if "int4" in t else "-"
                print(f"| {name} [{out_f}, {in_f}] | {qtype} | {rows} | {t['repacked']:.3f} | {t['bf16']:.3f} | {i4} | "
                      f"{t['repacked'] / t['bf16']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
