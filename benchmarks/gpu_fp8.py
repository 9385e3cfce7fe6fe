"""FP8 vs bf16 on the seed workload, Llama-3.1-8B shape with dummy weights, side by side on
one GPU (issue 17).

Variants (each ``tandem bench throughput`` in its own process, so every engine gets the
whole GPU): ``bf16``; ``fp8`` (``--quantization fp8``: online per-channel W8A8 through
cuBLASLt, the activations quantized by the norm / SiLU-and-mul kernels); ``fp8-kv`` (also
``--kv-cache-dtype fp8``); ``fp8-unfused`` (``fp8`` with ``TANDEM_FP8_FUSED_QUANT=off``: a
separate quantization kernel per linear input; not run unless named); ``fp8-exact`` (``fp8``
with ``TANDEM_FP8_FAST_ACCUM=off``: the GEMMs promote to fp32 accumulators periodically;
not run unless named); ``fp8-scaled`` (``fp8`` with ``TANDEM_FP8_DEFERRED_SCALES_MAX_ROWS=0``:
o_proj / down_proj scale their own products at decode sizes too; not run unless named). They run in alternating order
(``bf16 fp8 fp8-kv``, then reversed, ...) ``--repeats`` times at every ``--max-num-seqs``;
the table gives the median requests/s, the spread (min-max) and the median ratio to bf16
at the same ``--max-num-seqs``. Workload: ``--num-prompts`` random prompts, input 128,
output 256, greedy, EOS ignored, CUDA graphs on, async output processing on.

Also printed: the decode step at the largest batch against its FP8 floors: HBM (FP8
matmul weights + bf16 LM head + the KV read once at peak bandwidth) and FP8 matmul at the
dense FP8 tensor-core peak plus the KV read.

``--shape deepseek-v2-lite`` runs the DeepSeek-V2-Lite shape instead (FP8 experts in the
fused-MoE kernel; no ``fp8-kv``: the MLA latent cache stays bf16; no floors printed).

``--max-num-seqs default`` leaves the batch limits to the engine (sized for the GPU).
Host time per engine step and the GPU's idle share are printed beside each run.

    python benchmarks/gpu_fp8.py --out DIR [--num-prompts 1000] [--max-num-seqs 256 default] [--repeats 2]
    python benchmarks/gpu_fp8.py --out DIR --shape deepseek-v2-lite --variants bf16 fp8
    python benchmarks/gpu_fp8.py --out DIR --variants bf16 fp8-unfused fp8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess

from model_shapes import DEEPSEEK_V2_LITE, LLAMA_31_8B, seed_workload_command, write_config_dir

HBM_BYTES_PER_S = 4.8e12  # H200 peak HBM3e bandwidth
FP8_FLOPS_PER_S = 1979e12  # H200 dense FP8 tensor-core peak (SXM datasheet)

VARIANTS = {"bf16": (), "fp8": ("--quantization", "fp8"),
            "fp8-kv": ("--quantization", "fp8", "--kv-cache-dtype", "fp8"),
            "fp8-unfused": ("--quantization", "fp8"), "fp8-exact": ("--quantization", "fp8"),
            "fp8-scaled": ("--quantization", "fp8")}
VARIANT_ENV = {"fp8-unfused": {"TANDEM_FP8_FUSED_QUANT": "off"}, "fp8-exact": {"TANDEM_FP8_FAST_ACCUM": "off"},
               "fp8-scaled": {"TANDEM_FP8_DEFERRED_SCALES_MAX_ROWS": "0"}}
DEFAULT_VARIANTS = ["bf16", "fp8", "fp8-kv"]


def seqs_arg(text: str) -> int | None:
    return None if text == "default" else int(text)


def run(cfg_dir: str, out: str, variant: str, max_num_seqs: int | None, rep: int, num_prompts: int) -> dict:
    path = os.path.join(out, f"{variant}_seqs{max_num_seqs or 'default'}_rep{rep}.json")
    cmd = seed_workload_command(cfg_dir, path, *VARIANTS[variant], num_prompts=num_prompts, max_num_seqs=max_num_seqs)
    env = VARIANT_ENV.get(variant, {})
    print("+", *(f"{k}={v}" for k, v in env.items()), " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **env})
    with open(path) as f:
        return json.load(f)


def floors_ms(r: dict, fp8_kv: bool) -> tuple[float, float]:
    """(HBM floor, FP8-matmul-at-peak + KV floor) of the decode step at the largest batch."""
    c = LLAMA_31_8B
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    layer_weights = c["num_hidden_layers"] * (
        c["hidden_size"] * (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head_dim
        + c["num_attention_heads"] * head_dim * c["hidden_size"] + 3 * c["hidden_size"] * c["intermediate_size"])
    lm_head = c["vocab_size"] * c["hidden_size"]
    weight_bytes = layer_weights + 2 * lm_head  # FP8 layers, bf16 LM head (not quantized, as vLLM)
    kv_bytes = (1 if fp8_kv else 2) * 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * (
        r.get("max_batch_context_tokens") or 0)
    hbm = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3
    compute = (2 * (layer_weights + lm_head) * (r.get("max_decode_batch") or 0) / FP8_FLOPS_PER_S
               + kv_bytes / HBM_BYTES_PER_S) * 1e3
    return hbm, compute


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=seqs_arg, nargs="+", default=[256], help="numbers, or default")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--shape", default="llama31-8b", choices=["llama31-8b", "deepseek-v2-lite"])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    llama = args.shape == "llama31-8b"
    cfg_dir = write_config_dir(LLAMA_31_8B if llama else DEEPSEEK_V2_LITE, os.path.join(args.out, args.shape))
    res: dict[str, dict[int | None, list[dict]]] = {v: {s: [] for s in args.max_num_seqs} for v in args.variants}
    for seqs in args.max_num_seqs:
        for rep in range(args.repeats):
            order = args.variants if rep % 2 == 0 else list(reversed(args.variants))
            for v in order:
                res[v][seqs].append(run(cfg_dir, args.out, v, seqs, rep, args.num_prompts))
    with open(os.path.join(args.out, "gpu_fp8.json"), "w") as f:
        json.dump({v: {str(s or "default"): runs for s, runs in d.items()} for v, d in res.items()}, f, indent=2)

    print("\n| run | max-num-seqs | requests/s median (min-max) | x bf16 | output tok/s | decode step (batch) "
          "| HBM floor | FP8 matmul-at-peak + KV floor | host ms/step median (p99) | GPU idle |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seqs in args.max_num_seqs:
        base = statistics.median(r["requests_per_s"] for r in res["bf16"][seqs]) if "bf16" in res else None
        for v in args.variants:
            runs = res[v][seqs]
            rps = [r["requests_per_s"] for r in runs]
            med = statistics.median(rps)
            best = max(runs, key=lambda r: r["requests_per_s"])
            hbm, compute = floors_ms(best, v == "fp8-kv") if v != "bf16" and llama else (float("nan"),) * 2
            ratio = f"{med / base:.3f}x" if base else ""
            host = " / ".join(f"{r.get('host_step_ms_median') or 0:.2f} ({r.get('host_step_ms_p99') or 0:.1f})"
                              for r in runs)
            idle = " / ".join(f"{100 * (r.get('gpu_idle_fraction') or 0):.1f} %" for r in runs)
            print(f"| {v} | {seqs or 'default'} | {med:.2f} ({min(rps):.2f}-{max(rps):.2f}) | {ratio} | "
                  f"{statistics.median(r['output_tokens_per_s'] for r in runs):.0f} | "
                  f"{best.get('decode_step_ms_at_max_batch') or 0:.2f} ms ({best.get('max_decode_batch')}) | "
                  f"{hbm:.2f} ms | {compute:.2f} ms | {host} | {idle} |")


if __name__ == "__main__":
    main()
