"""The CPU int4 kernel against the bf16 GEMM by row count, on a model's linear shapes (issue 47).

A GGUF int4 layer (:class:`tandem.layers.quantization.gguf.GGUFInt4Linear`) runs its
generated rows through ``_weight_int4pack_mm_for_cpu`` (once per plane: one for Q4_0 / Q4_1 /
Q4_K, two for Q5_0 / Q5_1 / Q8_0) and its prompt rows through ``F.linear`` on the kept bf16
weight. The int4 kernel reads a quarter of the bytes but its time grows with the rows; this
times both for each row count, so that the crossover (the most generated rows worth the
int4 kernel) is a measurement. Weights are random of the model's shapes (the time does not
depend on the values).

For each (shape, planes), each row count: the median of ``--iters`` calls after a warm-up,
int4 and bf16 alternated call by call, ms. Printed as a markdown table with the ratio int4 /
bf16, and the crossover: the largest row count below which every count has int4 faster.

    python benchmarks/int4_rows.py [--model qwen1.5b|qwen0.5b|smollm2] [--rows 1 2 3 4 5 6 8 12 16]
        [--iters 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# (hidden, intermediate, q heads x head dim, kv heads x head dim) of the models Tandem runs here.
MODELS = {
    "smollm2": (576, 1536, 576, 192),
    "qwen0.5b": (896, 4864, 896, 128),
    "qwen1.5b": (1536, 8960, 1536, 256),
}


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """``name -> (out, in)`` of a decoder layer's fused linears."""
    h, inter, q, kv = MODELS[model]
    return {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q), "gate_up_proj": (2 * inter, h), "down_proj": (h, inter)}


def int4_layer(out_features: int, in_features: int, planes: int):
    from tandem.layers.quantization.gguf import GROUP_SIZE, GGUFInt4Linear

    g = torch.Generator().manual_seed(0)
    groups = (out_features, in_features // GROUP_SIZE)
    parts = [(torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8),
              torch.rand(groups, generator=g) * 0.01, torch.zeros(groups)) for _ in range(planes)]
    dense = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    return GGUFInt4Linear.from_planes(parts, dense=dense)


def time_rows(layer, rows: int, iters: int) -> tuple[float, float]:
    """Median ms of the int4 kernel and of the bf16 GEMM at ``rows`` rows, alternated."""
    x = torch.randn(rows, layer.in_features).to(torch.bfloat16)
    int4, dense = [], []
    for i in range(iters + 3):
        t0 = time.perf_counter()
        layer._int4(x)
        t1 = time.perf_counter()
        F.linear(x, layer.dense)
        t2 = time.perf_counter()
        if i >= 3:
            int4.append((t1 - t0) * 1e3)
            dense.append((t2 - t1) * 1e3)
    return statistics.median(int4), statistics.median(dense)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen1.5b")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6, 8, 12, 16])
    ap.add_argument("--planes", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{args.model}, {args.threads} threads, median of {args.iters}; ms int4 / bf16 (ratio)")
    print("| layer | planes | " + " | ".join(f"{r} rows" for r in args.rows) + " | int4 up to |")
    print("|---|---|" + "---|" * len(args.rows) + "---|")
    with torch.inference_mode():
        for name, (out_f, in_f) in layer_shapes(args.model).items():
            for planes in args.planes:
                layer = int4_layer(out_f, in_f, planes)
                cells, crossover = [], 0
                for r in args.rows:
                    a, b = time_rows(layer, r, args.iters)
                    cells.append(f"{a:.3f} / {b:.3f} ({a / b:.2f})")
                    if a < b and crossover == (args.rows[args.rows.index(r) - 1] if r != args.rows[0] else 0):
                        crossover = r
                print(f"| {name} {out_f}x{in_f} | {planes} | " + " | ".join(cells) + f" | {crossover} |")


if __name__ == "__main__":
    main()
